"""The Gluon ping-pong kernel (kernels/pingpong.py), an experimental sm_90 variant of the fused kernel.

- CPU (Linux, Triton's bundled toolchain): the kernel compiles for sm_90a without register spills
  for its configs; the shared-memory fitting and the eligibility rules.
- GPU (``@pytest.mark.gpu``, run on the device): it writes the Triton kernel's bits (bf16 W/m/v,
  stochastic rounding), the same fp32 update, and the same non-finite count and guard.
"""
from __future__ import annotations

import platform

import pytest
import torch

pytest.importorskip("triton")
gluon = pytest.importorskip("triton.experimental.gluon")

from forge_optim.kernels import pingpong as PP  # noqa: E402

CPU_CONFIGS = [PP.PingPongConfig(BN=64, epi_n=2, stages=6),
               PP.PingPongConfig(BN=64, epi_n=4, stages=3, consumer_regs=112, progs_per_sm=2, maxnreg=80)]


def test_fit_config_shrinks_until_shared_memory_fits():
    cfg = PP.PingPongConfig(BN=128, epi_n=4, stages=4)
    bf16 = PP.fit_config(cfg, 2, 4)  # bf16 W, two bf16 states: 197 KB, fits as is
    assert bf16 == cfg and bf16.smem_bytes(2, 4) <= PP.SMEM_LIMIT
    fp32 = PP.fit_config(cfg, 4, 8)  # fp32 W and states: fewer stages, then half-width tiles
    assert fp32 is not None and fp32.smem_bytes(4, 8) <= PP.SMEM_LIMIT and fp32.BN == 64
    two = PP.PingPongConfig(BN=64, epi_n=2, stages=3, progs_per_sm=2)
    assert PP.fit_config(two, 4, 8) is None  # two programs per SM cannot hold fp32 W and states


def test_supported_names_the_reason():
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    dy = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert PP.supported(w, dy, dy, (None, None, None)) == "not on CUDA"


@pytest.mark.skipif(platform.system() != "Linux", reason="Triton's bundled ptxas ships with Linux wheels only")
@pytest.mark.parametrize("cfg", CPU_CONFIGS, ids=lambda c: c.short())
def test_compiles_for_sm90_without_spills(cfg):
    from forge_optim.kernels.ptxas import ptxas_usage

    k = PP.compile_offline(cfg, torch.bfloat16, torch.bfloat16)
    use = ptxas_usage(k.asm["ptx"])
    # one program per SM: the spill-free default; two per SM (80-register cap) may spill a little
    limit = 0 if cfg.progs_per_sm == 1 else 128
    assert use["spill_bytes"] is not None and use["spill_bytes"] <= limit, use
    assert "setmaxnreg" in k.asm["ptx"]  # warp specialization took effect (per-partition registers)


# ----------------------------------------------------------------------------------------- GPU
def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _adamw_views(m, v):
    from forge_optim.backends.base import StateView
    from forge_optim.rules.base import StateSpec

    return (StateView(StateSpec("exp_avg", 0), m), StateView(StateSpec("exp_avg_sq", 1, nonnegative=True), v), None)


def _run_both(W0, m0, v0, dy, x, cfg, sr, nonfinite):
    from forge_optim.kernels import launch as L
    from forge_optim.rules import RULES

    rule = RULES["AdamW"]
    coeffs = rule.padded(rule.coefficients(dict(rule.defaults, lr=1e-3, weight_decay=0.1), {}, 7))
    out = {}
    for name in ("pingpong", "triton"):
        W, m, v = W0.clone(), m0.clone(), v0.clone()
        nf = torch.zeros((), dtype=torch.int64, device="cuda") if nonfinite else None
        kw = dict(weight=W, dy=dy, x=x, rule_update=rule.triton_update, coeffs=coeffs, states=_adamw_views(m, v),
                  nonfinite=nf, stochastic_weight=sr, stochastic_state=sr, key_weight=101, key_states=(202, 303, 0))
        if name == "pingpong":
            assert PP.supported(W, dy, x, kw["states"]) is None
            PP.launch(config=cfg, **kw)
        else:
            L.launch(config=L.GPU_TEST_CONFIG, **kw)
        torch.cuda.synchronize()
        out[name] = (W, m, v, None if nf is None else int(nf.item()))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the ping-pong kernel needs Hopper (sm_90)")
@pytest.mark.parametrize("shape", [(1000, 3008, 515), (4096, 4096, 512)])
@pytest.mark.parametrize("cfg", CPU_CONFIGS, ids=lambda c: c.short())
def test_gpu_pingpong_writes_the_triton_kernels_bits(shape, cfg):
    M, N, BT = shape
    g = torch.Generator(device="cuda").manual_seed(M + BT)
    dy = torch.randn(BT, M, device="cuda", generator=g).bfloat16()
    x = torch.randn(BT, N, device="cuda", generator=g).bfloat16()
    W0 = (torch.randn(M, N, device="cuda", generator=g) * 0.02).bfloat16()
    m0 = (torch.randn(M, N, device="cuda", generator=g) * 1e-2).bfloat16()
    v0 = (torch.randn(M, N, device="cuda", generator=g) * 1e-2).square().bfloat16()
    out = _run_both(W0, m0, v0, dy, x, cfg, sr=True, nonfinite=True)
    for a, b in zip(out["pingpong"][:3], out["triton"][:3]):
        # the same wgmma K-order, the same hash: bit for bit
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(out["pingpong"][0], W0)  # it did update


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the ping-pong kernel needs Hopper (sm_90)")
def test_gpu_pingpong_fp32_state_equals_triton_kernel():
    M, N, BT = 1000, 3008, 515
    g = torch.Generator(device="cuda").manual_seed(5)
    dy = torch.randn(BT, M, device="cuda", generator=g).bfloat16()
    x = torch.randn(BT, N, device="cuda", generator=g).bfloat16()
    W0 = torch.randn(M, N, device="cuda", generator=g) * 0.02
    m0 = torch.randn(M, N, device="cuda", generator=g) * 1e-2
    v0 = (torch.randn(M, N, device="cuda", generator=g) * 1e-2).square()
    out = _run_both(W0, m0, v0, dy, x, PP.DEFAULT_CONFIG, sr=False, nonfinite=False)
    for a, b in zip(out["pingpong"][:3], out["triton"][:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the ping-pong kernel needs Hopper (sm_90)")
def test_gpu_pingpong_nonfinite_count_and_guard():
    M, N, BT = 1000, 3008, 515  # ragged: zero-padded X columns times an infinite dY entry give NaN
    g = torch.Generator(device="cuda").manual_seed(9)
    dy = torch.randn(BT, M, device="cuda", generator=g).bfloat16()
    dy[BT // 2, 333] = float("inf")
    x = torch.randn(BT, N, device="cuda", generator=g).bfloat16()
    W0 = (torch.randn(M, N, device="cuda", generator=g) * 0.02).bfloat16()
    m0 = (torch.randn(M, N, device="cuda", generator=g) * 1e-2).bfloat16()
    v0 = (torch.randn(M, N, device="cuda", generator=g) * 1e-2).square().bfloat16()
    for cfg in CPU_CONFIGS:
        out = _run_both(W0, m0, v0, dy, x, cfg, sr=True, nonfinite=True)
        W, m, v, count = out["pingpong"]
        assert count == out["triton"][3] == N  # every element of row 333, nothing outside the weight
        assert torch.equal(W[333], W0[333]) and torch.equal(m[333], m0[333]) and torch.equal(v[333], v0[333])
        assert torch.isfinite(W.float()).all()
