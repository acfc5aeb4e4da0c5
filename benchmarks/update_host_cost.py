"""Host time of one fused update and of its pieces, per call, on the GPU's host: torch's C++ launcher
(the static launch) against Triton's launcher, and torch.mm's launch for scale.

    PYTHONPATH=src python3 benchmarks/update_host_cost.py --out $OUT/update-host-cost.json

A 256x256 bf16 weight and BT=64 keep every kernel a few microseconds long, so the loops wait on the
host, not on the GPU (the script checks: each loop's GPU-synchronized time is reported beside its host
time). Each figure is the median over ``--repeats`` loops of ``--calls`` calls. Every call of the update
paths applies a real AdamW step to the weight (the figures do not depend on its values).

    python3 benchmarks/update_host_cost.py --cpu --out FILE     (no GPU: the update's Python alone)

    PYTHONPATH=src python3 benchmarks/update_host_cost.py --pingpong --out FILE     (Hopper)

``--pingpong`` times the Gluon ping-pong kernel's launch paths per call on a 1024x2048 bf16 weight, BT=512
(W/m/v ~25 MB: a ~10 us kernel, so the loops wait on the host): ``pingpong.launch`` (Gluon's JIT dispatch,
six descriptors), ``pingpong.relaunch`` (what a prepared plan calls: Triton's launcher re-encodes all six TMA
descriptors) and ``pingpong.EncodedRelaunch`` (W's and the states' encoded once, dY's and X's per call);
first it checks that relaunch and EncodedRelaunch write the same bits.

``--cpu`` times the Python pieces of a prepared update on CPU tensors (TRITON_INTERPRET=1, the kernel
launch replaced by a no-op, so ``plan.run`` packs a full launch's arguments there and is not timed):
``_step_scalars`` and its parts, ``_FastPath.valid``, ``_locate``, the compiled backward's update op
with 3-D and with 2-D dY and X, and ``_fused_update`` with a fixed token count and with one that
changes every call (batches of varying length); and accumulation's two paths (a micro-step's buffer
add, the final update with a buffer).
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

if "--cpu" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when forge_optim (and triton) are imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

import forge_optim  # noqa: E402
from forge_optim.kernels import launch as flaunch  # noqa: E402


def per_call_us(fn, calls: int, repeats: int) -> dict:
    host, synced = [], []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        synced.append((t2 - t0) / calls * 1e6)
    return dict(host_us=round(statistics.median(host), 2), synced_us=round(statistics.median(synced), 2))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--bt", type=int, default=64)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true", help="the Python pieces alone, on CPU (see the docstring)")
    ap.add_argument("--pingpong", action="store_true", help="the ping-pong kernel's launch paths (see the docstring)")
    a = ap.parse_args()
    if a.cpu:
        return cpu_main(a)
    if a.pingpong:
        return pingpong_main(a)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU: it times kernel launches")
    torch.manual_seed(0)
    lin = torch.nn.Linear(a.dim, a.dim, bias=False).to("cuda", torch.bfloat16)
    opt = forge_optim.AdamW(lin, lr=1e-5, weight_decay=0.1, state_dtype="bf16")
    x = torch.randn(a.bt, a.dim, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # full path, then the plan's first launch (which records the static launch)
        lin(x).float().square().mean().backward()
        opt.step()
    h = next(iter(opt._handles.values()))
    w = h.param
    dy = torch.randn(a.bt, a.dim, device="cuda", dtype=torch.bfloat16)
    plan = h.fast.plan
    rec = next(iter(plan.by_class.values()))
    gi, idx = opt._locate(w)
    group = opt.param_groups[gi]
    coeffs, kw, ks = opt._step_scalars(group, h.fast.state, idx, h.fast.specs)

    def run_plan():
        plan.run(dy, x, coeffs, 1.0, kw, ks)

    def fused_update():
        opt._fused_update(h, dy, x)

    def consume():
        h.consume(dy, x, None)

    def update_op():
        torch.ops.forge_optim.fused_linear_update(dy, x, None, w, h.id)

    def mm():
        torch.mm(dy.t(), x)

    res = dict(static_launch_available=rec[4] is not None)
    timed = [("torch.mm (a wgrad GEMM's launch)", mm, None),
             ("is_current_stream_capturing", torch.cuda.is_current_stream_capturing, None),
             ("_step_scalars", lambda: opt._step_scalars(group, h.fast.state, idx, h.fast.specs), None),
             ("_FastPath.valid", lambda: h.fast.valid(opt, w, group, dy, x), None)]
    for static in (True, False):
        tag = "static" if static else "triton"
        timed += [(f"plan.run [{tag}]", run_plan, static), (f"_fused_update [{tag}]", fused_update, static),
                  (f"consume [{tag}]", consume, static), (f"fused_linear_update op [{tag}]", update_op, static)]
    with torch.no_grad():
        for name, fn, static in timed:
            if static is not None:
                flaunch.STATIC_LAUNCH = static
            fn()
            res[name] = per_call_us(fn, a.calls, a.repeats)
            print(f"{name:40s} host {res[name]['host_us']:8.2f} us   synced {res[name]['synced_us']:8.2f} us", flush=True)
    flaunch.STATIC_LAUNCH = True
    import triton

    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
               torch=torch.__version__, triton=triton.__version__, command=" ".join([sys.executable] + sys.argv),
               dim=a.dim, bt=a.bt, calls=a.calls, repeats=a.repeats, units="us per call, median over repeats",
               results=res)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.out}")


def pingpong_main(a):
    import triton

    from forge_optim.backends.base import StateView
    from forge_optim.kernels import pingpong as PP
    from forge_optim.rules import RULES

    rule = RULES["AdamW"]
    M, N, BT = 1024, 2048, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(M, N, device="cuda", generator=g) * 0.02).bfloat16()
    views = [StateView(sp, (torch.randn(M, N, device="cuda", generator=g) * 1e-3).abs().bfloat16())
             for sp in rule.state_specs(dict(rule.defaults))]
    coeffs = rule.padded(rule.coefficients(dict(rule.defaults, lr=1e-5), {}, 5))
    dy = torch.randn(BT, M, device="cuda", generator=g).bfloat16()
    x = torch.randn(BT, N, device="cuda", generator=g).bfloat16()
    nf = torch.zeros((), dtype=torch.int64, device="cuda")
    cfg = PP.PingPongConfig(BN=128, epi_n=4, stages=5, group_size=16)
    kw = dict(dy=dy, x=x, rule_update=rule.triton_update, coeffs=coeffs, nonfinite=nf, stochastic_weight=True,
              stochastic_state=True, key_weight=1, key_states=(2, 3, 0), config=cfg)
    dev = torch.cuda.current_device()

    def record_for(weight, vs):
        return PP.launch(weight=weight, states=tuple(vs) + (None,), **kw)

    # bits: relaunch and EncodedRelaunch on two copies, the same launches
    copies = []
    for how in ("relaunch", "encoded"):
        wc, vc = w.clone(), [StateView(v.spec, v.data.clone()) for v in views]
        rec = record_for(wc, vc)
        for step in range(3):
            if how == "relaunch":
                PP.relaunch(rec, dy, x, coeffs, 1.0, 10 + step, (20 + step, 30 + step, 0), dev)
            else:
                PP.EncodedRelaunch.make(rec)(dy, x, coeffs, 1.0, 10 + step, (20 + step, 30 + step, 0), dev)
        torch.cuda.synchronize()
        copies.append([wc] + [v.data for v in vc])
    same_bits = all(torch.equal(p.view(torch.int16), q.view(torch.int16)) for p, q in zip(*copies))
    print(f"relaunch and EncodedRelaunch write the same bits: {same_bits}", flush=True)

    rec = record_for(w, views)
    enc = PP.EncodedRelaunch.make(rec)
    res = dict(same_bits=same_bits, encoded_available=enc is not None)
    timed = [("pingpong.launch", lambda: record_for(w, views)),
             ("pingpong.relaunch", lambda: PP.relaunch(rec, dy, x, coeffs, 1.0, 7, (8, 9, 0), dev)),
             ("torch.mm (a wgrad GEMM's launch)", lambda: torch.mm(dy.t(), x))]
    if enc is not None:
        timed.insert(2, ("EncodedRelaunch", lambda: enc(dy, x, coeffs, 1.0, 7, (8, 9, 0), dev)))
    for name, fn in timed:
        fn()
        res[name] = per_call_us(fn, a.calls, a.repeats)
        print(f"{name:40s} host {res[name]['host_us']:8.2f} us   synced {res[name]['synced_us']:8.2f} us", flush=True)
    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
               torch=torch.__version__, triton=triton.__version__, command=" ".join([sys.executable] + sys.argv),
               shape=[M, N], bt=BT, config=cfg.short(), calls=a.calls, repeats=a.repeats,
               units="us per call, median over repeats", results=res)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.out}")


def cpu_main(a):
    from host_overhead import _NoLaunch  # (this folder is on sys.path when a script in it runs)

    from forge_optim import precision

    flaunch.fused.forge_fused_kernel = _NoLaunch()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lin = torch.nn.Linear(a.dim, a.dim, bias=False).to(torch.bfloat16)
    opt = forge_optim.AdamW(lin, lr=1e-5, weight_decay=0.1, backend="triton", state_dtype="bf16")
    x3 = torch.randn(1, a.bt, a.dim, dtype=torch.bfloat16)
    for _ in range(3):
        lin(x3).float().square().mean().backward()
        opt.step()
    h = next(iter(opt._handles.values()))
    w, fast = h.param, h.fast
    gi, idx = opt._locate(w)
    group = opt.param_groups[gi]
    dy3 = torch.randn(1, a.bt, a.dim, dtype=torch.bfloat16)
    dy2, x2 = dy3.view(a.bt, a.dim), x3.view(a.bt, a.dim)
    step_t = fast.state["step"]
    coeffs = opt.rule.coefficients(group, fast.state, 5)
    alias = lin._forge_weight_alias
    op = torch.ops.forge_optim.fused_linear_update.default

    cycle = [(torch.randn(bt, a.dim, dtype=torch.bfloat16), torch.randn(bt, a.dim, dtype=torch.bfloat16))
             for bt in range(a.bt, a.bt + 4)]  # one BT regime (for --bt below 61): one plan serves them all
    turn = iter(range(1 << 62))

    def varying():
        opt._fused_update(h, *cycle[next(turn) % 4])

    backend, buf = opt._backend_for(w), torch.zeros(a.dim, a.dim)

    def final_with_buffer():
        h.buffer = buf
        opt._fused_update(h, dy2, x2)

    def keys():
        base = precision.step_key(opt.seed, idx, 5)
        return [precision.site_key(base, precision.SITE_WEIGHT)] + [
            precision.site_key(base, precision.SITE_STATE0 + sp.slot) for sp in fast.specs]

    timed = [("_step_scalars", lambda: opt._step_scalars(group, fast.state, idx, fast.specs)),
             ("  step tensor item + fill_", lambda: step_t.fill_(int(step_t.item()))),
             ("  rule.coefficients", lambda: opt.rule.coefficients(group, fast.state, 5)),
             ("  rule.padded", lambda: opt.rule.padded(coeffs)),
             ("  rounding keys (W + states)", keys),
             ("_FastPath.valid", lambda: fast.valid(opt, w, group, dy2, x2)),
             ("  plan.matches", lambda: fast.plan.matches(dy2, x2)),
             ("_locate", lambda: opt._locate(w)),
             ("increment_version", lambda: torch.autograd.graph.increment_version(w)),
             ("fused_linear_update op, 3-D dY and X", lambda: op(dy3, x3, None, alias, h.id)),
             ("fused_linear_update op, 2-D dY and X", lambda: op(dy2, x2, None, alias, h.id)),
             ("_fused_update, BT fixed", lambda: opt._fused_update(h, dy2, x2)),
             ("_fused_update, BT cycling over 4 values", varying),
             ("backend.accumulate (a non-final micro-step)", lambda: backend.accumulate(buf, dy2, x2)),
             ("_fused_update with a buffer (the final micro-step)", final_with_buffer)]
    res = {}
    with torch.no_grad():
        for name, fn in timed:
            fn()
            res[name] = per_call_us(fn, a.calls, a.repeats)["host_us"]
            print(f"{name:40s} {res[name]:8.2f} us", flush=True)
    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               device=f"cpu ({platform.machine()}, {os.cpu_count()} cores), launch stubbed", torch=torch.__version__,
               command=" ".join([sys.executable] + sys.argv), dim=a.dim, bt=a.bt, calls=a.calls, repeats=a.repeats,
               units="us per call, median over repeats", results=res)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
