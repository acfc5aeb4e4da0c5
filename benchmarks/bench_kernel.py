"""Time the fused FORGE kernel against torch's separate wgrad GEMM + fused AdamW, on one GPU.

    PYTHONPATH=src python benchmarks/bench_kernel.py [--quick] [--shapes 4096x4096,...] [--bts 512,...]
    FORGE_TUNE_EXPLORE=1 ...    also tune the exploratory small-BT configs (kernels/launch.py)

For each Llama-3.1-8B linear shape (Dout x Din) and token count BT, with bf16 W and bf16 (SR) or int8
states (AdamW):
  (a) the fused kernel (TritonBackend.update; autotuned on clones before timing),
  (b) torch's weight-gradient GEMM dY.t() @ X alone,
  (c) (b) followed by torch._fused_adamw_ on bf16 W, G, m, v,
  (d) the floor max(2*BT*Dout*Din / GEMM peak, bytes / copy bandwidth), both ceilings measured in
      this run (8192^3 bf16 matmul; a 2 GiB device copy, bytes read + written). Bytes = W and
      states read and written + dY and X read once.
Times are triton.testing.do_bench medians over rotating input sets. Each call goes through Python
(TritonBackend.update, or torch's dispatcher for (b) and (c)), so a kernel shorter than its host path
is timed at the host's speed; ``--cudagraph`` also times (a), (b) and (c) as CUDA graphs of back-to-back
calls with an L2 flush before each (the flush's own time subtracted), which is the GPU's time alone.
Writes JSON to $OUT/kernel.json if $OUT is set, else benchmarks/results/kernel-<date>.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from forge_optim import precision
from forge_optim.backends.base import StateView, UpdateJob
from forge_optim.backends.triton_backend import TritonBackend
from forge_optim.rules import RULES

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
BTS = [512, 2048, 8192]
MODES = ["bf16", "int8"]


def bench(fn, rep=40):
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


_FLUSH = []


def bench_graph(fn, rep=40):
    """GPU time of fn without its host time: n calls captured in one CUDA graph, each after an L2 flush
    (256 MB memset, as do_bench does), minus the flushes' own graph time. Median of 10 replays."""
    from triton.testing import do_bench_cudagraph

    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.int8, device="cuda"))
    cache = _FLUSH[0]

    def flushed():
        cache.zero_()
        fn()
    try:
        t = do_bench_cudagraph(flushed, rep=rep, return_mode="median")
        return t - do_bench_cudagraph(cache.zero_, rep=rep, return_mode="median")
    except Exception as err:  # noqa: BLE001 - a path that cannot be captured is reported, not fatal
        print(f"  (CUDA graph timing failed: {err!r:.200})", flush=True)
        return float("nan")


