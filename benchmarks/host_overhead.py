"""Host (Python) cost of FORGE's fused-linear path per layer.

    python3 benchmarks/host_overhead.py [--layers 32] [--dim 64] [--steps 50]
    python3 benchmarks/host_overhead.py --cuda [--out FILE]      (on the device)
    python3 benchmarks/host_overhead.py --compile [--cuda]       (torch.compile'd stacks instead)

CPU mode runs on any machine (CPU tensors, TRITON_INTERPRET=1 so the Triton backend's host path is
taken, the kernel launch itself replaced by a no-op). It compares one training step of a stack of
tiny linears (compute negligible) under forge_optim.AdamW(backend="triton"), under nn.Linear + torch
AdamW (foreach), and a bare Python autograd.Function linear: what forge adds per layer on the host,
before Triton's own launcher, which it cannot measure. Writes benchmarks/results/host-<date>.json.

--cuda runs the same stacks on the GPU with real launches (the GPU work is a few us per layer, so
the step's wall time is the host's): forge with the direct launch and with Triton's own launch path
(FORGE_FAST_LAUNCH's switch, same process), torch fused and foreach AdamW, no optimizer; and one
fused-kernel launch alone, both ways.

--compile runs each stack through torch.compile (inductor) instead: forge's fused linears are then
the forge_optim::fused_linear / fused_linear_backward ops, and the figure is the host cost of those
ops' Python against compiled nn.Linear + torch AdamW (foreach) and compiled forward+backward alone.
Best of 5 interleaved runs of each.
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

if "--cuda" not in sys.argv:
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


def linear_stack(layers: int, dim: int, device="cpu", dtype=torch.float32) -> torch.nn.Sequential:
    return torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)]).to(device, dtype)


def train_step(model, x, opt=None):
    """One forward+backward(+step) of ``model`` on ``x``; without ``opt`` only the gradients are cleared."""
    def step():
        model(x).sum().backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        else:
            model.zero_grad()
    return step


def per_layer_us(step, layers, steps):
    for _ in range(3):
        step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t) / steps / layers * 1e6


def write_result(a, res: dict, device: str, suffix: str, **extra) -> None:
    """Print ``res`` and write it with the run's date, device, versions and command to --out (default
    benchmarks/results/host-<date><suffix>.json)."""
    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device=device,
               torch=torch.__version__, **extra, command=" ".join([sys.executable] + sys.argv),
               layers=a.layers, dim=a.dim, steps=a.steps, **res)
    for k, v in res.items():
        print(f"{k:38s} {v:7.1f}")
    path = Path(a.out) if a.out else (Path(__file__).resolve().parent / "results"
                                      / f"host-{dt.date.today().isoformat()}{suffix}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


def compiled_main(a, dev):
    """Per-layer step time of compiled stacks (see --compile in the docstring)."""
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    bt = a.bt if dev == "cuda" else 8
    torch.manual_seed(0)
    x = torch.randn(bt, a.dim, device=dev, dtype=dtype, requires_grad=True)
    m = linear_stack(a.layers, a.dim, dev, dtype)
    fopt = forge_optim.AdamW(m, lr=1e-3, backend="triton", state_dtype="bf16")
    ref = linear_stack(a.layers, a.dim, dev, dtype)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=True)
    bare = linear_stack(a.layers, a.dim, dev, dtype)
    steps = {"forge_bf16_compiled": train_step(torch.compile(m), x, fopt),
             "torch_foreach_adamw_compiled": train_step(torch.compile(ref), x, ropt),
             "none_compiled": train_step(torch.compile(bare), x)}

    def timed(step):
        step()
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(a.steps):
            step()
        if dev == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / a.steps / a.layers * 1e6

    for step in steps.values():  # compile and warm up
        for _ in range(3):
            step()
    best = {}
    for _ in range(5):  # interleaved: a busy host slows every method alike
        for name, step in steps.items():
            best[name] = min(best.get(name, float("inf")), timed(step))
    return {f"{k}_us_per_layer": v for k, v in best.items()}


def cuda_main(a):
    from forge_optim.kernels import launch as L
    from forge_optim.backends.triton_backend import TritonBackend, launch_kwargs  # noqa: F401

    dev = "cuda"
    # one fixed config (the small-BT winner): tuning would compile a dozen variants for nothing here
    os.environ.setdefault("FORGE_TRITON_CONFIG", L.SMALL_BT_CONFIGS[-2].env())
    torch.manual_seed(0)
    x = torch.randn(a.bt, a.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def timed(step):
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):  # best of 3 runs of `steps` steps: the host is shared, noise is one-sided
            t = time.perf_counter()
            for _ in range(a.steps):
                step()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t) / a.steps / a.layers * 1e6)
        return best

    res = {}
    model = linear_stack(a.layers, a.dim, dev, torch.bfloat16)
    forge_step = train_step(model, x, forge_optim.AdamW(model, lr=1e-3, backend="triton", state_dtype="bf16"))
    for fast in (False, True):
        L.FAST_LAUNCH = fast
        res[f"forge_bf16_{'direct' if fast else 'triton_run'}_us_per_layer"] = timed(forge_step)
    res["direct_launch_cache_entries"] = len(L._DIRECT)
    if a.profile:  # where forge's host time goes (cProfile inflates it, read the split, not the sum)
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            forge_step()
        torch.cuda.synchronize()
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
        Path(a.profile).write_text(buf.getvalue())
    for name, kw in (("torch_fused_adamw", dict(fused=True)), ("torch_foreach_adamw", dict(foreach=True)),
                     ("none", None)):
        ref = linear_stack(a.layers, a.dim, dev, torch.bfloat16)
        res[f"{name}_us_per_layer"] = timed(
            train_step(ref, x, torch.optim.AdamW(ref.parameters(), lr=1e-3, **kw) if kw else None))

    # one launch of the fused kernel alone (bf16 W, m, v; BT=16), both ways
    from forge_optim.backends.base import StateView, UpdateJob
    from forge_optim.rules import RULES

    rule = RULES["AdamW"]
    specs = rule.state_specs(rule.defaults)
    w = torch.zeros(a.dim, a.dim, device=dev, dtype=torch.bfloat16)
    job = UpdateJob(weight=w, rule=rule, coeffs=rule.padded(rule.coefficients(rule.defaults, {}, 1)),
                    states=[StateView(sp, torch.zeros_like(w)) for sp in specs], stochastic_weight=True,
                    stochastic_state=True, nonfinite=torch.zeros((), dtype=torch.int64, device=dev))
    dy = torch.zeros(a.bt, a.dim, device=dev, dtype=torch.bfloat16)
    kwargs = launch_kwargs(job, dy, dy)
    cfg = L.ELEMENTWISE_CONFIGS[0]
    for fast in (False, True):
        L.FAST_LAUNCH = fast
        for _ in range(20):
            L.launch(config=cfg, **kwargs)
        torch.cuda.synchronize()
        n = 2000
        t = time.perf_counter()
        for _ in range(n):
            L.launch(config=cfg, **kwargs)
        host = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        res[f"launch_{'direct' if fast else 'triton_run'}_us"] = host
    t = time.perf_counter()
    for _ in range(2000):
        torch.add(dy, dy)
    res["torch_add_dispatch_us"] = (time.perf_counter() - t) / 2000 * 1e6
    torch.cuda.synchronize()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cuda", action="store_true", help="real launches on the GPU (see the docstring)")
    ap.add_argument("--compile", action="store_true", help="torch.compile'd stacks (see the docstring)")
    ap.add_argument("--bt", type=int, default=16, help="--cuda: tokens per step")
    ap.add_argument("--profile", default=None, help="--cuda: write a cProfile of forge's steps to this file")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/host-<date>[-cuda][-compile].json)")
    a = ap.parse_args()
    if a.cuda:
        if a.compile:
            os.environ.setdefault("FORGE_TRITON_CONFIG", launch_mod.SMALL_BT_CONFIGS[-2].env())
        res = compiled_main(a, "cuda") if a.compile else cuda_main(a)
        import triton

        write_result(a, res, f"{torch.cuda.get_device_name()} (host: {platform.machine()}, {os.cpu_count()} cores)",
                     "-cuda-compile" if a.compile else "-cuda", triton=triton.__version__, bt=a.bt)
        return
    launch_mod.fused.forge_fused_kernel = _NoLaunch()
    cpu = f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    if a.compile:
        write_result(a, compiled_main(a, "cpu"), cpu, "-compile")
        return
    torch.manual_seed(0)
    x = torch.randn(8, a.dim, requires_grad=True)

    model = linear_stack(a.layers, a.dim)
    forge_step = train_step(model, x, forge_optim.AdamW(model, lr=1e-3, backend="triton", state_dtype="bf16"))
    ref = linear_stack(a.layers, a.dim)
    torch_step = train_step(ref, x, torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=True))

    ws = [torch.nn.Parameter(torch.randn(a.dim, a.dim)) for _ in range(a.layers)]

    def bare_step():
        h = x
        for w in ws:
            h = _PyLinear.apply(h, w)
        h.sum().backward()

    res = dict(forge_us_per_layer=per_layer_us(forge_step, a.layers, a.steps),
               torch_adamw_us_per_layer=per_layer_us(torch_step, a.layers, a.steps),
               bare_python_function_us_per_layer=per_layer_us(bare_step, a.layers, a.steps))
    write_result(a, res, cpu, "")


if __name__ == "__main__":
    main()
