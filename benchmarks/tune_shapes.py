"""Tune the fused kernel on the whole weight for the common shapes; write the shipped table.

    PYTHONPATH=src python benchmarks/tune_shapes.py --out $OUT/nvidia_h200.json

Llama-3.1-8B's linears at BT 512, 2048, 8192 with bf16 and int8 states (AdamW with the optimizer's
defaults), each candidate config timed on clones of the whole weight (forge_optim.kernels.tune, the
same code as ``forge-optim tune``). Copy the output to src/forge_optim/kernels/tuned/ (the file name is
``kernels.tuned.table_name(device)``) after any change to the kernel. The H200 table of 2026-12-03 took
69 s (results/tune-shapes-2026-12-03.log).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernel import SHAPES  # noqa: E402

from forge_optim.kernels import tune, tuned  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES))
    ap.add_argument("--bts", default="512,2048,8192")
    ap.add_argument("--modes", default="bf16,int8")
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep (ms) per candidate and pass")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    t0 = time.time()
    entries = tune.tune_entries(shapes, [int(b) for b in a.bts.split(",")], a.modes.split(","), rep=a.rep,
                                log=lambda s: print(s, flush=True))
    path = tune.write_table(entries, Path(a.out), merge=False)
    print(f"wrote {path} ({len(entries)} entries) in {time.time() - t0:.0f} s; "
          f"ship it as src/forge_optim/kernels/tuned/{tuned.table_name(torch.cuda.get_device_name())}")


if __name__ == "__main__":
    main()
