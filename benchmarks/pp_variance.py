"""Is the ping-pong kernel's time a property of where W/m/v sit in memory? (its in-model time on Llama-3.1-8B
was 1.17x its isolated sweep time, while the Triton tiles' matched; and a 'nocount' twin timed 1.5-1.9x slower)

For one shape and schedule: several fresh allocations of W, m, v (each placed at a different offset inside a
larger buffer), each timed 3 times (do_bench median), the Triton table tile on the same tensors beside it.

    PYTHONPATH=src python3 benchmarks/pp_variance.py [--shape 14336x4096] [--bt 512]
Writes $OUT/pp_variance.json (else benchmarks/results/pp-variance-<date>.json).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_kernel import rotating_inputs  # noqa: E402
from forge_optim.kernels import launch as L  # noqa: E402
from forge_optim.kernels import pingpong as PP  # noqa: E402
from pingpong_check import run_pp, run_triton  # noqa: E402
from results_path import result_path  # noqa: E402  (benchmarks/ is the script directory)

OFFSETS_KIB = [0, 4, 64, 512, 2048, 3 * 1024 + 12]  # where each of W, m, v starts inside its buffer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="14336x4096")
    ap.add_argument("--bt", type=int, default=512)
    a = ap.parse_args()
    M, N = map(int, a.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    pp = PP.PingPongConfig(BN=128, epi_n=4, stages=5, group_size=16)
    tr = {c.short(): c for c in L.ALL_TUNED_CONFIGS}["128x256x64 w16 s3 g8 p1 e8 tma la1"]
    nxt = rotating_inputs(a.bt, M, N, gen, 3)
    nf = torch.zeros((), dtype=torch.int64, device="cuda")
    res = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
               torch=torch.__version__, triton=triton.__version__, command=" ".join([sys.executable] + sys.argv),
               shape=a.shape, BT=a.bt, pingpong=pp.short(), triton_cfg=tr.short(), rows=[])
    for off in OFFSETS_KIB:
        pad = off * 1024 // 2  # bf16 elements

        def placed(scale, square=False):
            buf = torch.empty(pad + M * N + 4096, dtype=torch.bfloat16, device="cuda")
            t = buf[pad:pad + M * N].view(M, N)
            v = torch.randn(M, N, device="cuda", generator=gen) * scale
            t.copy_(v.square() if square else v)
            return t

        W, m, v = placed(0.02), placed(1e-3), placed(1e-3, True)
        row = dict(offset_kib=off, w_addr_mod_2mib=W.data_ptr() % (2 << 20), pp_ms=[], triton_ms=[])
        for _ in range(3):
            row["pp_ms"].append(do_bench(lambda: run_pp(W, m, v, *nxt(), nf, pp), warmup=10, rep=50, return_mode="median"))
            row["triton_ms"].append(do_bench(lambda: run_triton(W, m, v, *nxt(), nf, tr), warmup=10, rep=50,
                                             return_mode="median"))
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        del W, m, v
        torch.cuda.empty_cache()
    path = result_path("pp_variance.json", "pp-variance")
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