def measure_peaks():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = bench(lambda: a @ b, rep=200)
    gemm = 2 * 8192**3 / (t * 1e-3)
    del a, b
    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.float32).bfloat16()
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), rep=200)
    bw = 2 * src.numel() * 2 / (t * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return gemm, bw


def make_states(mode, M, N, gen, rule=RULES["AdamW"], group=None):
    """Random states of ``rule`` (AdamW by default) for an [M, N] weight: bf16, fp32 or int8."""
    views = []
    for sp in rule.state_specs(dict(rule.defaults) if group is None else group):
        v = torch.randn(M, N, device="cuda", generator=gen) * 1e-3
        if sp.nonnegative:
            v = v.square()
        if mode == "int8":
            q, s = precision.quantize(v, sp.nonnegative)
            views.append(StateView(sp, q.contiguous(), s.contiguous()))
        elif mode == "fp32":
            views.append(StateView(sp, v.contiguous()))
        else:
            views.append(StateView(sp, v.bfloat16()))
        del v
    return views


def parse_cases(text: str) -> list[tuple[int, int, int, str]]:
    """'DOUTxDIN:BT:MODE,...' (e.g. '151936x4096:8192:bf16') -> [(Dout, Din, BT, mode), ...]."""
    cases = []
    for c in text.split(","):
        shape, bt, mode = c.split(":")
        m, n = shape.split("x")
        cases.append((int(m), int(n), int(bt), mode))
    return cases


def random_case(M, N, BT, mode, gen):
    """One AdamW problem on random data as the tuner sees it: bf16 W, states of ``mode``, bf16 dY [BT, M]
    and X [BT, N], stochastic rounding, step-1 keys, a non-finite counter; returns (job, dy, x)."""
    rule = RULES["AdamW"]
    coeffs = rule.padded(rule.coefficients(dict(rule.defaults, lr=1e-4, weight_decay=0.1), {}, 10))
    W = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
    views = make_states(mode, M, N, gen)
    dy = torch.randn(BT, M, device="cuda", generator=gen).bfloat16()
    x = torch.randn(BT, N, device="cuda", generator=gen).bfloat16()
    job = UpdateJob(weight=W, rule=rule, coeffs=coeffs, states=views, stochastic_weight=True,
                    stochastic_state=True, key_weight=precision.stream_key(0, 0, 1, 0),
                    key_states=(precision.stream_key(0, 0, 1, 1), precision.stream_key(0, 0, 1, 2), 0),
                    nonfinite=torch.zeros((), dtype=torch.int64, device="cuda"))
    return job, dy, x


def fixed_job(W, views, rule=RULES["AdamW"], group=None, sr=True, nonfinite=None):
    """An update of W and its states ``views`` at step 10 with fixed hash keys: what the kernel
    studies (epilogue_cost, epilogue_lookahead, ncu_fused) launch, so that their bits can be compared."""
    group = dict(rule.defaults) if group is None else group
    return UpdateJob(weight=W, rule=rule, coeffs=rule.padded(rule.coefficients(group, {}, 10)), states=views,
                     stochastic_weight=sr, stochastic_state=sr, key_weight=123,
                     key_states=(456, 789, 0)[:len(views)], nonfinite=nonfinite)


def rotating_inputs(BT, M, N, gen, n):
    """A callable returning the next of ``n`` random (dY [BT, M], X [BT, N]) bf16 pairs in turn, so that
    back-to-back timed calls do not find their operands in L2."""
    ins = [(torch.randn(BT, M, device="cuda", generator=gen).bfloat16(),
            torch.randn(BT, N, device="cuda", generator=gen).bfloat16()) for _ in range(n)]
    ctr = [0]

    def nxt():
        ctr[0] = (ctr[0] + 1) % n
        return ins[ctr[0]]
    return nxt


def unfused_step(W, m, v, nxt):
    """Baseline (c): torch's wgrad GEMM, then torch._fused_adamw_ on bf16 W, G, m, v."""
    step_t = torch.tensor(10.0, device="cuda")

    def fn():
        d, x = nxt()
        G = d.t() @ x
        torch._fused_adamw_([W], [G], [m], [v], [], [step_t], lr=1e-4, beta1=0.9, beta2=0.999,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    return fn


def state_bytes(mode, M, N, BT):
    scale_bytes = getattr(precision, "SCALE_DTYPE", torch.float32).itemsize  # fp32 before the bf16 scales
    per = 12.0 if mode == "bf16" else 4 + 2 + 2 + 2 * 2 * scale_bytes / 64  # W r+w, m, v (r+w), scales
    return per * M * N + 2 * BT * (M + N)


def write_json(args, dev, gemm_peak, copy_bw, rows, backend, final=False):
    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device=dev,
               torch=torch.__version__, triton=triton.__version__, command=" ".join([sys.executable] + sys.argv),
               complete=final, gemm_peak_tflops=gemm_peak / 1e12, copy_bw_tbs=copy_bw / 1e12, rows=rows,
               autotune_winners=backend.tuner.winners,
               autotune_timings_ms={repr(k): v for k, v in backend.tuner.timings.items()})
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "kernel.json"
    else:
        path = Path(__file__).resolve().parent / "results" / f"kernel-{dt.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return path


def run(args):
    dev = torch.cuda.get_device_name()
    if not args.no_precompile:
        import time

        from forge_optim.kernels import fused as fk
        from forge_optim.kernels.launch import (ALL_TUNED_CONFIGS, EXPLORE_SMALL_BT_CONFIGS,
                                                precompile)

        t0 = time.time()
        kinds = fk.ADAM_STATE_KINDS
        explore = EXPLORE_SMALL_BT_CONFIGS if os.environ.get("FORGE_TUNE_EXPLORE") == "1" else ()
        specs = [dict(config=c, kinds=kinds[m])
                 for c in dict.fromkeys(ALL_TUNED_CONFIGS + explore) for m in args.modes]
        res = precompile(specs)
        print(f"precompiled {len(specs)} variants in {time.time() - t0:.0f}s", flush=True)
        for line in res:
            if line.startswith("FAILED"):
                print(line, flush=True)
    gemm_peak, copy_bw = measure_peaks()
    print(f"device {dev}: bf16 GEMM 8192^3 {gemm_peak / 1e12:.0f} TFLOP/s, copy {copy_bw / 1e12:.2f} TB/s",
          flush=True)
    rule = RULES["AdamW"]
    group = dict(rule.defaults, lr=1e-4, weight_decay=0.1)
    coeffs = rule.padded(rule.coefficients(group, {}, 10))
    backend = TritonBackend()
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for (M, N) in args.shapes:
        for BT in args.bts:
            in_bytes = 2 * BT * (M + N)
            nrot = max(1, min(4, int(2e9 // max(in_bytes, 1))))
            nrot = min(nrot, 3)
            nxt = rotating_inputs(BT, M, N, gen, nrot)
            # (b) wgrad alone
            t_b = bench(lambda: (lambda d, x: d.t() @ x)(*nxt()))
            # (c) wgrad + fused AdamW on bf16 W, G, m, v
            W = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
            m = torch.zeros_like(W)
            v = torch.zeros_like(W)
            t_c = bench(unfused_step(W, m, v, nxt))
            if args.cudagraph:
                tg_b = bench_graph(lambda: (lambda d, x: d.t() @ x)(*nxt()))
                tg_c = bench_graph(unfused_step(W, m, v, nxt))
            del m, v
            for mode in args.modes:
                views = make_states(mode, M, N, gen)
                Wf = W.clone()
                nf = torch.zeros((), dtype=torch.int64, device="cuda")
                step = [0]

                def fused():
                    d, x = nxt()
                    step[0] += 1
                    job = UpdateJob(weight=Wf, rule=rule, coeffs=coeffs, states=views,
                                    stochastic_weight=True, stochastic_state=True,
                                    key_weight=precision.stream_key(0, 0, step[0], 0),
                                    key_states=(precision.stream_key(0, 0, step[0], 1),
                                                precision.stream_key(0, 0, step[0], 2), 0),
                                    nonfinite=nf)
                    backend.update(job, d, x)

                fused()  # tunes on clones, compiles
                torch.cuda.synchronize()
                t_a = bench(fused)
                tg_a = bench_graph(fused) if args.cudagraph else None
                assert torch.isfinite(Wf.float()).all(), "non-finite weight written"
                floor = max(2 * BT * M * N / gemm_peak, state_bytes(mode, M, N, BT) / copy_bw) * 1e3
                cfg = backend.tuner.cache.get(next((k for k in backend.tuner.cache if k[0] == (M, N)
                                                    and k[1] == _regime(BT) and k[5][0] == _kind(mode)), None))
                row = dict(shape=f"{M}x{N}", Dout=M, Din=N, BT=BT, states=mode, fused_ms=t_a, wgrad_ms=t_b,
                           unfused_ms=t_c, floor_ms=floor, a_over_c=t_a / t_c, a_over_d=t_a / floor,
                           a_over_b=t_a / t_b, config=cfg.short() if cfg else None)
                if args.cudagraph:
                    row.update(graph_fused_ms=tg_a, graph_wgrad_ms=tg_b, graph_unfused_ms=tg_c,
                               graph_a_over_c=tg_a / tg_c, graph_a_over_d=tg_a / floor)
                rows.append(row)
                print(f"{M:>6}x{N:<6} BT={BT:<5} {mode:4s}  fused {t_a:8.3f}  wgrad {t_b:8.3f}  "
                      f"wgrad+adamw {t_c:8.3f}  floor {floor:8.3f}  a/c {t_a / t_c:5.2f}  a/d {t_a / floor:5.2f}  "
                      f"a/b {t_a / t_b:5.2f}  [{row['config']}]", flush=True)
                if args.cudagraph:
                    print(f"{'':>13} graphs:  fused {tg_a:8.3f}  wgrad {tg_b:8.3f}  wgrad+adamw {tg_c:8.3f}  "
                          f"a/c {tg_a / tg_c:5.2f}  a/d {tg_a / floor:5.2f}", flush=True)
                del views, Wf
                write_json(args, dev, gemm_peak, copy_bw, rows, backend)
            del W, nxt
            torch.cuda.empty_cache()
    return dev, gemm_peak, copy_bw, rows, backend


def _regime(bt):
    from forge_optim.kernels.launch import bt_regime

    return bt_regime(bt)


def _kind(mode):
    from forge_optim.kernels import fused

    return fused.ADAM_STATE_KINDS[mode][0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES))
    ap.add_argument("--bts", default=",".join(map(str, BTS)))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--cudagraph", action="store_true",
                    help="also time (a), (b), (c) as CUDA graphs (GPU time without the host path)")
    ap.add_argument("--quick", action="store_true", help="4096x4096 and 14336x4096 at BT 512 and 8192 only")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.bts = "4096x4096,14336x4096", "512,8192"
    args.shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    args.bts = [int(b) for b in args.bts.split(",")]
    args.modes = args.modes.split(",")
    dev, gemm_peak, copy_bw, rows, backend = run(args)
    print()
    print("| shape | BT | states | (a) fused ms | (b) wgrad ms | (c) wgrad+AdamW ms | (d) floor ms | a/c | a/d | a/b |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['BT']} | {r['states']} | {r['fused_ms']:.3f} | {r['wgrad_ms']:.3f} | "
              f"{r['unfused_ms']:.3f} | {r['floor_ms']:.3f} | {r['a_over_c']:.2f} | {r['a_over_d']:.2f} | "
              f"{r['a_over_b']:.2f} |")
    path = write_json(args, dev, gemm_peak, copy_bw, rows, backend, final=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
