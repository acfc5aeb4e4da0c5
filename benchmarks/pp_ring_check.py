"""One ping-pong schedule of pp_sweep.ring_configs() (by index) against the Triton kernel, bit for bit (bf16 W/m/v,
AdamW, stochastic rounding, non-finite count) on one shape, in its own process so that a crash (a launch failure
poisons the CUDA context) names one schedule. Prints PASS/FAIL; exit status 0 only on PASS.

    PYTHONPATH=src python3 benchmarks/pp_ring_check.py INDEX [MxNxBT]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from pp_sweep import ring_configs  # noqa: E402
from test_pingpong_kernel import _run_both  # noqa: E402


def main():
    cfg = ring_configs()[int(sys.argv[1])]
    M, N, BT = map(int, (sys.argv[2] if len(sys.argv) > 2 else "4096x4096x512").split("x"))
    g = torch.Generator(device="cuda").manual_seed(M + BT)
    dy = torch.randn(BT, M, device="cuda", generator=g).bfloat16()
    x = torch.randn(BT, N, device="cuda", generator=g).bfloat16()
    W0 = (torch.randn(M, N, device="cuda", generator=g) * 0.02).bfloat16()
    m0 = (torch.randn(M, N, device="cuda", generator=g) * 1e-2).bfloat16()
    v0 = (torch.randn(M, N, device="cuda", generator=g) * 1e-2).square().bfloat16()
    out = _run_both(W0, m0, v0, dy, x, cfg, sr=True, nonfinite=True)
    same = all(torch.equal(a, b) for a, b in zip(out["pingpong"][:3], out["triton"][:3]))
    same = same and out["pingpong"][3] == out["triton"][3]
    print(f"{'PASS' if same else 'FAIL'} {cfg.short()} {M}x{N}x{BT}", flush=True)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
