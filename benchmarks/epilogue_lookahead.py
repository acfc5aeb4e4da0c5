"""A/B of the epilogue's load lookahead on the H200 (the question of benchmarks/NOTES.md, seventh session).

    PYTHONPATH=src python3 benchmarks/epilogue_lookahead.py --label new --out new.json
    PYTHONPATH=OLD/src python3 benchmarks/epilogue_lookahead.py --label old --out old.json
    ... --plan flatten        the flattened tile loop on the lookahead winners
    ... --plan winners        the tuned winners only: an old/new A/B of any later epilogue change
    ... --plan bt8192         two CTAs per SM at BT=8192 against the tuned one-CTA configs

The Nsight Compute profile of 2026-12-03 showed each epilogue slice issuing its loads of W, m, v only
after the previous slice's stores (a later load may alias an earlier store, so neither the compiler
nor the hardware reorders them), so a tile paid the load latency once per slice, and a CTA-wide
reduction (two barriers) per slice for the non-finite count. ``KernelConfig.epi_lookahead`` issues
the next slice's loads (1) or all slices' loads (2) before the stores; the count is now taken once
per tile. This script times each forced config at each lookahead on the Llama-3.1-8B shapes, with
torch's wgrad GEMM + ``_fused_adamw_`` (c) in the same process for the ratio, and records a digest of
the bits one update writes (fixed inputs and keys), so that runs of two code versions can be compared
for bit identity. Run under a tree without ``epi_lookahead`` (the code before the change) it times
lookahead 0 only. Times: triton.testing.do_bench medians over rotating dY/X.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernel import fixed_job, make_states, rotating_inputs, unfused_step  # noqa: E402
from forge_optim.backends.triton_backend import TritonBackend  # noqa: E402
from forge_optim.kernels import fused  # noqa: E402
from forge_optim.kernels import launch as L  # noqa: E402
from forge_optim.rules import RULES  # noqa: E402

HAS_LA = "epi_lookahead" in {f.name for f in dataclasses.fields(L.KernelConfig)}
S = L.SMALL_BT_CONFIGS
G = L.LARGE_BT_CONFIGS
# (BT, configs with the lookaheads to try, shapes, state modes)
PLAN = [
    (512, [(S[10], (0, 1, 2)), (S[11], (0, 1)), (S[7], (0, 1))],
     [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096), (128256, 4096)], ("bf16", "int8")),
    (2048, [(S[10], (0, 1)), (G[4], (0, 1))], [(4096, 4096), (14336, 4096)], ("bf16",)),
    (8192, [(G[4], (0, 1)), (G[0], (0, 1))], [(4096, 4096), (14336, 4096)], ("bf16",)),
]
QUICK = [(512, [(S[10], (0, 1, 2))], [(4096, 4096), (14336, 4096)], ("bf16", "int8"))]
# --plan flatten: the lookahead-1 winners with and without the flattened tile x K loop (the next tile's
# dY/X loads in flight during this tile's epilogue: the mainloop's TMA wait was 15% of the stalls)
_flat = lambda c: dataclasses.replace(c, flatten=True)  # noqa: E731
FLATTEN = [(512, [(S[10], (1,)), (_flat(S[10]), (1,)), (S[7], (1,)), (_flat(S[7]), (1,))],
            [(4096, 4096), (14336, 4096), (128256, 4096)], ("bf16", "int8"))]
# --plan winners: the tuned lookahead-1 winners only, for an old-tree/new-tree A/B of any epilogue change
# (eighth session: the instruction diet), BT=8192 with the lm_head (the BS=16 gap)
WINNERS = [
    (512, [(S[10], (1,)), (S[7], (1,))],
     [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096), (128256, 4096)], ("bf16", "int8")),
    (8192, [(G[4], (1,)), (G[0], (1,))], [(4096, 4096), (14336, 4096), (128256, 4096)], ("bf16",)),
]
# --plan bt8192: at BT=8192 the tuned configs run one CTA per SM, so each tile's epilogue hides behind
# nothing (the lm_head is 1.06x (c)); two 8-warp 128x128 CTAs per SM (98 KB of shared memory each,
# register cap 128: 36 bytes of spill with 8 epilogue slices, 516 with 4, offline) let one CTA's
# epilogue overlap the other's mainloop. Not in the tuned lists until measured.
_P2 = L.KernelConfig(128, 128, 64, 8, 3, 8, 2, 8, maxnreg=128)
BT8192 = [(8192, [(G[4], (1,)), (G[0], (1,)), (_P2, (1,)), (dataclasses.replace(_P2, prefetch=True), (1,))],
           [(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)], ("bf16",))]


def with_la(cfg, la):
    return dataclasses.replace(cfg, epi_lookahead=la) if HAS_LA else cfg


def digest(*ts):
    h = hashlib.sha256()
    for t in ts:
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plan", choices=["full", "quick", "flatten", "winners", "bt8192"], default="full")
    a = ap.parse_args()
    plan = {"full": PLAN, "quick": QUICK, "flatten": FLATTEN, "winners": WINNERS, "bt8192": BT8192}[a.plan]
    las = lambda t: t if HAS_LA else (0,)  # noqa: E731
    t0 = time.time()
    specs = [dict(config=with_la(c, la), kinds=fused.ADAM_STATE_KINDS[m])
             for _, cfgs, _, modes in plan for c, t in cfgs for la in las(t) for m in modes]
    for line in L.precompile(specs):
        if line.startswith("FAILED"):
            print(line, flush=True)
    print(f"[{a.label}] precompiled {len(specs)} variants in {time.time() - t0:.0f} s", flush=True)
    rule = RULES["AdamW"]
    group = dict(rule.defaults, lr=1e-4, weight_decay=0.1)
    rows = []
    for BT, cfgs, shapes, modes in plan:
        for M, N in shapes:
            gen = torch.Generator(device="cuda").manual_seed(M * 7 + N + BT)
            nxt = rotating_inputs(BT, M, N, gen, 3)
            W = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
            dy0, x0 = nxt()  # before any timing: how many calls do_bench makes varies from run to run
            t_c = do_bench(unfused_step(W, torch.zeros_like(W), torch.zeros_like(W), nxt), warmup=10, rep=40,
                           return_mode="median")
            for mode in modes:
                for cfg0, lat in cfgs:
                    for la in las(lat):
                        cfg = with_la(cfg0, la)
                        backend = TritonBackend(config=cfg)
                        # bits: one update from fixed states and inputs
                        g2 = torch.Generator(device="cuda").manual_seed(1)
                        Wb = (torch.randn(M, N, device="cuda", generator=g2) * 0.02).bfloat16()
                        views = make_states(mode, M, N, g2, rule, group)
                        nf = torch.zeros((), dtype=torch.int64, device="cuda")
                        job = fixed_job(Wb, views, rule, group, nonfinite=nf)
                        backend.update(job, dy0, x0)
                        torch.cuda.synchronize()
                        bits = digest(Wb, *[v.data for v in views], *[v.scale for v in views if v.quantized])

                        def fn(job=job, backend=backend):
                            d, x = nxt()
                            backend.update(job, d, x)
                        t = do_bench(fn, warmup=10, rep=40, return_mode="median")
                        assert int(nf) == 0
                        row = dict(label=a.label, shape=f"{M}x{N}", BT=BT, states=mode, config=cfg.short(),
                                   lookahead=la, ms=t, unfused_ms=t_c, a_over_c=t / t_c, bits=bits)
                        rows.append(row)
                        print(f"[{a.label}] {M:>6}x{N:<6} BT={BT:<5} {mode:4s} {cfg.short():48s} {t:8.4f} ms  "
                              f"(c) {t_c:8.4f}  a/c {t / t_c:5.3f}  bits {bits}", flush=True)
                        del views, Wb, job
                        torch.cuda.empty_cache()
            del W, nxt
            torch.cuda.empty_cache()
    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command=" ".join([sys.executable] + sys.argv), label=a.label, has_lookahead=HAS_LA, rows=rows)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}", flush=True)


if __name__ == "__main__":
    main()
