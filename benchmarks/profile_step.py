"""Where a training step's wall time goes, per method: host dispatch vs GPU, phase by phase.

    PYTHONPATH=src python3 benchmarks/profile_step.py --out-dir $OUT/prof [--model Llama-3.1-8B] [--compile]

Issue 5 measured FORGE bf16 at 191.9 ms wall for 106.0 ms of GPU time (Llama-3.1-8B, BS=1,
SEQ=512), while `none` spends 73.6 ms wall for 51.7 ms GPU. This script answers where the gap is,
for each method in turn, on one model in one process:

1. Phases: for 5 steps, the host time to *dispatch* forward, backward and the optimizer step (no
   sync inside a phase) and the time then spent waiting in ``_sync()``. A phase
   whose wait is ~0 is host-bound (the GPU idled, waiting for launches); one with a long wait is
   GPU-bound.
2. Python: cProfile of 2 steps, the top functions by own time and by cumulative time.
3. torch.profiler over 1 step: the top CPU ops by self time, and GPU busy time vs the step's span.
4. Triton launch cost: host microseconds per ``launch()`` of the fused kernel on a small job, next to
   a ``torch.add`` dispatch, and a cProfile of those launches (our wrapper vs Triton's JIT call).

Writes ``profile.json`` and one ``<method>.txt`` report per method into ``--out-dir``.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import gc
import io
import json
import os
import platform
import pstats
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# FORGE_SRC: another checkout's src/ (an A/B of two versions with this script)
sys.path.insert(0, os.environ.get("FORGE_SRC", str(REPO / "src")))

import torch  # noqa: E402

from forge_optim.bench_models import build_model, config_dict  # noqa: E402
from forge_optim.cli.bench import _make_method, gpu_activity  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def phases(model, after, batch, n):
    rows = []
    for _ in range(n):
        ids = batch()
        _sync()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        _sync()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        _sync()
        t4 = time.perf_counter()
        after()
        t5 = time.perf_counter()
        _sync()
        t6 = time.perf_counter()
        rows.append([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5])
    med = [sorted(c)[len(c) // 2] * 1e3 for c in zip(*rows)]
    keys = ["fwd_dispatch", "fwd_wait", "bwd_dispatch", "bwd_wait", "step_dispatch", "step_wait"]
    return {k: round(v, 2) for k, v in zip(keys, med)}


def python_profile(step, batch, n=2):
    pr = cProfile.Profile()
    _sync()
    pr.enable()
    for _ in range(n):
        step(batch())
    _sync()
    pr.disable()
    out = {}
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(30)
        out[key] = s.getvalue()
    return out


def torch_profile(step, batch):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(batch())
        _sync()
    events = prof.events()
    iv = sorted((e.time_range.start, e.time_range.end) for e in gpu_activity(events))
    busy, cur = 0.0, None
    for s, e in iv:  # union of GPU intervals
        if cur is None or s > cur[1]:
            if cur is not None:
                busy += cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    if cur is not None:
        busy += cur[1] - cur[0]
    cpu = [e for e in events if e.device_type != DeviceType.CUDA]
    span = (max(e.time_range.end for e in cpu) - min(e.time_range.start for e in cpu)) if cpu else 0
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    return {"gpu_busy_ms": round(busy / 1e3, 2), "span_ms": round(span / 1e3, 2),
            "gpu_launches": len(iv)}, table


def launch_cost(device="cuda", n=300):
    """Host microseconds per call of launch() (our wrapper + Triton's JIT call) and of torch.add,
    and a cProfile of the launches that splits the two."""
    from forge_optim.backends import StateView
    from forge_optim.kernels.launch import SMALL_BT_CONFIGS, launch
    from forge_optim.rules import AdamW

    rule = AdamW
    M = N = 512
    w = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    group = {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    specs = rule.state_specs(group)
    views = tuple(StateView(s, torch.zeros(M, N, device=device, dtype=torch.bfloat16), None) for s in specs)
    slots = [None, None, None]
    for v in views:
        slots[v.spec.slot] = v
    dy = torch.randn(64, M, device=device, dtype=torch.bfloat16)
    x = torch.randn(64, N, device=device, dtype=torch.bfloat16)
    nf = torch.zeros((), dtype=torch.int64, device=device)
    kw = dict(weight=w, dy=dy, x=x, rule_update=rule.triton_update, coeffs=rule.padded(rule.coefficients(group, {}, 1)),
              states=tuple(slots), nonfinite=nf, stochastic_weight=True, stochastic_state=True,
              key_weight=1, key_states=(2, 3, 0))
    cfg = SMALL_BT_CONFIGS[0]

    def timeit(fn):
        for _ in range(10):
            fn()
        _sync()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t) / n * 1e6
        _sync()
        return round(host, 2)

    res = {"launch_wrapper_us": timeit(lambda: launch(config=cfg, **kw))}
    a = torch.randn(16, device=device)
    res["torch_add_us"] = timeit(lambda: torch.add(a, a))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        launch(config=cfg, **kw)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
    res["launch_cprofile"] = s.getvalue()
    return res


def add_model_args(ap: argparse.ArgumentParser, methods: str, out_dir: str) -> None:
    """The model, batch and method flags this script shares with gpu_idle_map.py."""
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--methods", default=methods)
    ap.add_argument("--out-dir", default=out_dir)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (tiny model)")
    ap.add_argument("--compile", action="store_true", help="torch.compile(model) for every method (default mode)")


def run_header(ns) -> dict:
    """What produced the figures: date, device, versions, command, model and batch."""
    import triton
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if ns.device == "cuda" else "cpu", "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(), "command": " ".join(sys.argv),
            "model": ns.model, "batch_size": ns.batch_size, "seq_len": ns.seq_len, "layers": ns.layers,
            "compile": ns.compile, "methods": {}}


def build_method(m: str, ns):
    """A fresh model with method ``m`` (the bench's setup): model, optimizer, the after-backward callable,
    the (compiled) model to call, and a fresh-token batch maker."""
    torch.manual_seed(0)
    model = build_model(config_dict(ns.model, None, ns.layers), ns.device, torch.bfloat16)
    opt, after, _info = _make_method(m, model, 1e-5, 0.1, ns.device)
    run = torch.compile(model) if ns.compile else model
    gen = torch.Generator(device=ns.device)
    gen.manual_seed(1)

    def batch():
        return torch.randint(0, model.config.vocab_size, (ns.batch_size, ns.seq_len), device=ns.device,
                             generator=gen)

    return model, opt, after, run, batch


def main():
    ap = argparse.ArgumentParser()
    add_model_args(ap, "none,forge-bf16,torch-fused-adamw", "runs/prof")
    ap.add_argument("--no-launch-cost", action="store_true", help="skip the launch micro-timing")
    ns = ap.parse_args()
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = run_header(ns)
    if ns.device == "cuda" and not ns.no_launch_cost:
        result["launch_cost"] = launch_cost()
        print(json.dumps({k: v for k, v in result["launch_cost"].items() if k != "launch_cprofile"}), flush=True)
    for m in ns.methods.split(","):
        t = time.time()
        model, opt, after, run, batch = build_method(m, ns)

        def step(ids):
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            after()

        for _ in range(4):
            step(batch())
        _sync()
        r = {"phases_ms": phases(run, after, batch, 5)}
        py = python_profile(step, batch)
        summary, table = torch_profile(step, batch)
        r.update(summary)
        r["seconds"] = round(time.time() - t, 1)
        result["methods"][m] = r
        print(m, json.dumps(r), flush=True)
        (out / f"{m}.txt").write_text(f"== {m}\n{json.dumps(r, indent=1)}\n\n== cProfile by own time (2 steps)\n"
                                      f"{py['tottime']}\n== cProfile cumulative\n{py['cumulative']}\n"
                                      f"== torch.profiler, 1 step, by self CPU\n{table}\n")
        model = opt = after = run = None  # free the model before the next method builds its own
        gc.collect()
        torch.cuda.empty_cache()
    (out / "profile.json").write_text(json.dumps(result, indent=1))
    if "launch_cost" in result:
        (out / "launch_cprofile.txt").write_text(result["launch_cost"]["launch_cprofile"])


if __name__ == "__main__":
    main()
