"""The Gluon ping-pong kernel (kernels/pingpong.py), the sm_90 variant of the fused kernel that tuned tables
may name for bf16/fp32-state keys.

- CPU (Linux, Triton's bundled toolchain): the kernel compiles for sm_90a without register spills
  for its configs; the shared-memory fitting and the eligibility rules.
- GPU (``@pytest.mark.gpu``, run on the device): it writes the Triton kernel's bits (bf16 W/m/v,
  stochastic rounding), the same fp32 update, and the same non-finite count and guard; the backend
  launches a tabled ping-pong config and its prepared plan with those bits, and routes a misaligned dY to
  the Triton kernel.
"""
from __future__ import annotations

import platform

import pytest
import torch

pytest.importorskip("triton")
gluon = pytest.importorskip("triton.experimental.gluon")

from forge_optim.kernels import pingpong as PP  # noqa: E402
from helpers import load_benchmark  # noqa: E402

CPU_CONFIGS = [PP.PingPongConfig(BN=64, epi_n=2, stages=6),
               PP.PingPongConfig(BN=64, epi_n=4, stages=3, consumer_regs=112, progs_per_sm=2, maxnreg=80),
               # a 64x128 schedule the H100 table names (kernels/tuned/nvidia_h100_80gb_hbm3.json)
               PP.PingPongConfig(BN=128, epi_n=4, stages=5, group_size=16),
               # three and four tiles' W/states in shared memory (a slot is used by both consumers in turn)
               PP.PingPongConfig(BN=128, epi_n=4, stages=3, group_size=16, state_slots=3),  # tabled: lm_head BT=256
               PP.PingPongConfig(BN=64, epi_n=2, stages=6, state_slots=4),
               PP.PingPongConfig(BN=64, epi_n=2, stages=5, state_slots=5),  # tabled at BT=256 (H100)
               # a 128-row accumulator per consumer and one tile's W/states in shared memory (large BT)
               PP.PingPongConfig(BM=128, BN=128, epi_n=8, stages=4, state_slots=1)]


def test_table_form_round_trips_and_names_the_kernel():
    for cfg in PP.CANDIDATES:
        d = PP.table_dict(cfg)
        assert d["kernel"] == "pingpong" and PP.from_table(d) == cfg


def test_backend_says_why_the_pingpong_kernel_cannot_take_a_launch():
    """The cases the Triton backend must route to the Triton kernel even where a table names the
    ping-pong kernel: accumulation, a gradient buffer, an element-wise (BT=0) update, not on CUDA."""
    from forge_optim.backends.triton_backend import pingpong_unsupported
    from forge_optim.kernels import fused

    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    dy = torch.zeros(8, 64, dtype=torch.bfloat16)
    base = dict(weight=w, dy=dy, x=dy, states=(None, None, None), grad_buffer=None, mode=fused.MODE_UPDATE)
    assert "accumulate" in pingpong_unsupported(dict(base, mode=fused.MODE_ACCUMULATE))
    assert "gradient buffer" in pingpong_unsupported(dict(base, grad_buffer=torch.zeros(64, 64)))
    assert "no tokens" in pingpong_unsupported(dict(base, dy=dy[:0], x=dy[:0]))
    assert pingpong_unsupported(base) == "not on CUDA"
    from forge_optim.backends.base import StateView
    from forge_optim.rules.base import StateSpec

    q = StateView(StateSpec("exp_avg", 0), torch.zeros(64, 64, dtype=torch.int8), torch.zeros(64, 1, dtype=torch.bfloat16))
    assert "int8" in pingpong_unsupported(dict(base, states=(q, None, None)))


