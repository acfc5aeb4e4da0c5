"""Host (Python) cost of FORGE's fused-linear path per layer, with the Triton kernel stubbed out.

    python3 benchmarks/host_overhead.py [--layers 32] [--dim 64] [--steps 50]

Runs on any machine (CPU tensors, TRITON_INTERPRET=1 so the Triton backend's host path is taken,
the kernel launch itself replaced by a no-op). Compares one training step of a stack of tiny
linears (compute negligible) under forge_optim.AdamW(backend="triton"), under nn.Linear + torch
AdamW (foreach), and a bare Python autograd.Function linear: what forge adds per layer on the host,
before Triton's own launcher, which this cannot measure. Writes benchmarks/results/host-<date>.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

import forge_optim  # noqa: E402
from forge_optim.kernels import launch as launch_mod  # noqa: E402


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _PyLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        return gy @ w, None


def per_layer_us(step, layers, steps):
    for _ in range(3):
        step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t) / steps / layers * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()
    launch_mod.fused.forge_fused_kernel = _NoLaunch()
    torch.manual_seed(0)
    x = torch.randn(8, a.dim, requires_grad=True)

    def stack():
        return torch.nn.Sequential(*[torch.nn.Linear(a.dim, a.dim, bias=False) for _ in range(a.layers)])

    model = stack()
    opt = forge_optim.AdamW(model, lr=1e-3, backend="triton", state_dtype="bf16")

    def forge_step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    ref = stack()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=True)

    def torch_step():
        ref(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()

    ws = [torch.nn.Parameter(torch.randn(a.dim, a.dim)) for _ in range(a.layers)]

    def bare_step():
        h = x
        for w in ws:
            h = _PyLinear.apply(h, w)
        h.sum().backward()

    res = dict(forge_us_per_layer=per_layer_us(forge_step, a.layers, a.steps),
               torch_adamw_us_per_layer=per_layer_us(torch_step, a.layers, a.steps),
               bare_python_function_us_per_layer=per_layer_us(bare_step, a.layers, a.steps))
    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               device=f"cpu ({platform.machine()}, {os.cpu_count()} cores)", torch=torch.__version__,
               command=" ".join([sys.executable] + sys.argv), layers=a.layers, dim=a.dim, steps=a.steps, **res)
    for k, v in res.items():
        print(f"{k:38s} {v:7.1f}")
    path = Path(__file__).resolve().parent / "results" / f"host-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
