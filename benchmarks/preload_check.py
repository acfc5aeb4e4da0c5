"""Register preload of each tile's W/states before its mainloop: same bits, and is it faster? (H200)

    PYTHONPATH=src python benchmarks/preload_check.py [--out PATH] [--shapes ...] [--no-precompile]

For every config of ``launch.EXPLORE_PRELOAD_CONFIGS`` and its twin without preload (the same config
with preload=False), bf16 W + bf16 AdamW states with stochastic rounding, non-finite count on:
1. Bits: both run once from identical clones of W, m, v on the same dY, X; W, m, v must be
   torch.equal (the preload only moves the loads before the mainloop).
2. Time: triton.testing.do_bench median of the fused launch (launch.launch directly: no tuner, the
   direct-launch path), over rotating dY/X sets (bench_kernel.rotating_inputs), each config on its
   own clones (the update is applied in place, as in bench_kernel.py).
Shapes: 4096x4096, 14336x4096 and 1024x4096 at BT=512 (the small-BT configs' regime, where the
epilogue looked latency-bound: NOTES.md, fourth session) and 4096x4096 at BT=2048. Every config runs
on every shape (the 128x128 one is the large-BT winner; the 64x* ones are small-BT winners).
The variants are compiled first in parallel processes (launch.precompile), so the run takes well
under a minute. Prints a table; writes JSON to --out (default $OUT/preload-check.json if $OUT is
set, else benchmarks/results/preload-check-<date>.json) with the device, versions and command.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

SHAPES = "4096x4096x512,14336x4096x512,1024x4096x512,4096x4096x2048"  # Dout x Din x BT


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated DoutxDinxBT")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/preload-check.json or "
                                                "benchmarks/results/preload-check-<date>.json)")
    ap.add_argument("--no-precompile", action="store_true", help="compile in this process, one by one")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("preload_check.py: unset TRITON_INTERPRET (this benchmark times the compiled kernel on a GPU)")
    if not torch.cuda.is_available():
        sys.exit("preload_check.py needs a CUDA GPU (written for an H200); no CUDA device is visible. "
                 "CPU checks of the preload path: pytest tests/test_triton_kernel.py -k preload")

    import triton
    from triton.testing import do_bench

    from forge_optim.backends.base import StateView
    from forge_optim.kernels import fused
    from forge_optim.kernels import launch as L
    from forge_optim.rules import RULES

    from bench_kernel import make_states, rotating_inputs  # noqa: E402  (this script's folder is on sys.path)

    t_start = time.time()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    pairs = [(cfg, replace(cfg, preload=False)) for cfg in L.EXPLORE_PRELOAD_CONFIGS]
    if not a.no_precompile:
        specs = [dict(config=c, kinds=fused.ADAM_STATE_KINDS["bf16"]) for pair in pairs for c in pair]
        lines = L.precompile(specs)
        print(f"precompiled {len(specs)} variants in {time.time() - t_start:.0f}s", flush=True)
        for line in lines:
            if line.startswith("FAILED"):
                print(line, flush=True)

    rule = RULES["AdamW"]
    group = dict(rule.defaults, lr=1e-4, weight_decay=0.1)
    coeffs = rule.padded(rule.coefficients(group, {}, 10))
    gen = torch.Generator(device="cuda").manual_seed(0)

    def runner(cfg, W, views, nf):
        """launch(dy, x) of cfg on W and its states (StateViews), in place."""
        slots = [None, None, None]
        for v in views:
            slots[v.spec.slot] = v
        kw = dict(weight=W, rule_update=rule.triton_update, coeffs=coeffs, states=tuple(slots), nonfinite=nf,
                  stochastic_weight=True, stochastic_state=True, key_weight=123, key_states=(456, 789, 0),
                  config=cfg)
        return lambda d, x: L.launch(dy=d, x=x, **kw)

    rows = []
    for M, N, BT in shapes:
        nxt = rotating_inputs(BT, M, N, gen, 3)
        dy0, x0 = nxt()  # the inputs of the bit comparison
        W = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
        views = make_states("bf16", M, N, gen, rule, group)
        for cfg, twin in pairs:
            res = {}
            for c in (cfg, twin):  # each from identical clones of W, m, v
                Wc = W.clone()
                vc = [StateView(v.spec, v.data.clone()) for v in views]
                nf = torch.zeros((), dtype=torch.int64, device="cuda")
                run = runner(c, Wc, vc, nf)
                out = run(dy0, x0)
                torch.cuda.synchronize()
                compiled = out[0] if isinstance(out, tuple) else None
                res[c] = dict(W=Wc.clone(), m=vc[0].data.clone(), v=vc[1].data.clone(), nf=int(nf),
                              regs=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None))
                res[c]["ms"] = do_bench(lambda: run(*nxt()), warmup=10, rep=40, return_mode="median")
                del Wc, vc
            p, t = res[cfg], res[twin]
            same = {k: torch.equal(p[k], t[k]) for k in ("W", "m", "v")}
            identical = all(same.values()) and p["nf"] == t["nf"] == 0
            row = dict(shape=f"{M}x{N}", BT=BT, config=cfg.short(), twin=twin.short(),
                       config_fields=asdict(cfg), preload_ms=p["ms"], twin_ms=t["ms"],
                       speedup=t["ms"] / p["ms"], identical=identical, equal=same,
                       preload_regs=p["regs"], preload_spills=p["spills"], twin_regs=t["regs"],
                       twin_spills=t["spills"])
            rows.append(row)
            print(f"{M:>6}x{N:<5} BT={BT:<5} {cfg.short():44s} preload {p['ms']:7.4f} ms  twin {t['ms']:7.4f} ms  "
                  f"x{row['speedup']:5.3f}  bits {'identical' if identical else 'DIFFER ' + str(same)}  "
                  f"regs/spills {p['regs']}/{p['spills']} vs {t['regs']}/{t['spills']}", flush=True)
            del res, p, t
        del W, views, nxt, dy0, x0
        torch.cuda.empty_cache()

    print()
    print("| shape | BT | config (preload) | preload ms | twin ms | twin/preload | bits | regs/spills pl vs twin |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['BT']} | {r['config']} | {r['preload_ms']:.4f} | {r['twin_ms']:.4f} | "
              f"{r['speedup']:.3f} | {'identical' if r['identical'] else 'DIFFER'} | "
              f"{r['preload_regs']}/{r['preload_spills']} vs {r['twin_regs']}/{r['twin_spills']} |")
    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command=" ".join([sys.executable] + sys.argv), wall_s=time.time() - t_start,
               all_identical=all(r["identical"] for r in rows), rows=rows)
    if a.out:
        path = Path(a.out)
    elif os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "preload-check.json"
    else:
        path = Path(__file__).resolve().parent / "results" / f"preload-check-{dt.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path} ({time.time() - t_start:.0f}s)")
    if not out["all_identical"]:
        sys.exit("preload changed bits for some config (see 'bits' above)")


if __name__ == "__main__":
    main()
