"""Does a kernel config that wins a short timing still win once the GPU sits at its power cap?

    PYTHONPATH=src python benchmarks/power_soak.py --out $OUT/power_soak.json [--cases 151936x4096:8192:bf16]

The tuner (kernels/launch.py: Tuner) ranks candidate configs with `do_bench` on a 4096-row sub-problem
(~25 ms of GPU time per config, started from an idle GPU). On 2026-12-03 its pick for the lm_heads at
BT=8192 (`128x256 w16 la1`) ran 1.4% (Llama-3.1-8B) and 18% (Qwen3-8B) slower on the whole weight than
`128x128 w8 s4`, although the sub-problem ranked it first by 12%; at 16384 rows too. The whole weight
runs one launch for 16-20 ms. One explanation is power: at BT=8192 the H200 reaches its power cap
(BS=16 steps ran capped 97% of the time, NOTES.md ninth session), and a config that is fastest while
the GPU is below the cap need not be fastest under it (time under a cap follows energy per launch).

For each case and candidate this script measures, each after an idle pause:
  burst   do_bench on the tuner's 4096-row sub-problem (the tuner's own measurement);
  soak    the same sub-problem launched back to back for --soak-ms; per-launch CUDA-event times,
          `early` (median of the first 10) and `late` (median of the last quarter);
  whole   do_bench on clones of the whole weight (what tuner_fidelity.py called the truth), and the
          whole weight back to back for --soak-ms (`whole_late`);
and the baseline (c) (cuBLAS wgrad + torch._fused_adamw_) the same ways. nvidia-smi samples SM clock,
power and the clock-event reasons every 100 ms; each phase gets its mean clock and power.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernel import parse_cases, random_case, unfused_step  # noqa: E402

from forge_optim.backends.triton_backend import TUNE_ROWS, launch_kwargs, tuning_launch  # noqa: E402
from forge_optim.kernels import fused as fk  # noqa: E402
from forge_optim.kernels.launch import candidate_configs, precompile  # noqa: E402

CASES = [(128256, 4096, 8192, "bf16"), (151936, 4096, 8192, "bf16"), (4096, 4096, 8192, "bf16"),
         (14336, 4096, 8192, "bf16"), (4096, 14336, 8192, "bf16"), (1024, 4096, 8192, "bf16")]


class SmiLog:
    """nvidia-smi sampling in the background into a CSV; ``samples()`` parses it (write() averages the
    samples inside each timed phase)."""
    FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"

    def __init__(self, path: Path, period_ms: int = 100):
        self.path = path
        self.proc = None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
                                          f"-lms={period_ms}"], stdout=open(path, "w"), stderr=subprocess.DEVNULL)

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()

    def samples(self):
        out = []
        if self.proc is None or not self.path.exists():
            return out
        for line in self.path.read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                t = dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                out.append((t, float(parts[1]), float(parts[2]), float(parts[3]), int(parts[4], 16)))
            except (ValueError, IndexError):
                continue
        return out


def back_to_back(fn, soak_ms: float, burst_ms: float) -> list[float]:
    """Per-launch GPU times (ms) of fn launched back to back for about soak_ms of GPU time."""
    n = max(10, int(soak_ms / max(burst_ms, 1e-3)))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev]


def summarize(times: list[float]) -> dict:
    q = max(1, len(times) // 4)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    bins = 10
    step = max(1, len(times) // bins)
    return dict(n=len(times), early=med(times[:10]), late=med(times[-q:]),
                trace=[round(med(times[i:i + step]), 5) for i in range(0, len(times), step)][:bins + 1])


def measure(name, fn_sub, fn_whole, args, phases):
    """burst / soak on the sub-problem, then burst / soak on the whole weight (if it differs)."""
    row = {}
    for fn, burst, soak, rep in ((fn_sub, "burst", "soak", 25), (fn_whole, "whole", "whole_soak", 100)):
        if fn is None:
            continue
        fn()
        torch.cuda.synchronize()
        time.sleep(args.idle_s)
        t0 = time.time()
        row[burst] = do_bench(fn, warmup=5, rep=rep, return_mode="median")
        phases.append((name, burst, t0, time.time()))
        time.sleep(args.idle_s)
        t0 = time.time()
        row[soak] = summarize(back_to_back(fn, args.soak_ms, row[burst]))
        phases.append((name, soak, t0, time.time()))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="", help="DOUTxDIN:BT:MODE,... (default: Llama-3.1-8B's and Qwen3-8B's "
                    "lm_heads and Llama's other linears, BT=8192, bf16 states)")
    ap.add_argument("--soak-ms", type=float, default=800.0)
    ap.add_argument("--idle-s", type=float, default=1.0)
    a = ap.parse_args()
    cases = CASES
    if a.cases:
        cases = parse_cases(a.cases)
    out_path = Path(a.out)
    smi = SmiLog(out_path.with_suffix(".smi.csv"))
    t_start = time.time()
    specs = [dict(config=c, kinds=fk.ADAM_STATE_KINDS[mode]) for (_, _, bt, mode) in cases for c in candidate_configs(bt)]
    precompile(list({repr(s): s for s in specs}.values()))
    print(f"precompiled in {time.time() - t_start:.0f} s", flush=True)

    gen = torch.Generator(device="cuda").manual_seed(0)
    dev_name = torch.cuda.get_device_name()
    results, phases = [], []
    for (M, N, BT, mode) in cases:
        job, dy, x = random_case(M, N, BT, mode, gen)
        W = job.weight
        kwargs = launch_kwargs(job, dy, x)
        case = f"{M}x{N}:{BT}:{mode}"
        rows = {}
        for cfg in candidate_configs(BT):
            fn_sub = tuning_launch(kwargs, cfg, max_rows=TUNE_ROWS)
            fn_whole = tuning_launch(kwargs, cfg, max_rows=M) if M > TUNE_ROWS else None
            try:
                rows[cfg.short()] = measure(f"{case} {cfg.short()}", fn_sub, fn_whole, a, phases)
            except Exception as err:  # noqa: BLE001 - a config that does not fit is skipped, as the tuner does
                rows[cfg.short()] = dict(error=repr(err)[:200])
            del fn_sub, fn_whole
            torch.cuda.empty_cache()
            r = rows[cfg.short()]
            if "burst" in r:
                print(f"{case} {cfg.short():<42} burst {r['burst']:.4f} soak {r['soak']['early']:.4f}->"
                      f"{r['soak']['late']:.4f}" + (f" whole {r['whole']:.3f} ->{r['whole_soak']['late']:.3f}"
                                                    if "whole" in r else ""), flush=True)
        # baseline (c) on the sub-problem and on the whole weight (bf16 W, G, m, v; states as in bench_kernel)
        mb, vb = (torch.randn(M, N, device="cuda", generator=gen) * 1e-3).bfloat16(), \
            (torch.randn(M, N, device="cuda", generator=gen) * 1e-3).square().bfloat16()
        r = min(M, TUNE_ROWS)
        dy_sub = dy[:, :r].contiguous()
        base_sub = unfused_step(W[:r].clone(), mb[:r].clone(), vb[:r].clone(), lambda: (dy_sub, x))
        base_whole = unfused_step(W, mb, vb, lambda: (dy, x)) if M > TUNE_ROWS else None
        rows["(c) cuBLAS wgrad + _fused_adamw_"] = measure(f"{case} (c)", base_sub, base_whole, a, phases)
        rc = rows["(c) cuBLAS wgrad + _fused_adamw_"]
        print(f"{case} (c) burst {rc['burst']:.4f} soak {rc['soak']['early']:.4f}->{rc['soak']['late']:.4f}"
              + (f" whole {rc['whole']:.3f} ->{rc['whole_soak']['late']:.3f}" if "whole" in rc else ""), flush=True)
        results.append(dict(case=case, rows=rows))
        del W, dy, x, dy_sub, job, kwargs, mb, vb, base_sub, base_whole
        torch.cuda.empty_cache()
        write(out_path, a, results, phases, smi, dev_name, complete=False)
    smi.stop()
    write(out_path, a, results, phases, smi, dev_name, complete=True)
    print(f"wrote {out_path} in {time.time() - t_start:.0f} s")


def write(path, a, results, phases, smi, dev_name, complete):
    samples = smi.samples()
    ph = []
    for name, kind, t0, t1 in phases:
        s = [x for x in samples if t0 <= x[0] <= t1]
        ph.append(dict(name=name, kind=kind, seconds=round(t1 - t0, 3), n_samples=len(s),
                       sm_mhz=round(sum(x[1] for x in s) / len(s), 1) if s else None,
                       power_w=round(sum(x[2] for x in s) / len(s), 1) if s else None,
                       max_power_w=max((x[2] for x in s), default=None),
                       power_capped=sum(1 for x in s if x[4] & 0x4) if s else None))
    path.write_text(json.dumps(dict(
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device=dev_name,
        torch=torch.__version__, triton=triton.__version__, command=" ".join([sys.executable] + sys.argv),
        complete=complete, soak_ms=a.soak_ms, idle_s=a.idle_s, results=results, phases=ph), indent=1))


if __name__ == "__main__":
    main()
