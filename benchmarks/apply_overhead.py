"""Host time of one fused linear's forward on CPU tensors, piece by piece: F.linear alone, the
autograd.Function's Python apply, the C++ apply FORGE calls, and a patched module's call. Answers
whether the C++ apply (stop 20) is faster on a given torch build (the lent H200 runs torch 2.11).

    python3 benchmarks/apply_overhead.py [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import forge_optim  # noqa: E402
from forge_optim import autograd as A  # noqa: E402


def per_call_us(fn, n=2000, repeats=7) -> float:
    for _ in range(200):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t) / n * 1e6)
    return round(statistics.median(ts), 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    opt = forge_optim.AdamW(model, lr=1e-3, backend="torch")
    lin = model[0]
    h = lin._forge_handle
    x = torch.randn(4, 16, requires_grad=True)
    w, b = lin.weight, lin.bias

    def release(out):  # drop the graph: its Use releases the pending count
        del out

    res = {
        "F.linear": per_call_us(lambda: F.linear(x, w, b)),
        "Function.apply (Python wrapper)": per_call_us(
            lambda: release(A.FusedLinearFunction.apply(x, w, b, h, h.new_use()))),
        "C++ apply (FORGE since stop 20)": per_call_us(lambda: release(A._C_APPLY(x, w, b, h, h.new_use()))),
        "fused_linear()": per_call_us(lambda: release(A.fused_linear(x, w, b, h))),
        "ForgeLinear module call": per_call_us(lambda: release(lin(x))),
        "functorch check": per_call_us(torch._C._are_functorch_transforms_active),
        "new_use()": per_call_us(lambda: h.new_use().__setattr__("done", True)),
    }
    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), torch=torch.__version__,
               python=sys.version.split()[0], command=" ".join(sys.argv), units="us per call, median of 7 x 2000",
               threads=1, results=res)
    del opt
    for k, v in res.items():
        print(f"{k:36s} {v:8.2f}")
    if ns.out:
        Path(ns.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
