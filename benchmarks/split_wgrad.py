"""Is a row-chunked "cuBLAS wgrad into an L2-sized fp32 scratch, then the update kernel" faster than
the fused kernel? (H200)

    PYTHONPATH=src python benchmarks/split_wgrad.py

For each weight shape and BT, same run, do_bench median:
  (a) the fused Triton kernel (best known configs for the BT regime);
  (b) cuBLAS wgrad dY^T X alone;  (c) (b) + torch._fused_adamw_ on bf16 W, G, m, v;
  (s) split: for row chunks of CHUNK_MB of fp32 gradient, G_chunk = dY[:, rows]^T X (cuBLAS, fp32
      output via torch.mm(out_dtype=float32)), then the fused kernel's BT=0 launch applies the
      update from that chunk (the gradient enters as the fp32 buffer). The chunk is small enough to
      stay in L2 between the GEMM that writes it and the update that reads it, so the gradient's HBM
      traffic of (c) disappears, and the full gradient never exists.
Also checks that (s) writes the bits (a) writes (bf16 W/m/v, stochastic rounding with the same
hash offsets: each chunk's hash key is shifted by its first element's offset), up to the few
elements where the two GEMMs' summation orders round differently.
Writes $OUT/split_wgrad.json (else benchmarks/results/split-wgrad-<date>.json).
"""
from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from forge_optim.backends.base import StateView  # noqa: E402
from forge_optim.kernels import launch as L  # noqa: E402
from forge_optim.rules import RULES  # noqa: E402
from forge_optim.rules.base import StateSpec  # noqa: E402

from bench_kernel import unfused_step  # noqa: E402  (this script's folder is on sys.path)
from results_path import result_path  # noqa: E402  (benchmarks/ is the script directory)

RULE = RULES["AdamW"]
GROUP = dict(RULE.defaults, lr=1e-3, weight_decay=0.1)
COEFFS = RULE.padded(RULE.coefficients(GROUP, {}, 10))
KEYS = (12345, 67890, 13579)


def views(m, v, r0=0, r1=None):
    return (StateView(StateSpec("exp_avg", 0), m[r0:r1]),
            StateView(StateSpec("exp_avg_sq", 1, nonnegative=True), v[r0:r1]), None)


def fused(W, m, v, dy, x, nf, cfg):
    L.launch(weight=W, dy=dy, x=x, rule_update=RULE.triton_update, coeffs=COEFFS, states=views(m, v),
             nonfinite=nf, stochastic_weight=True, stochastic_state=True, key_weight=KEYS[0],
             key_states=(KEYS[1], KEYS[2], 0), config=cfg)


def split(W, m, v, dy, x, nf, cfg, rows, scratch):
    M, N = W.shape
    for r0 in range(0, M, rows):
        r1 = min(M, r0 + rows)
        g = scratch[: (r1 - r0) * N].view(r1 - r0, N)
        torch.mm(dy[:, r0:r1].t(), x, out_dtype=torch.float32, out=g)
        shift = r0 * N  # the hash input is (offset + key): shifting the key by the chunk's first offset
        L.launch(weight=W[r0:r1], dy=dy[:0, r0:r1], x=x[:0], rule_update=RULE.triton_update, coeffs=COEFFS,
                 states=views(m, v, r0, r1), grad_buffer=g, nonfinite=nf, stochastic_weight=True,
                 stochastic_state=True, key_weight=KEYS[0] + shift,
                 key_states=(KEYS[1] + shift, KEYS[2] + shift, 0), config=cfg)


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command=" ".join([sys.executable] + sys.argv), rows=[])
    path = result_path("split_wgrad.json", "split-wgrad")
    scratch = torch.empty(64 * 2**20 // 4, device="cuda", dtype=torch.float32)
    bench = lambda fn: do_bench(fn, warmup=10, rep=60, return_mode="median")  # noqa: E731
    for (M, N) in [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096), (128256, 4096)]:
        for BT in ([512] if M > 100000 else [512, 2048, 8192]):
            row = dict(shape=f"{M}x{N}", BT=BT)
            dy = torch.randn(BT, M, device="cuda", generator=gen).bfloat16()
            x = torch.randn(BT, N, device="cuda", generator=gen).bfloat16()
            W0 = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
            m0 = (torch.randn(M, N, device="cuda", generator=gen) * 1e-3).bfloat16()
            v0 = (torch.randn(M, N, device="cuda", generator=gen) * 1e-3).square().bfloat16()
            W, m, v = W0.clone(), m0.clone(), v0.clone()
            nf = torch.zeros((), dtype=torch.int64, device="cuda")
            row["wgrad_ms"] = bench(lambda: dy.t() @ x)
            row["unfused_ms"] = bench(unfused_step(W, m, v, lambda: (dy, x)))
            tcfgs = [L.SMALL_BT_CONFIGS[-2], L.SMALL_BT_CONFIGS[4]] if BT <= 1024 else \
                [L.LARGE_BT_CONFIGS[0], L.LARGE_BT_CONFIGS[4]]
            for c in tcfgs:
                row["fused " + c.short()] = bench(lambda: fused(W, m, v, dy, x, nf, c))
            for c in L.ELEMENTWISE_CONFIGS:
                for mb in (8, 16, 32):
                    rows = max(64, (mb * 2**20 // (4 * N)) // 64 * 64)
                    row[f"split {mb}MB " + c.short()] = bench(lambda: split(W, m, v, dy, x, nf, c, rows, scratch))
            fa = min(v_ for k, v_ in row.items() if k.startswith("fused"))
            sp = min(v_ for k, v_ in row.items() if k.startswith("split"))
            row.update(best_fused_ms=fa, best_split_ms=sp, fused_over_c=fa / row["unfused_ms"],
                       split_over_c=sp / row["unfused_ms"], split_over_fused=sp / fa)
            # same bits? (one step each from the same start)
            Wa, ma, va = W0.clone(), m0.clone(), v0.clone()
            fused(Wa, ma, va, dy, x, None, tcfgs[0])
            Ws, ms, vs = W0.clone(), m0.clone(), v0.clone()
            split(Ws, ms, vs, dy, x, None, L.ELEMENTWISE_CONFIGS[0], 1024, scratch)
            torch.cuda.synchronize()
            for s, a, b in (("w", Wa, Ws), ("m", ma, ms), ("v", va, vs)):
                d = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
                row[f"bits_differ_frac_{s}"] = (d != 0).float().mean().item()
                row[f"max_ulp_{s}"] = d.max().item()
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
            path.write_text(json.dumps(out, indent=1) + "\n")
            del dy, x, W0, m0, v0, W, m, v, Wa, ma, va, Ws, ms, vs
            torch.cuda.empty_cache()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