def test_fit_config_shrinks_until_shared_memory_fits():
    cfg = PP.PingPongConfig(BN=128, epi_n=4, stages=4)
    bf16 = PP.fit_config(cfg, 2, 4)  # bf16 W, two bf16 states: 197 KB, fits as is
    assert bf16 == cfg and bf16.smem_bytes(2, 4) <= PP.SMEM_LIMIT
    fp32 = PP.fit_config(cfg, 4, 8)  # fp32 W and states: fewer stages, then half-width tiles
    assert fp32 is not None and fp32.smem_bytes(4, 8) <= PP.SMEM_LIMIT and fp32.BN == 64
    slots = PP.fit_config(PP.PingPongConfig(BN=128, epi_n=4, stages=5, state_slots=4), 2, 4)
    assert (slots.stages, slots.state_slots, slots.BN) == (2, 3, 128)  # stages first, then slots, then width
    assert slots.smem_bytes(2, 4) <= PP.SMEM_LIMIT
    one = PP.PingPongConfig(BM=128, BN=128, epi_n=8, stages=4, state_slots=1)  # 225 KB: fits as is
    assert PP.fit_config(one, 2, 4) == one and one.smem_bytes(2, 4) <= PP.SMEM_LIMIT
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


@pytest.mark.skipif(platform.system() != "Linux", reason="Triton's bundled ptxas ships with Linux wheels only")
@pytest.mark.parametrize("cfg", PP.INT8_CONFIGS, ids=lambda c: c.short())
def test_int8_states_compile_for_sm90(cfg):
    """int8 m and uint8 v: codes through TMA, scales from global memory, the block absmax over a 64-column
    slice. Spills are allowed (measured: 24 B at 64x64, 548 B at 64x128), not unbounded."""
    from forge_optim.kernels.ptxas import ptxas_usage

    k = PP.compile_offline(cfg, torch.bfloat16, torch.int8)
    use = ptxas_usage(k.asm["ptx"])
    assert use["spill_bytes"] is not None and use["spill_bytes"] <= 1024, use
    assert "cvt.rni.sat.s8.f32" in k.asm["ptx"] and "cvt.rni.sat.u8.f32" in k.asm["ptx"]  # the int8 rounding


def test_int8_states_need_one_scale_block_per_slice():
    from forge_optim.backends.base import StateView
    from forge_optim.rules.base import StateSpec

    w = torch.zeros(128, 128, dtype=torch.bfloat16)
    q = torch.zeros(128, 128, dtype=torch.int8)
    sc = torch.zeros(128, 2, dtype=torch.bfloat16)
    states = (StateView(StateSpec("exp_avg", 0), q, sc), None, None)
    with pytest.raises(ValueError, match="64 columns"):
        PP.launch(weight=w, dy=w, x=w, rule_update=None, states=states, config=PP.PingPongConfig(BN=128, epi_n=4))


# ----------------------------------------------------------------------------------------- GPU
def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _adamw_views(m, v):
    from forge_optim.backends.base import StateView
    from forge_optim.rules.base import StateSpec

    return (StateView(StateSpec("exp_avg", 0), m), StateView(StateSpec("exp_avg_sq", 1, nonnegative=True), v), None)


