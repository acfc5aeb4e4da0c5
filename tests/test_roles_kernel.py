"""The role-split schedule (kernels/roles.py) writes the fused kernel's bits.

Its producers compute the same fp32 tiles as the fused kernel's mainloop (same tile shape, same K order)
and its consumers run the same epilogue code on them, so W, every state and the non-finite count must be
bit-identical to the fused kernel with the same tile, on every rule and state mode.
- CPU: under the Triton interpreter (a child process with TRITON_INTERPRET=1, as test_triton_kernel.py).
  The interpreter runs programs one after another, so this checks the data flow through the ring, not
  the waits; the host makes the ring hold every tile there.
- GPU (``@pytest.mark.gpu``): real shapes with a ring smaller than the tile count, so producers wait for
  consumers, on several grids; a non-finite gradient; ragged shapes.
"""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

triton = pytest.importorskip("triton")

from helpers import run_interpreter_half  # noqa: E402
from test_triton_kernel import exact_inputs, make_job  # noqa: E402


def launch_job(launcher, job, dy, x, config):
    """One update of ``job`` (in place) through ``launcher`` (launch.launch or roles.launch_roles)."""
    launcher(weight=job.weight, dy=dy, x=x, rule_update=job.rule.triton_update, coeffs=job.coeffs,
             states=tuple(job.states) + (None,) * (3 - len(job.states)), grad_sign=job.grad_sign,
             grad_buffer=job.grad_buffer, nonfinite=job.nonfinite, stochastic_weight=job.stochastic_weight,
             stochastic_state=job.stochastic_state, key_weight=job.key_weight,
             key_states=tuple(job.key_states) + (0,) * (3 - len(job.key_states)), config=config)


def assert_same_bits(a, b, what):
    assert torch.equal(a.weight.view(torch.int16) if a.weight.dtype == torch.bfloat16 else a.weight,
                       b.weight.view(torch.int16) if b.weight.dtype == torch.bfloat16 else b.weight), f"{what}: W"
    for va, vb in zip(a.states, b.states):
        da, db = va.data, vb.data
        if da.dtype == torch.bfloat16:
            da, db = da.view(torch.int16), db.view(torch.int16)
        assert torch.equal(da, db), f"{what}: state {va.spec.name}"
        if va.quantized:
            assert torch.equal(va.scale.view(torch.int16), vb.scale.view(torch.int16)), f"{what}: {va.spec.name} scales"
    if a.nonfinite is not None:
        assert int(a.nonfinite) == int(b.nonfinite), f"{what}: non-finite count"


def fused_and_roles(job, dy, x, fused_cfg, roles_cfg):
    from forge_optim.kernels import launch as L
    from forge_optim.kernels import roles as R

    a, b = job, copy.deepcopy(job)
    launch_job(L.launch, a, dy, x, fused_cfg)
    launch_job(R.launch_roles, b, dy, x, roles_cfg)
    return a, b


# ======================================================================================= CPU
if not INTERP:

    def test_roles_interpreter_suite():
        """Run the interpreter half of this file in a child process with TRITON_INTERPRET=1."""
        run_interpreter_half(HERE)


