"""FORGE's host path, one form against another (compiled or eager), paired inside one process.

    PYTHONPATH=src python3 benchmarks/compiled_ab.py --out $OUT/ab.json [--layers 8] [--rounds 30]
    PYTHONPATH=src python3 benchmarks/compiled_ab.py --device cpu --model tiny --rounds 5 --out /tmp/ab.json

On the lent H200's host the same code's per-step host time moved by up to 2x between processes and
within one (NOTES.md, thirteenth session), so a before/after in two processes could not see a few ms.
Here every variant starts from the same weights in this process (variants that differ only in the
launcher or in being compiled share one model and optimizer), and the timed rounds alternate between
them (the order rotates each round), so host drift hits all alike:

- ``none``: forward+backward with no optimizer (the floor);
- ``old``: FORGE compiled as before 2026-12-04 night: a ``linear_counted`` op per fused linear in the
  forward, dX formed inside the backward op (``FORGE_OPTIM_INDUCTOR_PASS=0``, ``_TRACE_DX_IN_GRAPH=False``);
- ``fwd``: inductor's GEMM in the forward (inductor_pass), the old backward;
- ``new``: both: the forward pass, and dX as a traced GEMM handed to ``fused_linear_update``;
- ``new-triton``: ``new`` with the prepared plans launching through Triton's launcher instead of torch's
  C++ one (``kernels.launch.STATIC_LAUNCH`` off: the form before 2026-12-05);
- ``eager``, ``eager-triton``, ``none-eager``: the same model not compiled, with each launcher, and its floor.

Each round times, per variant, the phases with a synchronize after each (dispatch = host time to issue
the phase, wait = time then spent in synchronize) and a back-to-back run of ``--b2b`` steps with one
synchronize at the end. Reports medians and the median of the paired per-round differences.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("FORGE_SRC", str(REPO / "src")))

import torch  # noqa: E402

import forge_optim  # noqa: E402
from forge_optim import autograd as fautograd  # noqa: E402
from forge_optim.bench_models import build_model, config_dict  # noqa: E402
from forge_optim.kernels import launch as flaunch  # noqa: E402

VARIANTS = {  # name: (inductor pass on, dX traced in the graph, static launch, compiled)
    "old": (False, False, True, True),
    "fwd": (True, False, True, True),
    "new": (True, True, True, True),
    "new-triton": (True, True, False, True),
    "eager": (True, True, True, False),
    "eager-triton": (True, True, False, False),
}
FLOORS = {"none": True, "none-eager": False}  # no optimizer; compiled or not


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _set_form(pass_on: bool, dx_in_graph: bool) -> None:
    import torch._inductor.config as inductor_config

    from forge_optim import inductor_pass

    if pass_on:
        os.environ.pop("FORGE_OPTIM_INDUCTOR_PASS", None)
        inductor_pass.install()
    else:
        os.environ["FORGE_OPTIM_INDUCTOR_PASS"] = "0"
        inductor_config.post_grad_custom_pre_pass = None
    fautograd._TRACE_DX_IN_GRAPH = dx_in_graph


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--b2b", type=int, default=5, help="back-to-back steps per round and variant")
    ap.add_argument("--variants", default="none,old,fwd,new")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = a.device
    cfgd = config_dict(a.model, None, a.layers)
    names = a.variants.split(",")
    runs, forms = {}, {}
    # Variants that differ only in the launcher or in being compiled share one model and optimizer (the
    # launcher is read at each launch; the eager run calls the module the compiled one wraps): six 8-layer
    # models with bf16 AdamW state did not fit an H100's 80 GB (2026-12-05), two do.
    shared: dict[tuple, tuple] = {}
    t_start = time.time()
    for name in names:
        form = ("floor",) if name in FLOORS else ("forge", *VARIANTS[name][:2])
        compiled = FLOORS[name] if name in FLOORS else VARIANTS[name][3]
        if form not in shared:
            torch.manual_seed(0)
            model = build_model(cfgd, dev, torch.bfloat16)
            opt = None if name in FLOORS else forge_optim.AdamW(model, lr=1e-5, weight_decay=0.1, state_dtype="bf16")
            shared[form] = (model, opt, {})
        model, opt, wrapped = shared[form]
        if name not in FLOORS:
            _set_form(*VARIANTS[name][:2])
            flaunch.STATIC_LAUNCH = VARIANTS[name][2]
        if compiled and "compiled" not in wrapped:
            wrapped["compiled"] = torch.compile(model)
        run = wrapped["compiled"] if compiled else model
        t = time.time()
        runs[name] = (model, opt, run)
        ids = torch.randint(0, cfgd["vocab_size"], (a.batch_size, a.seq_len), device=dev)
        from torch._inductor.utils import run_and_get_code

        # the first step compiles forward and backward under this variant's form: record which ops they call
        if compiled:
            _, codes = run_and_get_code(lambda: _step(run, opt, model, ids))
        else:
            _step(run, opt, model, ids)
            codes = []
        if codes or not compiled:
            forms[name] = {op: sum(c.count(f"forge_optim.{op}.default(") for c in codes) for op in
                           ("linear_counted", "count_uses", "fused_linear_backward", "fused_linear_update")}
            if codes:
                wrapped["forms"] = forms[name]
        else:  # a variant sharing an already compiled model: no new code, the same ops
            forms[name] = wrapped["forms"]
        for _ in range(2):
            _step(run, opt, model, ids)
        _sync(dev)
        print(f"{name}: compiled and warmed in {time.time() - t:.1f} s; ops in its compiled code: {forms[name]}",
              flush=True)
    _set_form(True, True)
    flaunch.STATIC_LAUNCH = True

    keys = ("fwd_dispatch", "fwd_wait", "bwd_dispatch", "bwd_wait", "step_dispatch", "step_wait", "synced", "b2b")
    rec = {n: {k: [] for k in keys} for n in names}
    gen = torch.Generator(device=dev).manual_seed(1)
    for r in range(a.rounds):
        ids = torch.randint(0, cfgd["vocab_size"], (a.batch_size, a.seq_len), device=dev, generator=gen)
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            model, opt, run = runs[name]
            if name in VARIANTS:  # read by the prepared plans at each launch
                flaunch.STATIC_LAUNCH = VARIANTS[name][2]
            _sync(dev)
            t0 = time.perf_counter()
            loss = run(input_ids=ids, labels=ids).loss
            t1 = time.perf_counter()
            _sync(dev)
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            _sync(dev)
            t4 = time.perf_counter()
            _after(opt, model)
            t5 = time.perf_counter()
            _sync(dev)
            t6 = time.perf_counter()
            for k, v in zip(keys, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t6 - t0)):
                rec[name][k].append(v * 1e3)
            tb = time.perf_counter()
            for _ in range(a.b2b):
                _step(run, opt, model, ids)
            _sync(dev)
            rec[name]["b2b"].append((time.perf_counter() - tb) * 1e3 / a.b2b)

    med = {n: {k: round(statistics.median(v), 3) for k, v in rec[n].items()} for n in names}
    paired = {}
    for x, y in (("new", "old"), ("fwd", "old"), ("new", "fwd"), ("new", "none"), ("old", "none"),
                 ("new", "new-triton"), ("new-triton", "none"), ("eager", "eager-triton"), ("eager", "none-eager"),
                 ("eager-triton", "none-eager")):
        if x in rec and y in rec:
            paired[f"{x}-{y}"] = {k: round(statistics.median(p - q for p, q in zip(rec[x][k], rec[y][k])), 3)
                                  for k in keys}
    print(f"{'variant':24s} " + " ".join(f"{k:>13s}" for k in keys))
    for n in names:
        print(f"{n:24s} " + " ".join(f"{med[n][k]:13.2f}" for k in keys))
    print("paired per-round differences (median, ms):")
    for pk, pv in paired.items():
        print(f"{pk:24s} " + " ".join(f"{pv[k]:13.2f}" for k in keys))
    import triton

    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name() if dev == "cuda" else f"cpu ({platform.machine()})",
               torch=torch.__version__, triton=triton.__version__, command=" ".join([sys.executable] + sys.argv),
               model=a.model, layers=a.layers, batch_size=a.batch_size, seq_len=a.seq_len, rounds=a.rounds,
               b2b_steps=a.b2b, variants={n: dict(zip(("inductor_pass", "dx_in_graph", "static_launch", "compiled"),
                                                   VARIANTS.get(n, (None, None, None, FLOORS.get(n)))))
                                          for n in names}, compiled_ops=forms,
               units="ms per step, median over rounds", medians=med, paired_medians=paired,
               per_round=rec, seconds=round(time.time() - t_start, 1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.out}")


def _after(opt, model):
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)


def _step(run, opt, model, ids):
    run(input_ids=ids, labels=ids).loss.backward()
    _after(opt, model)


if __name__ == "__main__":
    main()
