"""Host microseconds per call of the ways FORGE and inductor issue the same GEMM (CUDA).

    python3 benchmarks/mm_host_cost.py [--out FILE]

The compiled FORGE step's profile (NOTES.md, thirteenth session) showed aten::mm costing ~47 us of
host time per call inside FORGE's ops (F.linear in the forward op, ``dY @ W`` in the backward op) and
~19 us when inductor's wrapper calls ``torch.mm(a, b, out=buf)``. This times each form alone, with the
GPU idle (each batch of calls after a sync) and busy (behind a long ``torch.cuda._sleep``, so the
launch queue is non-empty, as in a GPU-bound backward), on the Llama-3.1-8B BS=1 SEQ=512 shapes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def host_us(fn, n=40, reps=15, busy=False):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time ahead of the calls
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(out), 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = "cuda"
    bf = torch.bfloat16
    x3 = torch.randn(1, 512, 4096, device=dev, dtype=bf)
    x2 = x3.view(512, 4096)
    w = torch.nn.Parameter(torch.randn(4096, 4096, device=dev, dtype=bf))
    wd = w.detach()
    buf = torch.empty(512, 4096, device=dev, dtype=bf)
    forms = {
        "torch.mm(x2, w.t(), out=buf)  (inductor's extern call)": lambda: torch.mm(x2, wd.t(), out=buf),
        "torch.mm(x2, w.t())": lambda: torch.mm(x2, wd.t()),
        "F.linear(x3, w) (Parameter)": lambda: F.linear(x3, w),
        "F.linear(x3, w.detach())": lambda: F.linear(x3, wd),
        "F.linear(x2, w.detach())": lambda: F.linear(x2, wd),
        "x3 @ w (Parameter)": lambda: x3 @ w,
        "x3 @ w.detach()": lambda: x3 @ wd,
        "torch.mm(x2, w) (dX form)": lambda: torch.mm(x2, wd),
        "torch.add(x2, x2)": lambda: torch.add(x2, x2),
    }
    res = {}
    with torch.no_grad():
        for name, fn in forms.items():
            for _ in range(20):
                fn()
            res[name] = {"idle_us": host_us(fn), "busy_us": host_us(fn, busy=True)}
            print(f"{name:58s} idle {res[name]['idle_us']:7.2f} us   GPU busy {res[name]['busy_us']:7.2f} us", flush=True)
    rec = dict(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), device=torch.cuda.get_device_name(),
               torch=torch.__version__, units="host us per call, median of 15 x 40 calls", results=res)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
