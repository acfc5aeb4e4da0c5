"""Old/new A/B of an epilogue change: the same forced configs of the fused kernel, timed under whatever
tree ``PYTHONPATH`` points at, with torch's wgrad GEMM + ``_fused_adamw_`` (c) in the same process.

    PYTHONPATH=OLD/src python3 benchmarks/epilogue_ab.py --label old --out old.json
    PYTHONPATH=NEW/src python3 benchmarks/epilogue_ab.py --label new --out new.json
    ... --configs "SHORT|SHORT" --bts 64,512 --shapes 4096x4096,14336x4096 --states bf16,int8

Run the trees in turn in one device call (old, new, old, new: drift shows as a spread between rounds)
and compare per (shape, BT, states, config). BT=64 is the update alone (the GEMM is ~4% of it), BT=512
the regime where the GEMM is mostly hidden (NOTES.md, twentieth session). Each row also records a digest
of the bits one update writes from fixed states, inputs and keys (``bench_kernel.fixed_job``), so that
two trees can be checked for bit identity where a change should keep it (int8 states: no state SR).
The default configs are the H100's BT=512 winners of the twentieth session's table. Times are
triton.testing.do_bench medians over rotating dY/X (an L2 flush before each call).
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

from bench_kernel import fixed_job, make_states, rotating_inputs, unfused_step  # noqa: E402
from epilogue_lookahead import digest  # noqa: E402
from forge_optim.backends.triton_backend import TritonBackend  # noqa: E402
from forge_optim.kernels import fused  # noqa: E402
from forge_optim.kernels import launch as L  # noqa: E402
from forge_optim.rules import RULES  # noqa: E402

H100_WINNERS = ("128x256x64 w16 s3 g8 p1 e8 tma la1|64x64x64 w4 s3 g8 p4 e4 tma r128 pf la1|"
                "64x128x64 w4 s3 g8 p3 e8 tma r168")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default=H100_WINNERS, help="'|'-separated KernelConfig.short() names of "
                    "launch.ALL_TUNED_CONFIGS")
    ap.add_argument("--bts", default="64,512")
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
    ap.add_argument("--states", default="bf16,int8")
    a = ap.parse_args()
    known = {c.short(): c for c in L.ALL_TUNED_CONFIGS}
    cfgs = [known[s] for s in a.configs.split("|")]
    bts = [int(b) for b in a.bts.split(",")]
    shapes = [tuple(int(d) for d in s.split("x")) for s in a.shapes.split(",")]
    modes = a.states.split(",")
    t0 = time.time()
    for line in L.precompile([dict(config=c, kinds=fused.ADAM_STATE_KINDS[m]) for c in cfgs for m in modes]):
        if line.startswith("FAILED"):
            print(line, flush=True)
    print(f"[{a.label}] precompiled {len(cfgs) * len(modes)} variants in {time.time() - t0:.0f} s", flush=True)
    rule = RULES["AdamW"]
    group = dict(rule.defaults, lr=1e-4, weight_decay=0.1)
    rows = []
    for BT in bts:
        for M, N in shapes:
            gen = torch.Generator(device="cuda").manual_seed(M * 7 + N + BT)
            nxt = rotating_inputs(BT, M, N, gen, 3)
            W = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
            dy0, x0 = nxt()
            t_c = do_bench(unfused_step(W, torch.zeros_like(W), torch.zeros_like(W), nxt), warmup=10, rep=40,
                           return_mode="median")
            for mode in modes:
                for cfg in cfgs:
                    backend = TritonBackend(config=cfg)
                    g2 = torch.Generator(device="cuda").manual_seed(1)
                    Wb = (torch.randn(M, N, device="cuda", generator=g2) * 0.02).bfloat16()
                    views = make_states(mode, M, N, g2, rule, group)
                    nf = torch.zeros((), dtype=torch.int64, device="cuda")
                    job = fixed_job(Wb, views, rule, group, nonfinite=nf)
                    backend.update(job, dy0, x0)
                    torch.cuda.synchronize()
                    bits = digest(Wb, *[v.data for v in views], *[v.scale for v in views if v.quantized])

                    def fn(job=job, backend=backend, nxt=nxt):
                        d, x = nxt()
                        backend.update(job, d, x)
                    t = do_bench(fn, warmup=10, rep=40, return_mode="median")
                    assert int(nf) == 0
                    rows.append(dict(label=a.label, shape=f"{M}x{N}", BT=BT, states=mode, config=cfg.short(),
                                     ms=t, unfused_ms=t_c, a_over_c=t / t_c, bits=bits))
                    print(f"[{a.label}] {M:>6}x{N:<6} BT={BT:<4} {mode:4s} {cfg.short():40s} {t:8.4f} ms  "
                          f"(c) {t_c:8.4f}  a/c {t / t_c:5.3f}  bits {bits}", flush=True)
                    del views, Wb, job
                    torch.cuda.empty_cache()
            del W, nxt
            torch.cuda.empty_cache()
    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command=" ".join([sys.executable] + sys.argv), label=a.label, rows=rows)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}", flush=True)


if __name__ == "__main__":
    main()
