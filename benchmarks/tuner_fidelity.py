"""Does the tuner's sub-problem pick the config that is fastest on the whole weight?

    PYTHONPATH=src python benchmarks/tuner_fidelity.py --out $OUT/tuner_fidelity.json [--quick]

The tuner (kernels/launch.py: Tuner) times each candidate config on clones of at most
``triton_backend.TUNE_ROWS`` rows of W and its states, so that a 128256 x 4096 lm_head does not clone
3 GiB on its first step. On 2026-12-03 (ninth session) bench_kernel's lm_head at BT=8192 ran the
tuner's pick at 18.4 ms where another candidate ran 15.8 ms: the 4096-row sub-problem ranked them
the other way. This script times every candidate of each case on sub-problems of several row counts
and on the whole weight, and reports, per row count, how much slower its pick is on the whole weight
than the best candidate there (``loss``). Times are triton.testing.do_bench medians; the whole-weight
timing uses a longer ``rep`` than the tuner does.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernel import parse_cases, random_case  # noqa: E402

from forge_optim.backends.triton_backend import launch_kwargs, tuning_launch  # noqa: E402
from forge_optim.kernels import fused as fk  # noqa: E402
from forge_optim.kernels.launch import candidate_configs, precompile  # noqa: E402

# (Dout, Din, BT, state mode)
CASES = [
    (128256, 4096, 8192, "bf16"), (128256, 4096, 8192, "int8"),
    (14336, 4096, 8192, "bf16"), (4096, 14336, 8192, "bf16"),
    (128256, 4096, 512, "bf16"), (128256, 4096, 512, "int8"),
    (14336, 4096, 512, "bf16"), (4096, 14336, 512, "bf16"),
    (128256, 4096, 2048, "bf16"), (14336, 4096, 2048, "bf16"),
]
QUICK = CASES[:2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="4096,16384", help="sub-problem row counts (the whole weight is always timed)")
    ap.add_argument("--quick", action="store_true", help="the lm_head at BT=8192 only")
    ap.add_argument("--cases", default="", help="DOUTxDIN:BT:MODE,... instead of the Llama-3.1-8B cases, "
                    "e.g. 151936x4096:8192:bf16 (Qwen3-8B's lm_head, outside the shipped table)")
    a = ap.parse_args()
    row_counts = [int(r) for r in a.rows.split(",")]
    cases = QUICK if a.quick else CASES
    if a.cases:
        cases = parse_cases(a.cases)
    t0 = time.time()
    specs = [dict(config=c, kinds=fk.ADAM_STATE_KINDS[m])
             for m in ("bf16", "int8") for bt in sorted({c[2] for c in cases}) for c in candidate_configs(bt)]
    specs = list({repr(s): s for s in specs}.values())
    precompile(specs)
    print(f"precompiled {len(specs)} variants in {time.time() - t0:.0f} s", flush=True)

    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for (M, N, BT, mode) in cases:
        job, dy, x = random_case(M, N, BT, mode, gen)
        kwargs = launch_kwargs(job, dy, x)
        sizes = [r for r in row_counts if r < M] + [M]
        table = {}
        for cfg in candidate_configs(BT):
            row = {}
            for r in sizes:
                fn = tuning_launch(kwargs, cfg, max_rows=r)
                try:
                    fn()
                    torch.cuda.synchronize()
                    # the tuner's own do_bench settings on sub-problems; longer on the whole weight
                    row[r] = do_bench(fn, warmup=5, rep=100 if r == M else 25, return_mode="median")
                    if r == sizes[0]:  # the tuner's run-to-run spread: the same sub-problem again
                        row[f"{r}b"] = do_bench(fn, warmup=5, rep=25, return_mode="median")
                except Exception as err:  # a config that does not fit is skipped, as the tuner does
                    row[r] = float("inf")
                    row["error"] = repr(err)[:200]
                del fn
                torch.cuda.empty_cache()
            table[cfg.short()] = row
        best_full = min(v[M] for v in table.values())
        summary = {}
        for r in sizes[:-1] + [f"{sizes[0]}b"]:
            pick = min(table, key=lambda c: table[c][r])
            summary[str(r)] = dict(pick=pick, pick_full_ms=table[pick][M], loss=table[pick][M] / best_full)
        full_best = min(table, key=lambda c: table[c][M])
        res = dict(shape=f"{M}x{N}", BT=BT, states=mode, best_full=full_best, best_full_ms=best_full,
                   picks=summary, table={c: {str(k): v for k, v in row.items()} for c, row in table.items()})
        results.append(res)
        print(f"{M}x{N} BT={BT} {mode}: best on the whole weight {full_best} {best_full:.4f} ms", flush=True)
        for r, s in summary.items():
            print(f"    rows {r:>6}: pick {s['pick']:<40} whole {s['pick_full_ms']:.4f} ms  loss {s['loss']:.3f}",
                  flush=True)
        for c, row in sorted(table.items(), key=lambda kv: kv[1][M]):
            print("      " + c.ljust(42) + "  ".join(f"{k}:{v:.4f}" for k, v in row.items() if k != "error"),
                  flush=True)
        del dy, x, job, kwargs
        torch.cuda.empty_cache()
        out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                   device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   command=" ".join([sys.executable] + sys.argv), results=results)
        Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
