"""Is the role-split schedule (kernels/roles.py: GEMM programs and update programs side by side) faster
than the fused kernel? One device call:

    PYTHONPATH=src python benchmarks/roles_check.py [--quick] [--shapes 4096x4096,...] [--bts 512,2048]

For each Llama-3.1-8B weight shape, BT and state mode (bf16, int8), in one process (do_bench median, L2
flushed between calls, three rotating dY/X pairs): (c) cuBLAS wgrad + torch._fused_adamw_ (bf16 only),
the fused kernel with the configs the shipped tables pick at BT=512 on Hopper, and the role-split
configs below. Also, at 4096x4096 BT=64 (almost no GEMM), each schedule's update-only speed. Configs
whose programs cannot all be resident are reported as such (the launcher refuses them).
Writes $OUT/roles_check.json (else benchmarks/results/roles-<date>.json).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from forge_optim.kernels import launch as L  # noqa: E402
from forge_optim.kernels import roles as R  # noqa: E402
from forge_optim.kernels.roles import RolesConfig  # noqa: E402

from bench_kernel import measure_peaks, random_case, rotating_inputs, state_bytes, unfused_step  # noqa: E402
from test_roles_kernel import launch_job  # noqa: E402

FUSED = [L.SMALL_BT_CONFIGS[-4], L.SMALL_BT_CONFIGS[-3], L.SMALL_BT_CONFIGS[-2], L.SMALL_BT_CONFIGS[4]]
FUSED_LARGE = [L.LARGE_BT_CONFIGS[0], L.LARGE_BT_CONFIGS[4]]
ROLES = [
    RolesConfig(),  # 128x128 w8 e8 r128: 1 producer + 1 consumer per SM
    RolesConfig(BM=64, BN=128, num_warps=4, epi_split=8, consumers_per_sm=2),
    RolesConfig(BM=64, BN=64, num_warps=4, epi_split=4, producers_per_sm=2, consumers_per_sm=2),
    RolesConfig(BM=64, BN=64, num_warps=4, epi_split=4, producers_per_sm=1, consumers_per_sm=3),
    RolesConfig(BM=32, BN=128, num_warps=4, epi_split=4, producers_per_sm=1, consumers_per_sm=3),
]


def bench(fn):
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def timing(M, N, BT, mode, gen, fused_cfgs, roles_cfgs, baseline=True):
    row = dict(shape=f"{M}x{N}", BT=BT, mode=mode)
    job, _, _ = random_case(M, N, BT, mode, gen)
    nxt = rotating_inputs(BT, M, N, gen, 3)
    if baseline and mode == "bf16":
        m, v = job.states[0].data, job.states[1].data
        row["wgrad_ms"] = bench(lambda: (lambda d, x: d.t() @ x)(*nxt()))
        row["unfused_ms"] = bench(unfused_step(job.weight, m, v, nxt))
    for name, launcher, cfgs in (("fused", L.launch, fused_cfgs), ("roles", R.launch_roles, roles_cfgs)):
        for c in cfgs:
            label = f"{name} {c.short()}"
            try:
                fn = lambda: launch_job(launcher, job, *nxt(), c)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                row[label] = bench(fn)
            except Exception as err:  # noqa: BLE001 - reported in the JSON, the run goes on
                row[label] = repr(err)[:300]
    for name in ("fused", "roles"):
        t = [v for k, v in row.items() if k.startswith(name + " ") and isinstance(v, float)]
        row[f"best_{name}_ms"] = min(t) if t else None
    if row["best_fused_ms"] and row["best_roles_ms"]:
        row["roles_over_fused"] = row["best_roles_ms"] / row["best_fused_ms"]
    if row.get("unfused_ms") and row["best_roles_ms"]:
        row["roles_over_c"] = row["best_roles_ms"] / row["unfused_ms"]
        row["fused_over_c"] = row["best_fused_ms"] / row["unfused_ms"]
    row["state_bytes"] = state_bytes(mode, M, N, BT)
    assert torch.isfinite(job.weight.float()).all()
    del job, nxt
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4096x4096 and 14336x4096 at BT=512 only")
    ap.add_argument("--shapes", default="4096x4096,1024x4096,14336x4096,4096x14336,128256x4096")
    ap.add_argument("--bts", default="512")
    ap.add_argument("--modes", default="bf16,int8")
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    gemm, bw = measure_peaks()
    results = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                   device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   command=" ".join([sys.executable] + sys.argv), gemm_tflops=gemm / 1e12, copy_tbs=bw / 1e12,
                   roles_configs=[c.short() for c in ROLES], timing=[])
    path = Path(os.environ["OUT"]) / "roles_check.json" if os.environ.get("OUT") else (
        Path(__file__).resolve().parent / "results" / f"roles-{dt.date.today().isoformat()}.json")
    print(json.dumps({k: v for k, v in results.items() if k != "timing"}), flush=True)

    def save():
        path.write_text(json.dumps(results, indent=1) + "\n")

    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    bts = [int(b) for b in a.bts.split(",")]
    if a.quick:
        shapes, bts = [(4096, 4096), (14336, 4096)], [512]
    # update-only speed: BT=64 leaves almost no GEMM
    r = timing(4096, 4096, 64, "bf16", gen, FUSED, ROLES, baseline=False)
    r["note"] = "BT=64: the update's own speed; state bytes / time = effective bandwidth"
    results["timing"].append(r)
    print(json.dumps(r), flush=True)
    save()
    for (M, N) in shapes:
        for BT in bts:
            for mode in a.modes.split(","):
                r = timing(M, N, BT, mode, gen, FUSED if BT <= 1024 else FUSED_LARGE, ROLES)
                results["timing"].append(r)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
                save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
