"""Where the GPU waits inside one synchronized training step, and on what.

    PYTHONPATH=src python3 benchmarks/gpu_idle_map.py --compile --methods forge-bf16,torch-fused-adamw \
        --out-dir $OUT/idle

The bench's synchronized ms/step of compiled FORGE is ~6.7 ms above its GPU time, against ~4 ms for fused
AdamW, while back-to-back both are ~3 ms above (NOTES, thirty-third session). A synchronized step is
sync, forward + backward + opt.step(), sync: the GPU idles wherever the host has not yet launched the next
kernel. This script profiles such steps (torch.profiler, CPU and CUDA activity, the chrome trace) and
splits the step's span into GPU-busy time and idle gaps, and each gap into

* *host-bound*: the kernel after the gap was launched after the GPU had gone idle (the GPU waited for
  the host), attributed to the phase (forward / backward / step, from record_function ranges on the
  main thread) and to the innermost CPU op around that launch, and
* *queued*: the launch was already queued (launch latency, stream waits, an event).

plus the lead (step start to first kernel) and the tail (last kernel to the step's closing sync).
Writes ``idle.json`` (per method: totals, idle by phase, host-bound idle by op, the largest gaps).
``--device cpu --model tiny`` is a dry run (no CUDA activity: the map is empty).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("FORGE_SRC", str(REPO / "src")))

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
PHASES = ("fwd", "bwd", "step")


def idle_map(trace: dict, min_gap_us: float = 8.0, slack_us: float = 3.0, top: int = 15) -> dict:
    """Split a chrome trace of one synchronized step into GPU-busy time and idle gaps (see module doc).

    ``trace``: torch.profiler's exported chrome trace (``traceEvents``). The step is the ``train_step``
    user annotation's span if present, else the span of the phase annotations. A gap is an interval
    of at least ``min_gap_us`` between the union of GPU intervals; it is host-bound when the next
    kernel's launch call started later than ``slack_us`` before the gap opened."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = sorted((e for e in ev if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in ev
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    ann = [e for e in ev if e.get("cat") == "user_annotation" and e.get("name") in PHASES + ("train_step",)]
    phase_iv = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in ann if e["name"] in PHASES]
    whole = [e for e in ann if e["name"] == "train_step"]
    if whole:
        t0, t1 = whole[0]["ts"], whole[0]["ts"] + whole[0]["dur"]
    elif phase_iv:
        t0, t1 = min(s for s, _, _ in phase_iv), max(e for _, e, _ in phase_iv)
    else:
        return {"error": "no train_step / phase annotations in the trace"}
    gpu = [e for e in gpu if e["ts"] < t1 and e["ts"] + e["dur"] > t0]
    out = {"span_us": round(t1 - t0, 1), "kernels": len(gpu)}
    if not gpu:
        out.update(busy_us=0.0, idle_us=round(t1 - t0, 1))
        return out

    def phase_at(t):
        for s, e, name in phase_iv:
            if s <= t < e:
                return name
        return "between"

    cpu_ops = sorted((e for e in ev if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    by_tid = defaultdict(list)
    for e in cpu_ops:
        by_tid[e["tid"]].append(e)

    def innermost(launch):
        """The shortest cpu_op on the launch's thread that contains it (the op that issued it)."""
        for ops in (by_tid.get(launch["tid"], ()), cpu_ops):  # all threads if its own has none around it
            best = None
            for e in ops:
                if e["ts"] > launch["ts"]:
                    break
                if e["ts"] + e["dur"] >= launch["ts"] + launch["dur"] and (best is None or e["dur"] < best["dur"]):
                    best = e
            if best is not None:
                return best["name"]
        return "(no cpu op)"

    busy, gaps = 0.0, []
    cur_s, cur_e = gpu[0]["ts"], gpu[0]["ts"] + gpu[0]["dur"]
    for e in gpu[1:]:
        s, end = e["ts"], e["ts"] + e["dur"]
        if s > cur_e:
            busy += cur_e - cur_s
            if s - cur_e >= min_gap_us:
                gaps.append((cur_e, s, e))
            cur_s, cur_e = s, end
        else:
            cur_e = max(cur_e, end)
    busy += cur_e - cur_s
    gap_total = sum(g1 - g0 for g0, g1, _ in gaps)
    small = (cur_e - gpu[0]["ts"]) - busy - gap_total
    lead, tail = gpu[0]["ts"] - t0, t1 - cur_e
    by_phase = defaultdict(lambda: {"host_bound_us": 0.0, "queued_us": 0.0, "gaps": 0})
    by_op = defaultdict(lambda: [0.0, 0])
    rows = []
    for g0, g1, nxt in gaps:
        lau = launches.get(nxt.get("args", {}).get("correlation"))
        host = lau is not None and lau["ts"] > g0 - slack_us
        ph = phase_at(lau["ts"] if lau is not None else g0)
        op = innermost(lau) if lau is not None else "(launch not found)"
        d = g1 - g0
        by_phase[ph]["host_bound_us" if host else "queued_us"] += d
        by_phase[ph]["gaps"] += 1
        if host:
            by_op[op][0] += d
            by_op[op][1] += 1
        rows.append({"at_us": round(g0 - t0, 1), "gap_us": round(d, 1), "phase": ph, "host_bound": host,
                     "next_kernel": nxt["name"][:80], "launched_in": op[:80],
                     "launch_after_idle_us": round(lau["ts"] - g0, 1) if lau is not None else None})
    rows.sort(key=lambda r: -r["gap_us"])
    out.update({
        "busy_us": round(busy, 1), "lead_us": round(lead, 1), "tail_us": round(tail, 1),
        "gaps_us": round(gap_total, 1), "n_gaps": len(gaps),
        "small_gaps_us": round(small, 1), "min_gap_us": min_gap_us,
        "phases_us": {n: round(e - s, 1) for s, e, n in phase_iv},
        "idle_by_phase": {k: {kk: round(vv, 1) if isinstance(vv, float) else vv for kk, vv in v.items()}
                          for k, v in by_phase.items()},
        "host_bound_by_op": [{"op": k[:80], "us": round(v[0], 1), "gaps": v[1]}
                             for k, v in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]],
        "largest_gaps": rows[:top],
    })
    return out


def main():
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from profile_step import add_model_args, build_method, run_header

    ap = argparse.ArgumentParser()
    add_model_args(ap, "forge-bf16,torch-fused-adamw", "runs/idle")
    ap.add_argument("--steps", type=int, default=3, help="profiled synchronized steps (each mapped)")
    ap.add_argument("--keep-trace", action="store_true", help="also write each method's last chrome trace")
    ns = ap.parse_args()
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cuda = ns.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    result = run_header(ns)
    for m in ns.methods.split(","):
        t = time.time()
        model, opt, after, run, batch = build_method(m, ns)

        def step(ids, mark=False):
            if not mark:
                run(input_ids=ids, labels=ids).loss.backward()
                after()
                return
            with record_function("train_step"):
                with record_function("fwd"):
                    loss = run(input_ids=ids, labels=ids).loss
                with record_function("bwd"):
                    loss.backward()
                with record_function("step"):
                    after()
                sync()

        for _ in range(6):
            step(batch())
        sync()
        maps, walls = [], []
        for i in range(ns.steps):
            ids = batch()
            sync()
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                step(ids, mark=True)
            with tempfile.TemporaryDirectory() as td:
                path = Path(td) / "trace.json"
                prof.export_chrome_trace(str(path))
                trace = json.loads(path.read_text())
                if ns.keep_trace and i == ns.steps - 1:
                    (out / f"{m}-trace.json").write_text(path.read_text())
            maps.append(idle_map(trace))
        # unprofiled synchronized steps beside, to say how much the profiler stretched the step
        for _ in range(10):
            ids = batch()
            sync()
            t0 = time.perf_counter()
            step(ids)
            sync()
            walls.append((time.perf_counter() - t0) * 1e3)
        r = {"unprofiled_ms_median": round(sorted(walls)[len(walls) // 2], 2), "maps": maps,
             "seconds": round(time.time() - t, 1)}
        result["methods"][m] = r
        brief = {k: maps[-1].get(k) for k in ("span_us", "busy_us", "lead_us", "tail_us", "gaps_us", "small_gaps_us",
                                              "idle_by_phase")}
        print(m, r["unprofiled_ms_median"], json.dumps(brief), flush=True)
        model = opt = after = run = None  # free the model before the next method builds its own
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    (out / "idle.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
