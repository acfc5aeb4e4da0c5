"""What bounds the fused kernel at small BT: its bytes, or the epilogue's arithmetic?

    PYTHONPATH=src python benchmarks/epilogue_cost.py [--shapes 4096x4096,14336x4096] [--bt 512]

One tile schedule per run (each config of --configs is forced, no tuning), the same dY and X, and
epilogues that differ in bytes per weight element and in ALU work:
  adamw-bf16-sr   AdamW, bf16 W/m/v, stochastic rounding (3 hashes)   12 B/elem   (the default)
  adamw-bf16-rn   the same, round-to-nearest (no hash)                12 B/elem
  adamw-fp32      AdamW, bf16 W (SR), fp32 m/v                        20 B/elem
  adamw-int8      AdamW, bf16 W (SR), int8 m/v + per-64 bf16 scales   8.125 B/elem
  sgd-bf16-sr     SGD without momentum: W only (1 hash)               4 B/elem
  accumulate      fp32 buffer += G (no rule, no hash)                 8 B/elem
and torch's wgrad GEMM alone. If time follows bytes, the kernel is bandwidth-bound; if RN is much
faster than SR at equal bytes, or fp32 state costs little more than bf16, the epilogue's ALU work
(the integer hash, the int8 absmax) is on the critical path. Prints a table and writes JSON to
$OUT/epilogue_cost.json (else benchmarks/results/epilogue-cost-<date>.json), with each compiled
variant's registers and spills.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from forge_optim.backends.triton_backend import TritonBackend  # noqa: E402
from forge_optim.kernels import launch as L  # noqa: E402
from forge_optim.rules import RULES  # noqa: E402

from bench_kernel import fixed_job, make_states  # noqa: E402  (this script's folder is on sys.path)
from results_path import result_path  # noqa: E402  (benchmarks/ is the script directory)

BYTES = {"adamw-bf16-sr": 12, "adamw-bf16-rn": 12, "adamw-fp32": 20, "adamw-int8": 8.125,
         "sgd-bf16-sr": 4, "accumulate": 8}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,14336x4096")
    ap.add_argument("--bt", type=int, default=512)
    ap.add_argument("--configs", default="-2,-5", help="indices into SMALL_BT_CONFIGS")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    configs = [L.SMALL_BT_CONFIGS[int(i)] for i in a.configs.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for cfg in configs:
        os.environ["FORGE_TRITON_CONFIG"] = cfg.env()
        backend = TritonBackend()
        for M, N in shapes:
            dy = torch.randn(a.bt, M, device="cuda", generator=gen).bfloat16()
            x = torch.randn(a.bt, N, device="cuda", generator=gen).bfloat16()
            t_gemm = do_bench(lambda: dy.t() @ x, warmup=10, rep=60, return_mode="median")
            for variant in BYTES:
                rule = RULES["SGD" if variant.startswith("sgd") else "AdamW"]
                group = dict(rule.defaults, lr=1e-4, weight_decay=0.1)
                W = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
                nf = torch.zeros((), dtype=torch.int64, device="cuda")
                if variant == "accumulate":
                    buf = torch.zeros(M, N, device="cuda", dtype=torch.float32)

                    def fn():
                        backend.accumulate(buf, dy, x)
                else:
                    mode = {"adamw-int8": "int8", "adamw-fp32": "fp32"}.get(variant, "bf16")
                    views = make_states(mode, M, N, gen, rule, group)
                    sr = not variant.endswith("-rn")
                    job = fixed_job(W, views, rule, group, sr=sr, nonfinite=nf)

                    def fn():
                        backend.update(job, dy, x)
                before = set(L._DIRECT)
                fn()
                torch.cuda.synchronize()
                new = [L._DIRECT[k] for k in set(L._DIRECT) - before]
                t = do_bench(fn, warmup=10, rep=60, return_mode="median")
                meta = dict(n_regs=getattr(new[0], "n_regs", None), n_spills=getattr(new[0], "n_spills", None)) \
                    if new else {}
                tb = BYTES[variant] * M * N / (t * 1e-3) / 1e12
                row = dict(config=cfg.short(), shape=f"{M}x{N}", BT=a.bt, variant=variant, ms=t,
                           gemm_ms=t_gemm, bytes_per_elem=BYTES[variant], state_tb_s=tb, **meta)
                rows.append(row)
                print(f"{cfg.short():40s} {M:>6}x{N:<6} {variant:14s} {t:7.4f} ms  gemm {t_gemm:7.4f}  "
                      f"{tb:5.2f} TB/s of state  regs {meta.get('n_regs')} spills {meta.get('n_spills')}",
                      flush=True)
                del W
                torch.cuda.empty_cache()
    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command=" ".join([sys.executable] + sys.argv), rows=rows)
    path = result_path("epilogue_cost.json", "epilogue-cost")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