def _adamw_inputs(M, N, BT, seed, dtype=torch.bfloat16):
    """bf16 dY [BT, M] and X [BT, N], and W, m, v [M, N] in ``dtype``, drawn in that order from ``seed``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dy = torch.randn(BT, M, device="cuda", generator=g).bfloat16()
    x = torch.randn(BT, N, device="cuda", generator=g).bfloat16()
    W0 = (torch.randn(M, N, device="cuda", generator=g) * 0.02).to(dtype)
    m0 = (torch.randn(M, N, device="cuda", generator=g) * 1e-2).to(dtype)
    v0 = (torch.randn(M, N, device="cuda", generator=g) * 1e-2).square().to(dtype)
    return dy, x, W0, m0, v0


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
    dy, x, W0, m0, v0 = _adamw_inputs(M, N, BT, M + BT)
    out = _run_both(W0, m0, v0, dy, x, cfg, sr=True, nonfinite=True)
    for a, b in zip(out["pingpong"][:3], out["triton"][:3]):
        # the same wgmma K-order, the same hash: bit for bit
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(out["pingpong"][0], W0)  # it did update


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the ping-pong kernel needs Hopper (sm_90)")
@pytest.mark.parametrize("bt", [16, 64])
def test_gpu_one_state_slot_holds_with_mainloops_shorter_than_a_state_load(bt):
    """With one state slot, a consumer's mainloop of one K step ends long before the other consumer's tile has
    been stored and the next tile's W/states have landed: the consumer must still read its own tile's (the
    parity wait alone would take the previous tile's load for its own). 8 tiles per program at 4096x4096."""
    cfg = next(c for c in CPU_CONFIGS if c.state_slots == 1)
    dy, x, W0, m0, v0 = _adamw_inputs(4096, 4096, bt, bt)
    for _ in range(3):  # a race shows on some launches only
        out = _run_both(W0, m0, v0, dy, x, cfg, sr=True, nonfinite=True)
        for a, b in zip(out["pingpong"][:3], out["triton"][:3]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the ping-pong kernel needs Hopper (sm_90)")
def test_gpu_pingpong_fp32_state_equals_triton_kernel():
    M, N, BT = 1000, 3008, 515
    dy, x, W0, m0, v0 = _adamw_inputs(M, N, BT, 5, torch.float32)
    out = _run_both(W0, m0, v0, dy, x, PP.DEFAULT_CONFIG, sr=False, nonfinite=False)
    for a, b in zip(out["pingpong"][:3], out["triton"][:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the ping-pong kernel needs Hopper (sm_90)")
def test_gpu_pingpong_nonfinite_count_and_guard():
    M, N, BT = 1000, 3008, 515  # ragged: zero-padded X columns times an infinite dY entry give NaN
    dy, x, W0, m0, v0 = _adamw_inputs(M, N, BT, 9)
    dy[BT // 2, 333] = float("inf")
    for cfg in CPU_CONFIGS:
        out = _run_both(W0, m0, v0, dy, x, cfg, sr=True, nonfinite=True)
        W, m, v, count = out["pingpong"]
        assert count == out["triton"][3] == N  # every element of row 333, nothing outside the weight
        assert torch.equal(W[333], W0[333]) and torch.equal(m[333], m0[333]) and torch.equal(v[333], v0[333])
        assert torch.isfinite(W.float()).all()


def test_encoded_relaunch_passes_the_launchers_own_arguments(monkeypatch):
    """EncodedRelaunch hands the launcher's C ``launch`` exactly the arguments Triton's own wrapper builds for
    ``relaunch``'s call, with W's and the states' TMA descriptors encoded once per plan and dY's and X's once
    per address (CPU: an offline-compiled kernel's signature and descriptor metadata, Triton's
    ``wrap_handle_tensordesc`` around a recording C launch, a fake cuTensorMapEncodeTiled)."""
    import types

    import triton
    from triton.backends.nvidia import driver as nv
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    cfg = PP.PingPongConfig(BN=128, epi_n=4, stages=5)
    k = PP.compile_offline(cfg)
    encodes = []

    def fill(ptr, swizzle, elem_size, dtype, block, shape, strides, padding):
        encodes.append(ptr)
        return ("tma", ptr, swizzle, elem_size, dtype, tuple(block), tuple(shape), tuple(strides), padding)

    monkeypatch.setattr(triton.runtime.driver, "_active",
                        types.SimpleNamespace(utils=types.SimpleNamespace(fill_tma_descriptor=fill)))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    calls = []
    run = nv.CudaLauncher.__new__(nv.CudaLauncher)
    run.launch = nv.wrap_handle_tensordesc(lambda *a: calls.append(a), k.src.signature, k.metadata.tensordesc_meta)
    run.num_ctas, run.global_scratch_size, run.profile_scratch_size = 1, 0, 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch_cooperative_grid = run.launch_pdl = False
    compiled = types.SimpleNamespace(run=run, function=77, packed_metadata=("packed",))

    M, N, BT = 256, 512, 64
    W, m, v = (torch.zeros(M, N, dtype=torch.bfloat16) for _ in range(3))
    sn = cfg.BN // cfg.epi_n

    def desc(t, block):
        return TensorDescriptor.from_tensor(t, block, gluon.language.NVMMASharedLayout.get_default_for(
            block, gluon.language.bfloat16))

    dy0, x0 = torch.zeros(BT, M, dtype=torch.bfloat16), torch.zeros(BT, N, dtype=torch.bfloat16)
    w_desc = desc(W, [cfg.BM, sn])
    args = [None, None, w_desc, desc(m, [cfg.BM, sn]), desc(v, [cfg.BM, sn]), w_desc, W, M, N, 8,
            *([0.0] * 8), 1.0, 0, 0, 0, 0, W, W, W, (N + 63) // 64]  # as launch() lays them out
    args += [0] * (len(k.src.signature) - len(args))  # the constexprs' values
    record = (compiled, 8, args, (cfg.BK, cfg.BM, cfg.BN, desc(dy0, [cfg.BK, cfg.BM]).layout,
                                  desc(x0, [cfg.BK, cfg.BN]).layout))
    enc = PP.EncodedRelaunch.make(record)
    assert enc is not None and len(encodes) == 4  # W and the states, once
    inputs = [(torch.randn(BT, M).bfloat16(), torch.randn(BT, N).bfloat16()) for _ in range(2)]
    for step, (dy, x) in enumerate(inputs + inputs[:1]):  # the third call's dY and X are the first's
        coeffs = [0.1 * (i + step) for i in range(8)]
        keys = (11 + step, 12, 13, 0)
        PP.relaunch(record, dy, x, coeffs, -1.0, keys[0], keys[1:], 0)
        enc(dy, x, coeffs, -1.0, keys[0], keys[1:], 0)
        want, got = calls[-2], calls[-1]
        assert len(want) == len(got)
        for i, (a, b) in enumerate(zip(want, got)):
            assert a is b or (not isinstance(a, torch.Tensor) and a == b), (i, a, b)
        assert want[13][0] == "tma" and want[13][1] == dy.data_ptr()  # dY's descriptor comes first
    # relaunch: six per call; EncodedRelaunch: dY's and X's, the first time it sees them
    assert len(encodes) == 4 + 3 * 6 + 2 * 2
    assert len(enc.inputs) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the ping-pong kernel needs Hopper (sm_90)")
@pytest.mark.parametrize("encoded", [False, True], ids=["relaunch", "encoded"])
def test_gpu_backend_launches_a_tabled_pingpong_config_and_its_plan(tmp_path, monkeypatch, encoded):
    """A (user) table that names the ping-pong kernel for a key: the backend's update, and the prepared plan's
    re-launches with new dY/X (pingpong.relaunch, or EncodedRelaunch), write the Triton kernel's bits; a dY that
    is not 16-byte aligned takes the Triton kernel instead (the plan refuses it, the update falls back), with
    the same bits."""
    import json
    from dataclasses import replace

    from forge_optim.backends.triton_backend import PingPongPlan, TritonBackend, launch_kwargs, tuning_key
    from forge_optim.kernels import launch as L
    from forge_optim.kernels import tuned

    from test_tuned_table import _gpu_adam_job

    M, N, BT = 1024, 2048, 512
    name = torch.cuda.get_device_name()
    cfg = PP.PingPongConfig(BN=128, epi_n=4, stages=5, group_size=16)
    gen = torch.Generator(device="cuda").manual_seed(17)
    batches = [(torch.randn(BT, M, device="cuda", generator=gen).bfloat16(),
                torch.randn(BT, N, device="cuda", generator=gen).bfloat16()) for _ in range(3)]
    a, b = _gpu_adam_job(M, N, seed=4), _gpu_adam_job(M, N, seed=4)
    key = tuning_key(a, batches[0][0], launch_kwargs(a, *batches[0]))
    monkeypatch.setenv("FORGE_TUNED_DIR", str(tmp_path))
    monkeypatch.setattr(PP, "ENCODED_RELAUNCH", encoded)
    (tmp_path / tuned.table_name(name)).write_text(json.dumps(dict(
        device=name, entries=[dict(key=tuned.key_text(key), config=PP.table_dict(cfg))])))
    tuned.load_table.cache_clear()
    try:
        be, ref = TritonBackend(), TritonBackend(config=L.GPU_TEST_CONFIG)

        def same():
            torch.cuda.synchronize()
            assert torch.equal(a.weight.view(torch.int16), b.weight.view(torch.int16))
            assert all(torch.equal(va.data.view(torch.int16), vb.data.view(torch.int16))
                       for va, vb in zip(a.states, b.states))

        be.update(a, *batches[0])
        ref.update(b, *batches[0])
        assert be.tuner.cache[key] == cfg
        same()
        plan = be.plan(a, *batches[0])
        assert isinstance(plan, PingPongPlan)
        for step, (dy, x) in enumerate(batches[1:], start=1):  # first run compiles, the second relaunches
            keys = (1000 + step, 2000 + step)
            plan.run(dy, x, a.coeffs, 1.0, 3000 + step, keys)
            ref.update(replace(b, key_weight=3000 + step, key_states=keys), dy, x)
            same()
        assert plan.by_class  # the record relaunch uses
        assert all((enc is not None) == encoded for _, enc in plan.by_class.values())
        # a dY whose rows start 2 bytes off 16-byte alignment: not for TMA
        raw = torch.randn(BT * M + 1, device="cuda", generator=gen).bfloat16()
        dy_off = raw[1:].view(BT, M)
        assert not plan.matches(dy_off, batches[0][1])
        be.update(a, dy_off, batches[0][1])
        ref.update(b, dy_off, batches[0][1])
        same()
        assert not isinstance(be.tuner.cache[key + ("triton",)], PP.PingPongConfig)
    finally:
        tuned.load_table.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the ping-pong kernel needs Hopper (sm_90)")
@pytest.mark.parametrize("shape", [(1000, 3008, 515), (4096, 4096, 512)])
@pytest.mark.parametrize("cfg", PP.INT8_CONFIGS, ids=lambda c: c.short())
def test_gpu_pingpong_int8_writes_the_triton_kernels_bits(shape, cfg):
    """int8 m / uint8 v with bf16 block scales, bf16 W with stochastic rounding: the codes, the scales and W
    equal the Triton kernel's bit for bit, and the non-finite count matches."""
    from forge_optim import precision
    from forge_optim.backends.base import StateView
    from forge_optim.kernels import launch as L
    from forge_optim.rules import RULES
    from forge_optim.rules.base import StateSpec

    M, N, BT = shape
    g = torch.Generator(device="cuda").manual_seed(M + 7)
    dy = torch.randn(BT, M, device="cuda", generator=g).bfloat16()
    dy[BT // 3, M // 2] = float("inf")  # one non-finite row
    x = torch.randn(BT, N, device="cuda", generator=g).bfloat16()
    W0 = (torch.randn(M, N, device="cuda", generator=g) * 0.02).bfloat16()
    m0 = precision.quantize(torch.randn(M, N, device="cuda", generator=g) * 1e-2, False)
    v0 = precision.quantize((torch.randn(M, N, device="cuda", generator=g) * 1e-2).square(), True)
    rule = RULES["AdamW"]
    coeffs = rule.padded(rule.coefficients(dict(rule.defaults, lr=1e-3, weight_decay=0.1), {}, 7))
    out = {}
    for name in ("pingpong", "triton"):
        W = W0.clone()
        (mq, ms), (vq, vs) = [(a.clone().contiguous(), b.clone().contiguous()) for a, b in (m0, v0)]
        views = (StateView(StateSpec("exp_avg", 0), mq, ms),
                 StateView(StateSpec("exp_avg_sq", 1, nonnegative=True), vq, vs), None)
        nf = torch.zeros((), dtype=torch.int64, device="cuda")
        kw = dict(weight=W, dy=dy, x=x, rule_update=rule.triton_update, coeffs=coeffs, states=views, nonfinite=nf,
                  stochastic_weight=True, stochastic_state=True, key_weight=101, key_states=(202, 303, 0))
        if name == "pingpong":
            assert PP.supported(W, dy, x, views) is None
            PP.launch(config=cfg, **kw)
        else:
            L.launch(config=L.GPU_TEST_CONFIG, **kw)
        torch.cuda.synchronize()
        out[name] = (W, mq, ms, vq, vs, int(nf.item()))
    for a, b in zip(out["pingpong"][:5], out["triton"][:5]):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.bfloat16 else a.view(torch.int16),
                           b.view(torch.uint8) if b.dtype != torch.bfloat16 else b.view(torch.int16))
    assert out["pingpong"][5] == out["triton"][5] == N


def test_pp_table_takes_only_bit_checked_or_tested_schedules():
    """pp_table.py: a CANDIDATES schedule may be tabled from its timing; a schedule no test names only where the
    sweep's --check-bits found its bytes equal (its config read from the sweep row); a failed check never."""
    T = load_benchmark("pp_table")
    known = PP.CANDIDATES[0]
    new = PP.PingPongConfig(BN=64, epi_n=2, stages=10)
    assert new not in PP.CANDIDATES
    table = dict(device="GPU", entries=[])

    def sweep(ms, bits=None, shape="4096x4096"):
        row = dict(shape=shape, BT=512, states="bf16", ms=dict(ms, **{"triton 128x256x64 w16": 0.100}),
                   configs={new.short(): PP.table_dict(new), known.short(): PP.table_dict(known)})
        if bits is not None:
            row["bits_equal"] = bits
        return dict(device="GPU", date="2026-12-07", command="pp_sweep.py", rows=[row])

    # the untested schedule is fastest but unchecked: the known one is tabled
    out, changes = T.apply(table, [sweep({new.short(): 0.080, known.short(): 0.090})], "why", 0.03)
    assert out["entries"][0]["config"] == PP.table_dict(PP.fit_config(known, 2, 4)), changes
    # checked and equal: the new schedule is tabled from the row's config, with a reminder
    out, changes = T.apply(table, [sweep({new.short(): 0.080, known.short(): 0.090},
                                         {new.short(): True, known.short(): True})], "why", 0.03)
    assert PP.from_table(out["entries"][0]["config"]) == new and "CANDIDATES" in changes[0]
    # a failed check excludes even a CANDIDATES schedule
    out, changes = T.apply(table, [sweep({known.short(): 0.080}, {known.short(): False})], "why", 0.03)
    assert out["entries"] == [] and changes == []


def test_pp_sweep_reads_explicit_schedules_and_refuses_unknown_fields():
    S = load_benchmark("pp_sweep")
    assert S.parse_configs("BN=128,BK=32,epi_n=4,stages=10;BN=64; ") == [
        PP.PingPongConfig(BN=128, BK=32, epi_n=4, stages=10), PP.PingPongConfig(BN=64)]
    assert S.parse_configs("") == []
    with pytest.raises(SystemExit, match="'stage=3' is not FIELD=INT"):
        S.parse_configs("BN=128,stage=3")
    with pytest.raises(SystemExit, match="FIELD=INT"):
        S.parse_configs("BN=wide")


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the ping-pong kernel needs Hopper (sm_90)")
def test_gpu_pp_sweep_bit_check_tells_a_matching_schedule_from_a_different_update(monkeypatch):
    """pp_sweep.py --check-bits: a schedule the bit tests pass reads True and leaves the timed tensors as they
    were; the same schedule fed twice the gradient (a different update of m and v) reads False."""
    S = load_benchmark("pp_sweep")
    g = torch.Generator(device="cuda").manual_seed(3)
    M, N, BT = 1000, 3008, 512
    dy = torch.randn(BT, M, device="cuda", generator=g).bfloat16()
    x = torch.randn(BT, N, device="cuda", generator=g).bfloat16()
    W = (torch.randn(M, N, device="cuda", generator=g) * 0.02).bfloat16()
    views = list(_adamw_views((torch.randn(M, N, device="cuda", generator=g) * 1e-2).bfloat16(),
                              (torch.randn(M, N, device="cuda", generator=g) * 1e-2).square().bfloat16())[:2])
    W0, m0 = W.clone(), views[0].data.clone()
    assert S.same_bits(CPU_CONFIGS[0], W, views, dy, x) is True
    assert torch.equal(W, W0) and torch.equal(views[0].data, m0)
    run = S.run
    monkeypatch.setattr(S, "run", lambda kernel, W2, v2, dy2, *rest: run(kernel, W2, v2, dy2 * 2 if kernel == "pingpong"
                                                                       else dy2, *rest))
    assert S.same_bits(CPU_CONFIGS[0], W, views, dy, x) is False
