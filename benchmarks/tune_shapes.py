"""Tune the fused kernel on the whole weight for the common shapes; write the shipped table.

    PYTHONPATH=src python benchmarks/tune_shapes.py --out $OUT/nvidia_h200.json [--quick]

The runtime tuner times candidates on a sub-problem of at most TUNE_ROWS rows (no weight-sized copy
in a training step), which does not always rank them as the whole weight does
(benchmarks/tuner_fidelity.py). This script, run once per device and kernel version, times every
candidate config of each (shape, BT, state mode) on clones of the *whole* weight and its states, in
two passes (the second in reverse order, so that a clock drift does not favour one end of the list),
keeps each candidate's faster pass, and writes the winners keyed exactly as TritonBackend keys its
tuning (``triton_backend.tuning_key``). Copy the output to src/forge_optim/kernels/tuned/ (the file
name is ``kernels.tuned.table_path(device)``). Shapes: Llama-3.1-8B's linears (AdamW, bf16 weights,
stochastic rounding, bf16 and int8 states, the non-finite count on: the optimizer's defaults).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernel import SHAPES, make_states  # noqa: E402

from forge_optim import precision  # noqa: E402
from forge_optim.backends.base import UpdateJob  # noqa: E402
from forge_optim.backends.triton_backend import launch_kwargs, tuning_key, tuning_launch  # noqa: E402
from forge_optim.kernels import fused as fk  # noqa: E402
from forge_optim.kernels import tuned  # noqa: E402
from forge_optim.kernels.launch import candidate_configs, precompile  # noqa: E402
from forge_optim.rules import RULES  # noqa: E402

BTS = [512, 2048, 8192]
MODES = ["bf16", "int8"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES))
    ap.add_argument("--bts", default=",".join(map(str, BTS)))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep (ms) per candidate and pass")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    bts = [int(b) for b in a.bts.split(",")]
    modes = a.modes.split(",")
    t0 = time.time()
    specs = {repr((c, m)): dict(config=c, kinds=fk.ADAM_STATE_KINDS[m]) for m in modes for bt in bts
             for c in candidate_configs(bt)}
    precompile(list(specs.values()))
    print(f"precompiled {len(specs)} variants in {time.time() - t0:.0f} s", flush=True)
    from forge_optim.cli.bench import source_digest

    rule = RULES["AdamW"]
    group = dict(rule.defaults, lr=1e-4, weight_decay=0.1)
    coeffs = rule.padded(rule.coefficients(group, {}, 10))
    gen = torch.Generator(device="cuda").manual_seed(0)
    device = torch.cuda.get_device_name()
    entries = []
    for (M, N) in shapes:
        for BT in bts:
            dy = torch.randn(BT, M, device="cuda", generator=gen).bfloat16()
            x = torch.randn(BT, N, device="cuda", generator=gen).bfloat16()
            W = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
            for mode in modes:
                views = make_states(mode, M, N, gen)
                job = UpdateJob(weight=W, rule=rule, coeffs=coeffs, states=views, stochastic_weight=True,
                                stochastic_state=True, key_weight=precision.stream_key(0, 0, 1, 0),
                                key_states=(precision.stream_key(0, 0, 1, 1), precision.stream_key(0, 0, 1, 2), 0),
                                nonfinite=torch.zeros((), dtype=torch.int64, device="cuda"))
                kwargs = launch_kwargs(job, dy, x)
                key = tuning_key(job, dy, kwargs)
                cands = list(candidate_configs(BT))
                times = {c.short(): float("inf") for c in cands}
                for order in (cands, cands[::-1]):
                    for cfg in order:
                        fn = tuning_launch(kwargs, cfg, max_rows=M)  # clones of the whole weight
                        try:
                            fn()
                            torch.cuda.synchronize()
                            t = do_bench(fn, warmup=5, rep=a.rep, return_mode="median")
                        except Exception as err:  # noqa: BLE001 - does not fit: never the winner
                            print(f"    {cfg.short()}: {err!r}"[:200], flush=True)
                            t = float("inf")
                        times[cfg.short()] = min(times[cfg.short()], t)
                        del fn
                    torch.cuda.empty_cache()
                ranked = sorted(cands, key=lambda c: times[c.short()])
                best = ranked[0]
                entries.append(dict(key=tuned.key_text(key), shape=f"{M}x{N}", BT=BT, states=mode,
                                    config=asdict(best), ms=times[best.short()],
                                    timings_ms={c.short(): (times[c.short()] if times[c.short()] < float("inf") else None)
                                                for c in ranked}))
                print(f"{M:>6}x{N:<6} BT={BT:<5} {mode:4s} {best.short():<42} {times[best.short()]:.4f} ms"
                      f"   (next {ranked[1].short()} {times[ranked[1].short()]:.4f})", flush=True)
                del views, job, kwargs
                torch.cuda.empty_cache()
                out = dict(device=device, date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                           torch=torch.__version__, triton=triton.__version__, source_digest=source_digest(),
                           command=" ".join([sys.executable] + sys.argv),
                           note="written by benchmarks/tune_shapes.py: each candidate timed on the whole weight",
                           entries=entries)
                Path(a.out).write_text(json.dumps(out, indent=1))
            del dy, x, W
            torch.cuda.empty_cache()
    print(f"wrote {a.out} ({len(entries)} entries) in {time.time() - t0:.0f} s; "
          f"ship it as src/forge_optim/kernels/tuned/{tuned.table_path(device).name}")


if __name__ == "__main__":
    main()