if INTERP:
    from forge_optim.kernels.launch import INTERPRET_CONFIG
    from forge_optim.kernels.roles import RolesConfig

    # the interpreter's fused config: 32x64 tiles, K slices of 16
    ROLES_INTERP = RolesConfig(BM=32, BN=64, BK=16, num_warps=4, num_stages=1, group_size=2, epi_split=2)

    @pytest.mark.parametrize("mode", ["fp32", "bf16-sr", "bf16-rne", "int8"])
    @pytest.mark.parametrize("case", ["AdamW", "Lion", "RMSprop-centered-momentum", "SGD-momentum", "RAdam-rectified"])
    def test_roles_bits_equal_fused_interpreted(case, mode):
        """Ragged shape (70 x 130, BT = 37: edge tiles masked), 15 tiles through the ring, two slices per tile."""
        job = make_job(case, mode, 70, 130)
        dy, x = exact_inputs(37, 70, 130)
        a, b = fused_and_roles(job, dy, x, INTERPRET_CONFIG, ROLES_INTERP)
        assert_same_bits(a, b, f"{case} {mode}")

    @pytest.mark.parametrize("lookahead", [0, 1])
    def test_roles_nonfinite_and_buffer_interpreted(lookahead):
        """A gradient buffer added to the tile (the last micro-step of accumulation) and a non-finite
        gradient row: the same skipped coordinates and count as the fused kernel."""
        from dataclasses import replace

        job = make_job("AdamW", "bf16-sr", 70, 130)
        dy, x = exact_inputs(37, 70, 130)
        dy[5, 11] = float("inf")
        job.grad_buffer = torch.randn(70, 130, generator=torch.Generator().manual_seed(3))
        a, b = fused_and_roles(job, dy, x, INTERPRET_CONFIG, replace(ROLES_INTERP, epi_lookahead=lookahead))
        assert int(a.nonfinite) == 130
        assert_same_bits(a, b, "buffer + non-finite")


# ======================================================================================= GPU
GPU_CASES = [(4096, 4096, 512), (1000, 3008, 515), (14336, 4096, 2048)]


def _gpu_inputs(BT, M, N, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(BT, M, device="cuda", generator=gen).bfloat16(),
            torch.randn(BT, N, device="cuda", generator=gen).bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16-sr", "int8"])
@pytest.mark.parametrize("shape", GPU_CASES)
def test_gpu_roles_bits_equal_fused(shape, mode):
    """Several grids and ring sizes (1 slot per producer: producers wait on consumers every tile),
    against the fused kernel with the same tile; a NaN in dY: the same count and untouched row."""
    from forge_optim.kernels.launch import KernelConfig
    from forge_optim.kernels.roles import RolesConfig

    M, N, BT = shape
    dy, x = _gpu_inputs(BT, M, N, seed=5)
    dy[BT // 3, 17] = float("nan")
    for rc in (RolesConfig(), RolesConfig(ring_per_producer=1),
               RolesConfig(BM=64, BN=128, num_warps=4, producers_per_sm=1, consumers_per_sm=2),
               RolesConfig(BM=64, BN=128, num_warps=4, producers_per_sm=2, consumers_per_sm=1, maxnreg=168,
                           epi_lookahead=0, epi_split=4)):
        fc = KernelConfig(rc.BM, rc.BN, rc.BK, rc.num_warps, rc.num_stages, rc.group_size, 1, rc.epi_split,
                          epi_lookahead=rc.epi_lookahead)
        job = make_job("AdamW", mode, M, N, device="cuda", seed=6)
        w0 = job.weight[17].clone()
        a, b = fused_and_roles(job, dy, x, fc, rc)
        torch.cuda.synchronize()
        assert int(a.nonfinite) == N
        assert torch.equal(b.weight[17], w0)
        assert_same_bits(a, b, f"{shape} {mode} {rc.short()}")
    del dy, x
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_roles_repeated_launches_on_one_ring():
    """Ten steps in a row through one ring (flags carry over between launches) equal ten fused steps."""
    from forge_optim.kernels.launch import KernelConfig
    from forge_optim.kernels.roles import RolesConfig

    M, N, BT = 4096, 4096, 512
    rc = RolesConfig(ring_per_producer=1)
    fc = KernelConfig(rc.BM, rc.BN, rc.BK, rc.num_warps, rc.num_stages, rc.group_size, 1, rc.epi_split,
                      epi_lookahead=rc.epi_lookahead)
    from forge_optim.kernels import launch as L
    from forge_optim.kernels import roles as R

    a = make_job("AdamW", "bf16-sr", M, N, device="cuda", seed=8)
    b = copy.deepcopy(a)
    for step in range(10):
        dy, x = _gpu_inputs(BT, M, N, seed=100 + step)
        launch_job(L.launch, a, dy, x, fc)
        launch_job(R.launch_roles, b, dy, x, rc)
    torch.cuda.synchronize()
    assert_same_bits(a, b, "ten steps")
