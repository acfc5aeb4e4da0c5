"""The fused Triton kernel against the torch backend (the reference semantics) and torch.optim.

Two halves:
- CPU: the kernel under the Triton interpreter. ``TRITON_INTERPRET`` must be set before triton is
  imported and it changes what ``triton.jit`` returns process-wide, so these tests never set it in
  the pytest process that runs the rest of the suite: ``test_interpreter_suite`` re-runs this file
  in a subprocess with ``TRITON_INTERPRET=1``, where the ``interp`` tests below are collected.
- GPU (``@pytest.mark.gpu``, skipped without CUDA): real shapes, run on the device with
  ``pytest -m gpu tests/test_triton_kernel.py``.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HERE = Path(__file__).resolve()
REPO = HERE.parents[1]

triton = pytest.importorskip("triton")

from forge_optim import precision  # noqa: E402
from forge_optim.backends.base import StateView, UpdateJob  # noqa: E402
from forge_optim.backends.torch_backend import TorchBackend, apply_update  # noqa: E402
from forge_optim.rules import RULES  # noqa: E402

# (rule, group overrides, step)
RULE_CASES = {
    "AdamW": ("AdamW", dict(lr=1e-2, weight_decay=0.1), 3),
    "Adam": ("Adam", dict(lr=1e-2, weight_decay=0.1), 3),
    "NAdam": ("NAdam", dict(lr=1e-2, weight_decay=0.1), 3),
    "NAdam-decoupled": ("NAdam", dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True), 3),
    "RAdam-early": ("RAdam", dict(lr=1e-2, weight_decay=0.1), 2),
    "RAdam-rectified": ("RAdam", dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True), 10),
    "Lion": ("Lion", dict(lr=1e-3, weight_decay=0.1), 3),
    "RMSprop": ("RMSprop", dict(lr=1e-3, weight_decay=0.1), 3),
    "RMSprop-centered-momentum": ("RMSprop", dict(lr=1e-3, weight_decay=0.1, momentum=0.9, centered=True), 3),
    "RMSprop-centered": ("RMSprop", dict(lr=1e-3, centered=True), 3),
    "Adagrad": ("Adagrad", dict(lr=1e-2, weight_decay=0.1, lr_decay=0.01, initial_accumulator_value=0.1), 3),
    "SGD": ("SGD", dict(lr=1e-2, weight_decay=0.1), 3),
    "SGD-momentum-first": ("SGD", dict(lr=1e-2, momentum=0.9, dampening=0.1), 1),
    "SGD-momentum": ("SGD", dict(lr=1e-2, weight_decay=0.1, momentum=0.9, dampening=0.1), 4),
    "SGD-nesterov": ("SGD", dict(lr=1e-2, weight_decay=0.1, momentum=0.9, nesterov=True), 4),
}
STATE_MODES = ("fp32", "bf16-sr", "bf16-rne", "int8")


def rule_case(case: str):
    """(rule, param group, padded coefficients) of a RULE_CASES entry at its step, with scalar states
    (NAdam's mu_product) advanced through the earlier steps as an optimizer would."""
    rule_name, over, step = RULE_CASES[case]
    rule = RULES[rule_name]
    group = dict(rule.defaults)
    group.update(over)
    state = {k: torch.tensor(v) for k, v in rule.scalar_states.items()}
    for s in range(1, step):
        rule.coefficients(group, state, s)
    return rule, group, rule.padded(rule.coefficients(group, state, step))


def make_job(case: str, mode: str, M: int, N: int, device="cpu", seed=0, nonfinite=True) -> UpdateJob:
    rule, group, coeffs = rule_case(case)
    step = RULE_CASES[case][2]
    gen = torch.Generator(device=device).manual_seed(seed)
    wdtype = torch.float32 if mode == "fp32" else torch.bfloat16
    w = torch.randn(M, N, generator=gen, device=device).to(wdtype)
    views = []
    for spec in rule.state_specs(group):
        v32 = torch.randn(M, N, generator=gen, device=device) * 0.01
        if spec.nonnegative:
            v32 = v32.abs() + 0.01  # keeps RMSprop-centered's square_avg - grad_avg^2 > 0
        if mode == "int8":
            q, s = precision.quantize(v32, spec.nonnegative)
            views.append(StateView(spec, q.contiguous(), s.contiguous()))
        elif mode.startswith("bf16"):
            views.append(StateView(spec, v32.bfloat16()))
        else:
            views.append(StateView(spec, v32))
    sr = mode in ("bf16-sr", "int8")
    return UpdateJob(weight=w, rule=rule, coeffs=coeffs, states=views, grad_sign=1.0,
                     stochastic_weight=sr, stochastic_state=sr,
                     key_weight=precision.stream_key(7, 1, step, 0),
                     key_states=tuple(precision.stream_key(7, 1, step, 1 + i) for i in range(3)),
                     nonfinite=torch.zeros((), dtype=torch.int64, device=device) if nonfinite else None)


def exact_inputs(BT, M, N, device="cpu", dtype=torch.bfloat16, seed=1):
    """Dyadic values: every product and partial sum is exact in fp32, so the gradient is bitwise
    the same whatever the summation order, and the two backends must agree to the rule's round-off."""
    gen = torch.Generator().manual_seed(seed)
    dy = (torch.randint(-16, 17, (BT, M), generator=gen) / 16.0).to(dtype).to(device)
    x = (torch.randint(-16, 17, (BT, N), generator=gen) / 32.0).to(dtype).to(device)
    return dy, x


def bf16_ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps; pairs equal up to fp32 round-off of the tensor's scale count as 0
    (near zero a cancellation such as lerp(m, g) with g ~ m can land on either side of zero)."""
    d = _bf16_steps(a, b)
    atol = 1e-6 * b.float().abs().max()
    return torch.where((a.float() - b.float()).abs() <= atol, torch.zeros_like(d), d)


def _bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    # map sign-magnitude to a monotone integer line
    ia = torch.where(ia < 0, -32768 - ia, ia)
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return (ia - ib).abs()


def assert_int8_close(va: StateView, vb: StateView, what: str):
    """Two int8 states that saw the same update but for fp32 round-off (a GEMM's reduction order, the
    rule's formulas). Scales are bf16 rounded up from absmax/qmax, so an absmax that moved by round-off
    can land on either side of a bf16 value: scales agree to one bf16 step (almost all exactly). Where
    a block's scales differ, all its codes shift with them (a v code near 255 by two), so codes are
    compared only in blocks of equal scales (at most one apart); values everywhere, within one step of
    the larger scale (each side within half a step of its own value; v's floor adds up to half a step)."""
    assert va.scale.dtype == vb.scale.dtype == precision.SCALE_DTYPE, f"{what} scale dtype"
    assert int(_bf16_steps(va.scale, vb.scale).max()) <= 1, f"{what}: scales beyond one bf16 step"
    same_scale = va.scale == vb.scale
    assert same_scale.float().mean().item() > 0.98, f"{what}: only {same_scale.float().mean():.3f} of scales equal"
    cols = va.data.shape[1]
    same_block = same_scale.repeat_interleave(64, dim=1)[:, :cols]
    dq = (va.data.to(torch.int16) - vb.data.to(torch.int16)).abs()
    nbad = int((dq[same_block] > 1).sum())
    if nbad:
        idx = ((dq > 1) & same_block).nonzero()[:5].tolist()
        info = [(i, j, int(va.data[i, j]), int(vb.data[i, j]), va.scale[i, j // 64].item()) for i, j in idx]
        raise AssertionError(f"{what}: {nbad} codes off by more than one under equal scales, e.g. {info}")
    codes_equal = (dq[same_block] == 0).float().mean().item()
    assert codes_equal > 0.98, f"{what}: only {codes_equal:.3f} of int8 codes equal under equal scales"
    da = precision.dequantize(va.data, va.scale)
    db = precision.dequantize(vb.data, vb.scale)
    step = torch.maximum(va.scale, vb.scale).float().repeat_interleave(64, dim=1)[:, :cols]
    slack = 1.5 if va.data.dtype == torch.uint8 else 1.0
    assert bool(((da - db).abs() <= step * slack * 1.0001 + 1e-30).all()), f"{what}: int8 beyond one step"


def assert_state_close(va: StateView, vb: StateView, mode: str, what: str):
    if va.quantized:
        assert_int8_close(va, vb, what)
    elif va.data.dtype == torch.bfloat16:
        d = bf16_ulp_diff(va.data, vb.data)
        assert int(d.max()) <= 1, f"{what}: bf16 state beyond 1 ULP"
        same = (va.data.view(torch.int16) == vb.data.view(torch.int16)).float().mean().item()
        assert same > 0.99, f"{what}: bf16 bits differ too often ({same:.4f} equal)"
    else:
        torch.testing.assert_close(va.data, vb.data, rtol=2e-6, atol=1e-9, msg=what)


def assert_weight_close(wa: torch.Tensor, wb: torch.Tensor, what: str, exact_frac=0.99):
    assert not torch.isnan(wa).any(), f"{what}: NaN written"
    if wa.dtype == torch.bfloat16:
        d = bf16_ulp_diff(wa, wb)
        assert int(d.max()) <= 1, f"{what}: bf16 weight beyond 1 ULP ({int(d.max())})"
        frac = (wa.view(torch.int16) == wb.view(torch.int16)).float().mean().item()
        assert frac >= exact_frac, f"{what}: only {frac:.4f} of bf16 weights bit-identical"
    else:
        torch.testing.assert_close(wa, wb, rtol=2e-6, atol=1e-7, msg=what)


def run_both(job: UpdateJob, dy, x, backend=None):
    from forge_optim.backends.triton_backend import TritonBackend

    ref = copy.deepcopy(job)
    (backend or TritonBackend()).update(job, dy, x)
    TorchBackend(block_rows=32).update(ref, dy, x)
    return job, ref


def compare(job, ref, mode, what):
    assert_weight_close(job.weight, ref.weight, what)
    for i, (va, vb) in enumerate(zip(job.states, ref.states)):
        assert_state_close(va, vb, mode, f"{what} state {va.spec.name}")
    if job.nonfinite is not None:
        assert int(job.nonfinite) == int(ref.nonfinite)


def prepared_vs_full(monkeypatch, state_dtype, device):
    """Train twice, with and without the prepared launch plans: the bits must be equal. The token count
    changes every step inside one tuning regime (5, 7, 16, 3, 9, 1: the plan's BT classes, 1 and multiples
    of 16, included), and the plans serve every step they are valid for."""

    import forge_optim
    from forge_optim import optim as optim_mod

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(48, 40, bias=False), torch.nn.Tanh(),
                                   torch.nn.Linear(40, 24, bias=False)).to(device, torch.bfloat16)

    if device == "cuda":  # one config: tuning would compile a dozen variants for a 40x48 weight
        from forge_optim.kernels.launch import GPU_TEST_CONFIG

        monkeypatch.setenv("FORGE_TRITON_CONFIG", GPU_TEST_CONFIG.env())
    results, fast_updates = [], []
    for use_plan in (True, False):
        if not use_plan:
            monkeypatch.setattr(optim_mod._FastPath, "make", classmethod(lambda cls, *a: None))
        model = build()
        opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.1, backend="triton", state_dtype=state_dtype)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        runs = 0
        for step, bt in enumerate((5, 7, 16, 3, 9, 1)):
            x = torch.randn(bt, 48, generator=torch.Generator().manual_seed(step)).to(device, torch.bfloat16)
            if step == 3:
                opt.param_groups[0]["maximize"] = True
            if step == 4:  # round trip: new state tensors, the plan must not write the old ones
                opt.load_state_dict(opt.state_dict())
            h = opt._handles["2"]
            valid = h.fast is not None and h.fast.valid(opt, h.param, opt.param_groups[0],
                                                        torch.empty(bt, 24, dtype=torch.bfloat16, device=device),
                                                        torch.empty(bt, 40, dtype=torch.bfloat16, device=device))
            runs += valid
            model(x).float().square().mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        fast_updates.append(runs)
        results.append([t.detach().clone() for t in model.parameters()]
                       + [v.clone() for st in opt.state.values() for v in st.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0])
    assert fast_updates[0] == 4 and fast_updates[1] == 0, fast_updates  # steps 1-3 and 5
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ======================================================================================= CPU
@pytest.mark.parametrize("case", list(RULE_CASES))
def test_rule_maps_zero_inputs_to_zero_states(case):
    """The int8 epilogue takes a block's absmax over all 64 columns of a tile's edge block, the padded
    ones included, without masking them (fused._store_state): out of range it loads W, the gradient
    and the states as zeros, and relies on every rule mapping (w=0, g=0, zero states) to zero states.
    A rule that breaks this (a state with an additive constant) would inflate the edge blocks' scales;
    test_rule_state_mode's 70x130 shapes would catch it against the torch backend."""
    rule, group, c = rule_case(case)
    z = torch.zeros(4, 64)
    specs = rule.state_specs(group)
    _, new = rule.update(z.clone(), z.clone(), [z.clone() for _ in specs], c)
    assert len(new) == len(specs)
    for spec, t in zip(specs, new):
        assert torch.equal(t, z), f"{case}: state {spec.name} is not 0 after a zero update"


if not INTERP:

    def test_interpreter_suite():
        """Run the interpreter half of this file in a child process with TRITON_INTERPRET=1."""
        env = dict(os.environ)
        env["TRITON_INTERPRET"] = "1"
        src = str(REPO / "src")
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(HERE)],
            cwd=str(REPO), env=env, capture_output=True, text=True, timeout=900)
        tail = (proc.stdout + proc.stderr)[-6000:]
        assert proc.returncode == 0, f"interpreter tests failed:\n{tail}"
        assert " passed" in proc.stdout, tail

    def test_interpreter_flag_not_leaked():
        """The subprocess trick must not leave TRITON_INTERPRET set for the rest of the suite."""
        assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


if INTERP:
    from forge_optim.backends.triton_backend import TritonBackend
    from forge_optim.kernels.launch import KernelConfig

    M0, N0, BT0 = 70, 130, 37

    @pytest.mark.parametrize("mode", STATE_MODES)
    @pytest.mark.parametrize("case", list(RULE_CASES))
    def test_rule_state_mode(case, mode):
        job = make_job(case, mode, M0, N0)
        dy, x = exact_inputs(BT0, M0, N0)
        job, ref = run_both(job, dy, x)
        compare(job, ref, mode, f"{case}/{mode}")

    @pytest.mark.parametrize("mode", ["fp32", "bf16-sr"])
    def test_random_inputs_fp32_dot(mode):
        """Non-dyadic fp32 inputs: the ieee fp32 dot, gradients equal up to summation order."""
        gen = torch.Generator().manual_seed(3)
        dy = torch.randn(BT0, M0, generator=gen)
        x = torch.randn(BT0, N0, generator=gen)
        job = make_job("AdamW", mode, M0, N0)
        job, ref = run_both(job, dy, x)
        if mode == "fp32":
            torch.testing.assert_close(job.weight, ref.weight, rtol=1e-5, atol=1e-6)
            for va, vb in zip(job.states, ref.states):
                torch.testing.assert_close(va.data, vb.data, rtol=1e-5, atol=1e-6)
        else:
            assert int(bf16_ulp_diff(job.weight, ref.weight).max()) <= 1

    @pytest.mark.parametrize("mode", ["fp32", "bf16-sr", "int8"])
    @pytest.mark.parametrize("case", ["AdamW", "Lion", "SGD-momentum"])
    def test_split_schedule_writes_the_fused_bits(monkeypatch, case, mode):
        """The split schedule (fp32 gradient chunks from a GEMM, then BT=0 launches) writes exactly the
        fused kernel's bits on exact (dyadic) inputs: the same update, the same stochastic-rounding bits
        (each chunk's keys shifted by its offset), the same non-finite count and guard. Three chunks of
        32, 32 and 6 rows, so chunk edges cut through tiles and int8 scale rows."""
        from dataclasses import replace

        from forge_optim.kernels import launch as launch_mod

        monkeypatch.setattr(launch_mod, "split_rows", lambda M, N, mb: 32)
        chunks = []
        wgrad = launch_mod._wgrad_fp32
        monkeypatch.setattr(launch_mod, "_wgrad_fp32", lambda d, xx, out: (chunks.append(out.shape[0]),
                                                                             wgrad(d, xx, out)))
        dy, x = exact_inputs(BT0, M0, N0)
        dy[5, 9] = float("nan")  # weight row 9: a non-finite gradient row, counted and not applied
        a = make_job(case, mode, M0, N0)
        b = copy.deepcopy(a)
        w0 = a.weight.clone()
        fused_cfg = launch_mod.INTERPRET_CONFIG
        TritonBackend(config=fused_cfg).update(a, dy, x)
        TritonBackend(config=replace(fused_cfg, split_mb=1)).update(b, dy, x)
        assert torch.equal(a.weight, b.weight)
        for va, vb in zip(a.states, b.states):
            assert torch.equal(va.data, vb.data), va.spec.name
            if va.quantized:
                assert torch.equal(va.scale, vb.scale), va.spec.name
        assert chunks == [32, 32, 6]
        assert int(a.nonfinite) == int(b.nonfinite) == N0
        assert torch.equal(b.weight[9], w0[9]) and not torch.equal(b.weight[10], w0[10])

    @pytest.mark.parametrize("key", [None, 0xFFFFFFF0, (1 << 31) + 5])
    def test_sr_bits_identical(key):
        """Same gradient, same fp32 value: the kernel draws exactly the torch backend's SR bits
        (also for keys >= 2**31, where offset + key wraps around 2**32)."""
        job = make_job("SGD", "bf16-sr", M0, N0)
        if key is not None:
            job.key_weight = key
        dy, x = exact_inputs(BT0, M0, N0)
        job, ref = run_both(job, dy, x)
        assert torch.equal(job.weight.view(torch.int16), ref.weight.view(torch.int16))
        # and stochastic rounding actually did something different from RNE
        rne = make_job("SGD", "bf16-rne", M0, N0)
        TritonBackend().update(rne, dy, x)
        assert not torch.equal(rne.weight, job.weight)

    @pytest.mark.parametrize("cfg", [
        KernelConfig(BM=32, BN=128, BK=16, num_warps=4, num_stages=1, group_size=3, progs_per_sm=2,
                     epi_split=2, use_tma=False),
        KernelConfig(BM=64, BN=64, BK=16, num_warps=4, num_stages=1, group_size=2, progs_per_sm=2,
                     epi_split=4, use_tma=False),
        KernelConfig(BM=64, BN=128, BK=32, num_warps=4, num_stages=1, group_size=1, progs_per_sm=2,
                     epi_split=8, use_tma=False),
        KernelConfig(BM=64, BN=64, BK=32, num_warps=4, num_stages=1, group_size=1, progs_per_sm=1,
                     epi_split=1, use_tma=False),
        # the next slices' loads issued before the current slice's stores (epi_lookahead)
        KernelConfig(BM=32, BN=128, BK=16, num_warps=4, num_stages=1, group_size=3, progs_per_sm=2,
                     epi_split=2, use_tma=False, epi_lookahead=1),
        KernelConfig(BM=64, BN=64, BK=16, num_warps=4, num_stages=1, group_size=2, progs_per_sm=2,
                     epi_split=4, use_tma=False, epi_lookahead=1),
        KernelConfig(BM=64, BN=128, BK=32, num_warps=4, num_stages=1, group_size=1, progs_per_sm=2,
                     epi_split=8, use_tma=False, epi_lookahead=2),
    ])
    @pytest.mark.parametrize("mode", ["fp32", "int8"])
    def test_other_tilings(cfg, mode):
        """Epilogue split in two, four or eight row slices (their loads issued in order or ahead), a
        single program, other swizzles: same result."""
        job = make_job("AdamW", mode, 50, 200)
        dy, x = exact_inputs(13, 50, 200)
        job, ref = run_both(job, dy, x, backend=TritonBackend(config=cfg))
        compare(job, ref, mode, f"tiling/{mode}")

    @pytest.mark.parametrize("shape", [(1, 64, 1), (33, 65, 2), (17, 3, 5), (40, 70, 0)])
    def test_small_odd_shapes(shape):
        M, N, BT = shape
        job = make_job("AdamW", "int8", M, N)
        dy, x = exact_inputs(BT, M, N)
        job, ref = run_both(job, dy, x)
        compare(job, ref, "int8", f"shape {shape}")

    @pytest.mark.parametrize("mode", ["fp32", "bf16-sr", "int8"])
    @pytest.mark.parametrize("gdtype", [torch.bfloat16, torch.float32], ids=["bf16-grad", "fp32-grad"])
    def test_update_from_grad_reads_the_gradient_in_place(mode, gdtype, monkeypatch):
        """An unfused parameter's fp32 or bf16 gradient enters the BT=0 launch as its buffer, uncopied,
        in one launch: the same update as the torch backend (stochastic-rounding bits included:
        both hash each element's offset in the whole weight), non-finite coordinates skipped."""
        import forge_optim.backends.triton_backend as TB

        job = make_job("AdamW", mode, M0, N0)
        grad = (torch.randn(M0, N0, generator=torch.Generator().manual_seed(6)) * 1e-2).to(gdtype)
        grad[3, 7] = float("nan")
        ref = copy.deepcopy(job)
        calls, real = [], TB.launch
        monkeypatch.setattr(TB, "launch", lambda **kw: (calls.append(kw["grad_buffer"]), real(**kw))[1])
        TritonBackend().update_from_grad(job, grad)
        assert len(calls) == 1 and calls[0] is grad  # one launch, the gradient itself as the buffer
        TorchBackend(block_rows=32).update_from_grad(ref, grad)
        compare(job, ref, mode, f"from-grad/{mode}/{gdtype}")
        assert int(job.nonfinite) == 1

    def test_accumulate_then_final():
        """accumulate: buffer += dY^T X; final: the update on (buffer + tile), as the torch backend."""
        dy1, x1 = exact_inputs(BT0, M0, N0, seed=5)
        dy2, x2 = exact_inputs(20, M0, N0, seed=6)
        buf = torch.randn(M0, N0, generator=torch.Generator().manual_seed(9))
        buf_ref = buf.clone()
        TritonBackend().accumulate(buf, dy1, x1)
        TorchBackend().accumulate(buf_ref, dy1, x1)
        torch.testing.assert_close(buf, buf_ref, rtol=1e-6, atol=1e-6)
        for mode in ("fp32", "bf16-sr", "int8"):
            job = make_job("AdamW", mode, M0, N0)
            job.grad_buffer = buf.clone()
            job, ref = run_both(job, dy2, x2)
            compare(job, ref, mode, f"final/{mode}")
            assert torch.equal(job.grad_buffer, buf)  # the final step only reads the buffer

    def test_accumulate_random_fp32():
        gen = torch.Generator().manual_seed(4)
        dy, x = torch.randn(BT0, M0, generator=gen), torch.randn(BT0, N0, generator=gen)
        buf = torch.zeros(M0, N0)
        TritonBackend().accumulate(buf, dy, x)
        torch.testing.assert_close(buf, dy.t() @ x, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("mode", ["fp32", "bf16-sr", "int8"])
    def test_nonfinite_guard(mode):
        dy, x = exact_inputs(BT0, M0, N0)
        dy = dy.clone()
        x = x.clone()
        dy[3, 7] = float("nan")  # row 7 of G is NaN
        x[5, 11] = float("inf")  # column 11 of G is +-Inf or NaN
        x[6, 100] = float("-inf")
        job = make_job("AdamW", mode, M0, N0)
        w0 = job.weight.clone()
        s0 = [v.data.clone() for v in job.states]
        job, ref = run_both(job, dy, x)
        expected = N0 + 2 * M0 - 2
        assert int(job.nonfinite) == expected == int(ref.nonfinite)
        assert torch.isfinite(job.weight.float()).all()
        for v in job.states:
            assert torch.isfinite(v.data.float()).all()
        assert torch.equal(job.weight[7], w0[7]) and torch.equal(job.weight[:, 11], w0[:, 11])
        if mode != "int8":  # int8 rows re-quantize with their block, as the torch backend does
            for v, old in zip(job.states, s0):
                assert torch.equal(v.data[7], old[7])
        compare(job, ref, mode, f"nonfinite/{mode}")

    def test_nonfinite_count_when_a_tiles_finite_sum_overflows():
        """The per-tile count first tests the tile's sum (one add per element); finite entries whose sum
        overflows fail that test, and the exact count that follows must find none."""
        dy, x = torch.zeros(BT0, M0), torch.zeros(BT0, N0)
        dy[0, :], x[0, :] = 2.0**60, 2.0**58  # G = 2**118 everywhere: finite, a tile's sum is not
        job = make_job("SGD", "fp32", M0, N0)
        w0 = job.weight.clone()
        job, ref = run_both(job, dy, x)
        assert int(job.nonfinite) == 0 == int(ref.nonfinite)
        assert not torch.equal(job.weight, w0)  # the update was applied
        compare(job, ref, "fp32", "overflowing tile sum")

    def test_zero_denominator_with_eps_zero_keeps_weight_finite():
        """Rules divide with fast_div, whose denominator is raised to FLT_MIN: with eps=0, zero moments
        and a zero gradient, AdamW's m / (sqrt(v) + eps) is 0 / 0, which torch.optim turns into a NaN
        weight; the Triton kernel leaves the weight decayed and finite (_triton.FLT_MIN)."""
        from forge_optim.backends.triton_backend import TritonBackend

        job = make_job("AdamW", "fp32", M0, N0)
        group = dict(RULES["AdamW"].defaults, lr=1e-2, weight_decay=0.1, eps=0.0)
        job.coeffs = RULES["AdamW"].padded(RULES["AdamW"].coefficients(group, {}, 1))
        for v in job.states:
            v.data.zero_()
        w0 = job.weight.clone()
        TritonBackend().update(job, torch.zeros(BT0, M0), torch.zeros(BT0, N0))
        assert torch.isfinite(job.weight).all()
        torch.testing.assert_close(job.weight, w0 * (1 - 1e-2 * 0.1), rtol=1e-6, atol=0)

    def test_bf16_state_sr_draws_the_high_half_and_is_unbiased():
        """A bf16 momentum buffer (slot 0) that grows by a quarter ULP per step: its stores round with
        the high half of the weight's hash. The kernel's bits equal the torch backend's every step, and
        the mean moves by a quarter ULP per step (unbiased)."""
        from forge_optim.backends.triton_backend import TritonBackend
        from forge_optim.rules.base import StateSpec

        M, N, BT, steps = 64, 64, 16, 40
        ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
        rule = RULES["SGD"]
        group = dict(rule.defaults, lr=0.0, momentum=1.0)  # buf += g, W unchanged
        dy = torch.full((BT, M), ulp / 4 / BT)  # G = ulp / 4 everywhere (exact)
        x = torch.ones(BT, N)
        spec = StateSpec("momentum_buffer", 0)
        bufs = [torch.ones(M, N, dtype=torch.bfloat16) for _ in range(2)]
        w = [torch.ones(M, N, dtype=torch.bfloat16) for _ in range(2)]
        for step in range(2, steps + 2):
            for i, be in enumerate((TritonBackend(), TorchBackend(block_rows=32))):
                job = UpdateJob(weight=w[i], rule=rule, coeffs=rule.padded(rule.coefficients(group, {}, step)),
                                states=[StateView(spec, bufs[i])], stochastic_weight=True, stochastic_state=True,
                                key_weight=precision.stream_key(0, 0, step, precision.SITE_WEIGHT),
                                key_states=(precision.stream_key(0, 0, step, precision.SITE_STATE0),))
                be.update(job, dy, x)
            assert torch.equal(bufs[0], bufs[1]), step
        assert torch.equal(w[0], torch.ones_like(w[0]))
        mean = ((bufs[0].float() - 1.0) / ulp).double().mean().item()
        assert abs(mean - steps / 4) < 0.3, mean  # per-element std ~2.7 ULP, mean of 4096: ~0.04

    def test_bf16_second_moment_sr_draws_the_mixed_draw_and_is_unbiased():
        """Slot 1 (exp_avg_sq) rounds with the third draw of the weight's hash: the kernel's bits equal the
        torch backend's every step, and 3/4 of the stores of a value three quarters of a ULP up are
        rounded up (64x64 x 40 steps: std of the fraction ~0.002)."""
        from forge_optim.backends.triton_backend import TritonBackend

        frac = _second_moment_sr_fraction([TritonBackend(), TorchBackend(block_rows=32)], 64, 64, 16, 40)
        assert abs(frac[0] - 0.75) < 0.01, frac

    def test_nonfinite_counter_optional():
        dy, x = exact_inputs(BT0, M0, N0)
        dy = dy.clone()
        dy[0, 0] = float("nan")
        job = make_job("AdamW", "fp32", M0, N0, nonfinite=False)
        w0 = job.weight.clone()
        TritonBackend().update(job, dy, x)
        assert torch.equal(job.weight[0], w0[0])
        assert not torch.equal(job.weight[1], w0[1])

    @pytest.mark.parametrize("mode", ["fp32", "bf16-sr"])
    def test_maximize(mode):
        job = make_job("AdamW", mode, M0, N0)
        job.grad_sign = -1.0
        dy, x = exact_inputs(BT0, M0, N0)
        job, ref = run_both(job, dy, x)
        compare(job, ref, mode, f"maximize/{mode}")
        # maximize on g equals minimize on -g
        neg = make_job("AdamW", mode, M0, N0)
        TritonBackend().update(neg, -dy, x)
        assert torch.equal(neg.weight, job.weight)

    def test_input_dtypes_and_3d():
        """fp32 dy with bf16 x (mixed -> fp32), and [B, T, D] inputs reshaped to 2-D."""
        dy, x = exact_inputs(BT0 - 1, M0, N0)
        job = make_job("AdamW", "fp32", M0, N0)
        ref = copy.deepcopy(job)
        TritonBackend().update(job, dy.float().view(4, 9, M0), x.view(4, 9, N0))
        TorchBackend().update(ref, dy, x)
        compare(job, ref, "fp32", "mixed")

    @pytest.mark.parametrize("mode", ["fp32", "int8"])
    def test_update_from_grad_in_chunks(mode, monkeypatch):
        """Unfused parameters: the gradient enters a BT=0 launch as the buffer, chunk by chunk."""
        from forge_optim.backends import base as backend_base

        monkeypatch.setattr(backend_base, "CHUNK_ELEMENTS", 3 * N0)  # several chunks, a ragged last one
        job = make_job("AdamW", mode, M0, N0)
        ref = copy.deepcopy(job)
        grad = torch.randn(M0, N0, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        TritonBackend().update_from_grad(job, grad)
        TorchBackend().update_from_grad(ref, grad)
        compare(job, ref, mode, "from-grad")

    @pytest.mark.parametrize("mode", ["bf16-sr", "int8"])
    def test_tuning_launch_uses_bounded_clones(mode):
        """The tuner's launches run on clones of the first rows only and never touch live tensors;
        on those rows they compute what the real launch computes."""
        from forge_optim.backends.triton_backend import launch_kwargs, tuning_launch
        from forge_optim.kernels.launch import INTERPRET_CONFIG

        job = make_job("AdamW", mode, M0, N0)
        live = copy.deepcopy(job)
        dy, x = exact_inputs(BT0, M0, N0)
        kwargs = launch_kwargs(job, dy.contiguous(), x.contiguous())

        tuning_launch(kwargs, INTERPRET_CONFIG, max_rows=32)()
        torch.testing.assert_close(job.weight, live.weight, rtol=0, atol=0)  # live weight untouched
        TritonBackend().update(job, dy, x)  # the real launch, all rows
        ref = copy.deepcopy(live)
        ref.weight = ref.weight[:32].clone()
        for v in ref.states:
            v.data = v.data[:32].clone()
            if v.scale is not None:
                v.scale = v.scale[:32].clone()
        TritonBackend().update(ref, dy[:, :32], x)
        torch.testing.assert_close(job.weight[:32], ref.weight, rtol=0, atol=0)

    def test_optimizer_with_triton_backend_on_cpu_tensors():
        """backend='triton' is accepted without CUDA under TRITON_INTERPRET=1 and matches torch.optim."""
        import forge_optim

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24, bias=False))
        ref_model = copy.deepcopy(model)
        opt = forge_optim.AdamW(model, lr=1e-2, backend="triton")
        ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
        assert opt._backend_for(model[0].weight).name == "triton"
        for _ in range(3):
            x = torch.randn(5, 48)
            for m, o in ((model, opt), (ref_model, ref)):
                m(x).square().mean().backward()
                o.step()
                o.zero_grad()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert ((p - q).abs().max() / q.abs().max()).item() <= 1e-5

    @pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
    def test_prepared_launch_matches_full_path(monkeypatch, state_dtype):
        """From the second update on, a fused weight is updated through its prepared launch plan
        (optim._FastPath): the same bits as the full path (job, checks, tuner, argument packing) every
        step, through an LR change, a maximize flip and a load_state_dict (which must invalidate it)."""
        prepared_vs_full(monkeypatch, state_dtype, "cpu")

    def test_plan_relaunch_passes_what_launch_would(monkeypatch):
        """LaunchPlan's relaunch (GPU only) patches dY, X, BT, coefficients, sign and keys into the
        arguments of its first launch: they must be exactly what a fresh launch() would pass, also for
        another token count of the same tuning regime. Run on the CPU with the GPU launch calls recorded
        instead of executed."""
        from forge_optim.backends import triton_backend as tb
        from forge_optim.kernels import launch as L

        job = make_job("AdamW", "bf16-sr", M0, N0)
        be = TritonBackend()
        dy0, x0 = exact_inputs(BT0, M0, N0)
        plan = be.plan(job, dy0, x0)
        assert plan is not None
        calls = []
        compiled = object()

        def fake_direct(kernel, grid0, args, meta, options, **kw):
            calls.append((grid0, list(args), meta))
            return compiled

        monkeypatch.setattr(L, "_INTERPRET", False)
        monkeypatch.setattr(tb, "_INTERPRET", False)
        monkeypatch.setattr(L, "FAST_LAUNCH", True)
        monkeypatch.setattr(L, "direct_launch", fake_direct)
        monkeypatch.setattr(L, "hooks_active", lambda: False)
        monkeypatch.setattr(L, "_sm_count", lambda device: 4)
        monkeypatch.setattr(L, "_tma_ok", lambda dy, x: False)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(L, "relaunch", lambda c, nprogs, args, meta, device: calls.append((nprogs, list(args), meta)))

        def step_args(step):
            rule = RULES["AdamW"]
            coeffs = rule.padded(rule.coefficients(dict(rule.defaults), {}, step))
            return coeffs, precision.stream_key(7, 1, step, 0), tuple(precision.stream_key(7, 1, step, 1 + i)
                                                                       for i in range(2))

        dy1, x1 = exact_inputs(BT0 + 2, M0, N0)  # another token count, same regime and specialization class
        assert plan.matches(dy1, x1) and (BT0 + 2) % 16 and BT0 % 16 and BT0 != 1
        c, kw, ks = step_args(1)
        plan.run(dy0, x0, c, 1.0, kw, ks)  # first: through launch(), recorded by fake_direct
        c, kw, ks = step_args(2)
        plan.run(dy1, x1, c, -1.0, kw, ks)  # second: the relaunch
        assert len(calls) == 2 and len(plan.by_class) == 1
        L.launch(config=plan.cfg, **dict(plan.kwargs, dy=dy1, x=x1, coeffs=c, grad_sign=-1.0, key_weight=kw,
                                         key_states=ks + (0,)))
        (n_re, re_args, re_meta), (n_ref, ref_args, ref_meta) = calls[1], calls[2]
        assert n_re == n_ref and re_meta == ref_meta and len(re_args) == len(ref_args)
        for i, (a, b) in enumerate(zip(re_args, ref_args)):
            if isinstance(b, torch.Tensor):
                assert a is b, i
            else:
                assert type(a) is type(b) and a == b, (i, a, b)

    def _fake_compiled(args, meta, specialized=()):
        """A stand-in for Triton's CompiledKernel of the fused kernel with these arguments: its source's
        signature as Triton's runtime writes it (``specialized``: runtime args Triton turned into
        constexprs, as it does with an int equal to 1)."""
        from types import SimpleNamespace

        from forge_optim.kernels import fused

        names = fused.forge_fused_kernel.arg_names
        sig = {}
        for i, n in enumerate(names):
            if i >= len(args) or i in specialized:
                sig[n] = "constexpr"
            elif isinstance(args[i], torch.Tensor):
                sig[n] = "*bf16" if args[i].dtype == torch.bfloat16 else "*fp32"
            else:
                sig[n] = "fp32" if isinstance(args[i], float) else "i32"
        md = SimpleNamespace(num_ctas=1, launch_pdl=False, launch_cooperative_grid=False, tensordesc_meta=[],
                             profile_scratch_size=0, global_scratch_size=256, global_scratch_align=128,
                             num_warps=4, shared=49152)
        src = SimpleNamespace(fn=SimpleNamespace(arg_names=names), signature=sig,
                              constants={(i,): None for i in specialized})
        return SimpleNamespace(function=0xF00, metadata=md, src=src)

    def test_plan_static_launch_passes_what_launch_would(monkeypatch):
        """With torch's C++ launcher the prepared plan launches its kernel with plain integers for the
        pointers: the arguments must be, position by position, what a fresh launch() passes (tensors
        as their addresses), followed by the TMA scratch address and a null profiler scratch; the
        grid, warps and shared memory are the compiled kernel's. An int Triton specialized to a
        constant is left out, as Triton's own launcher leaves it out. FORGE_STATIC_LAUNCH off (or
        no launcher in torch) goes back to Triton's launcher."""
        from types import SimpleNamespace

        from forge_optim.backends import triton_backend as tb
        from forge_optim.kernels import launch as L

        job = make_job("AdamW", "bf16-sr", M0, N0)
        dy0, x0 = exact_inputs(BT0, M0, N0)
        plan = TritonBackend().plan(job, dy0, x0)
        direct_calls, relaunches, static_calls = [], [], []
        made = {}

        def fake_direct(kernel, grid0, args, meta, options, **kw):
            direct_calls.append((grid0, list(args), meta))
            made.setdefault("compiled", _fake_compiled(args, meta, specialized=(14,)))  # N == 1 style
            return made["compiled"]

        class Launcher:
            @staticmethod
            def _launch_kernel(*a):
                static_calls.append(a)

        scratch = SimpleNamespace(data_ptr=lambda: 0xABC00)
        monkeypatch.setattr(L, "_INTERPRET", False)
        monkeypatch.setattr(tb, "_INTERPRET", False)
        monkeypatch.setattr(L, "FAST_LAUNCH", True)
        monkeypatch.setattr(L, "STATIC_LAUNCH", True)
        monkeypatch.setattr(L, "direct_launch", fake_direct)
        monkeypatch.setattr(L, "hooks_active", lambda: False)
        monkeypatch.setattr(L, "_sm_count", lambda device: 4)
        monkeypatch.setattr(L, "_tma_ok", lambda dy, x: False)
        asked = []
        monkeypatch.setattr(L, "_scratch", lambda size, align, stream: asked.append((size, align, stream)) or scratch)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch._C, "_StaticCudaLauncher", Launcher, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
        monkeypatch.setattr(L, "relaunch", lambda c, nprogs, args, meta, device: relaunches.append(list(args)))

        rule = RULES["AdamW"]
        c1 = rule.padded(rule.coefficients(dict(rule.defaults), {}, 1))
        c2 = rule.padded(rule.coefficients(dict(rule.defaults), {}, 2))
        plan.run(dy0, x0, c1, 1.0, 11, (12, 13))  # first: launch(), which records the static launch
        assert static_calls == [] and plan.by_class[(True, True, 0, False, False)][4] is not None
        dy1, x1 = exact_inputs(BT0 + 2, M0, N0, seed=4)  # another token count of the same class: BT patched
        plan.run(dy1, x1, c2, -1.0, -5, (6, 7))  # second: the static launch
        L.launch(config=plan.cfg, **dict(plan.kwargs, dy=dy1, x=x1, coeffs=c2, grad_sign=-1.0, key_weight=-5,
                                         key_states=(6, 7, 0)))  # what Triton's path would be handed
        assert len(static_calls) == 1 and relaunches == []
        function, gx, gy, gz, warps, shared, tys, args, stream = static_calls[0]
        ref_grid, ref_args, _ = direct_calls[-1]
        assert (function, gx, gy, gz, warps, shared, stream) == (0xF00, ref_grid, 1, 1, 4, 49152, 77)
        kept = [a for i, a in enumerate(ref_args) if i != 14]
        assert len(tys) == len(args) == len(kept) + 2 and tys.endswith("OO")
        for i, (a, b) in enumerate(zip(args, kept)):
            if isinstance(b, torch.Tensor):
                assert tys[i] == "O" and a == b.data_ptr(), i
            else:
                assert tys[i] in "if" and type(a) is type(b) and a == b, (i, a, b)
        assert args[-2:] == (0xABC00, 0) and asked == [(256 * ref_grid, 128, 77)]  # per program, on this stream

        monkeypatch.setattr(L, "STATIC_LAUNCH", False)
        plan.run(dy1, x1, c2, -1.0, -5, (6, 7))
        assert len(static_calls) == 1 and len(relaunches) == 1
        assert relaunches[0][L.ARG_BT] == BT0 + 2

        # BT = 48 and BT = 1 are the plan's other classes (what Triton would specialize an int on; BT is
        # do_not_specialize, so a safeguard): each gets its own record through launch()
        monkeypatch.setattr(L, "STATIC_LAUNCH", True)
        for bt in (48, 1):
            dyb, xb = exact_inputs(bt, M0, N0, seed=5)
            plan.run(dyb, xb, c2, 1.0, 3, (4, 5))
        assert len(static_calls) == 1 and len(plan.by_class) == 3
        assert set(plan.by_class) == {(True, True, 0, False, False), (True, True, 0, False, True),
                                      (True, True, 0, True, False)}

    def test_static_launch_refused_for_what_torch_launcher_cannot_do():
        """Kernels needing clusters, programmatic dependent launch, host-side TMA descriptors or a
        profiler scratch, an argument type the table does not know, or from a Triton whose kernels lack
        either scratch parameter, get no static layout."""
        from forge_optim.kernels import launch as L

        dy, x = exact_inputs(BT0, M0, N0)
        args = (dy, x) + (dy,) * 9 + (BT0, M0, N0, 1, 4) + (0.5,) * 9 + (1, 2, 3, 4)
        assert L.static_layout(_fake_compiled(args, ())) is not None
        for field, value in (("num_ctas", 2), ("launch_pdl", True), ("tensordesc_meta", [{"x": 1}]),
                             ("profile_scratch_size", 64)):
            k = _fake_compiled(args, ())
            setattr(k.metadata, field, value)
            assert L.static_layout(k) is None, field
        for field in ("global_scratch_size", "profile_scratch_size"):  # a Triton without the two scratch parameters
            k = _fake_compiled(args, ())
            delattr(k.metadata, field)
            assert L.static_layout(k) is None, field
        k = _fake_compiled(args, ())
        k.src.signature["dy_ptr"] = "nvTmaDesc"
        assert L.static_layout(k) is None
        names = L.fused.forge_fused_kernel.arg_names
        assert (names[L.ARG_DY], names[L.ARG_X], names[L.ARG_BT], names[L.ARG_COEFFS], names[L.ARG_GRAD_SIGN],
                names[L.ARG_KEYS]) == ("dy_ptr", "x_ptr", "BT", "c0", "grad_sign", "key_w")

    def test_bf16_accumulation_buffer_through_the_kernel():
        """The kernel's accumulate mode on a bf16 buffer (fp32 sum, rounded to nearest) and the final
        update reading it: see the helper."""
        from helpers import bf16_accumulation_matches_reference

        bf16_accumulation_matches_reference("triton")

    def test_unbatched_input_and_empty_batch_through_the_kernel():
        """The Triton backend (BT = 1 from an unbatched input, BT = 0 from an empty batch) steps as
        torch.optim.AdamW does."""
        from helpers import unbatched_and_empty_batches_match_torch

        unbatched_and_empty_batches_match_torch("triton")

    def test_sparse_embedding_through_the_kernel():
        """An embedding's row-sparse gradient, densified chunk by chunk into the BT=0 launch, equals
        torch.optim.AdamW on the dense gradient."""
        import forge_optim

        from forge_optim.patch import ForgeEmbedding

        torch.manual_seed(0)
        emb = torch.nn.Embedding(70, 48)
        ref = copy.deepcopy(emb)
        opt = forge_optim.AdamW(emb, lr=1e-2, weight_decay=0.1, backend="triton")
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        assert isinstance(emb, ForgeEmbedding)
        c = torch.randn(9, 48)
        for step in range(3):
            ids = torch.randint(0, 70, (9,), generator=torch.Generator().manual_seed(step))
            for m, o in ((emb, opt), (ref, ref_opt)):
                (m(ids) * c).sum().backward()
                assert m.weight.grad.is_sparse == (m is emb)
                o.step()
                o.zero_grad()
        assert ((emb.weight - ref.weight).abs().max() / ref.weight.abs().max()).item() <= 1e-6

    def test_fallback_noncontiguous_weight():
        job = make_job("AdamW", "fp32", N0, M0)
        job.weight = job.weight.t()  # [M0, N0] view, not contiguous
        for v in job.states:
            v.data = v.data.t()
        dy, x = exact_inputs(BT0, M0, N0)
        be = TritonBackend()
        ref = copy.deepcopy(job)
        be.update(job, dy, x)
        TorchBackend().update(ref, dy, x)
        assert be.fallbacks == 1
        torch.testing.assert_close(job.weight, ref.weight)

    def test_two_steps_against_torch_optim():
        """fp32 W and states over two steps equal torch.optim.AdamW on the same gradient."""
        M, N, BT = 40, 70, 11
        gen = torch.Generator().manual_seed(2)
        w = torch.randn(M, N, generator=gen)
        p = torch.nn.Parameter(w.clone())
        opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, foreach=False)
        rule = RULES["AdamW"]
        group = dict(rule.defaults, lr=1e-2, weight_decay=0.1)
        m = StateView(rule.state_specs(group)[0], torch.zeros(M, N))
        v = StateView(rule.state_specs(group)[1], torch.zeros(M, N))
        be = TritonBackend()
        for step in (1, 2):
            dy, x = torch.randn(BT, M, generator=gen), torch.randn(BT, N, generator=gen)
            job = UpdateJob(weight=w, rule=rule, coeffs=rule.padded(rule.coefficients(group, {}, step)),
                            states=[m, v])
            be.update(job, dy, x)
            p.grad = (dy.double().t() @ x.double()).float()
            opt.step()
        torch.testing.assert_close(w, p.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m.data, opt.state[p]["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(v.data, opt.state[p]["exp_avg_sq"], rtol=1e-5, atol=1e-9)


# ======================================================================================= GPU
def _second_moment_sr_fraction(backends, M, N, BT, steps, device="cpu"):
    """AdamW with bf16 states, G = 0, lr = 0, beta2 = 1 - 2**-10 and exp_avg_sq reset to 1.0 before each
    step: the exact new v is 1 - 2**-10, three quarters of a bf16 ULP (2**-8 below 1) above 1 - 2**-8, so
    an unbiased stochastic rounding of slot 1 (the hash's mixed draw) stores 1.0 with probability 3/4
    and 1 - 2**-8 otherwise. Runs each backend on its own copy with the same keys; returns, per backend,
    the fraction of stores that were 1.0, and checks every step that the backends' bits agree, that no
    other value was stored and that W kept its bits."""
    rule = RULES["AdamW"]
    group = dict(rule.defaults, lr=0.0, betas=(0.9, 1.0 - 2.0**-10), weight_decay=0.0)
    specs = rule.state_specs(group)
    dy = torch.zeros(BT, M, device=device, dtype=torch.bfloat16)
    x = torch.ones(BT, N, device=device, dtype=torch.bfloat16)
    w0 = torch.randn(M, N, device=device).bfloat16()
    ws = [w0.clone() for _ in backends]
    ms = [torch.zeros(M, N, device=device, dtype=torch.bfloat16) for _ in backends]
    vs = [torch.ones(M, N, device=device, dtype=torch.bfloat16) for _ in backends]
    ones = [0 for _ in backends]
    low = torch.tensor(1.0 - 2.0**-8, dtype=torch.bfloat16, device=device)
    for step in range(1, steps + 1):
        for i, be in enumerate(backends):
            vs[i].fill_(1.0)
            job = UpdateJob(weight=ws[i], rule=rule, coeffs=rule.padded(rule.coefficients(group, {}, step)),
                            states=[StateView(specs[0], ms[i]), StateView(specs[1], vs[i])],
                            stochastic_weight=True, stochastic_state=True,
                            key_weight=precision.stream_key(3, 0, step, precision.SITE_WEIGHT),
                            key_states=(precision.stream_key(3, 0, step, precision.SITE_STATE0),
                                        precision.stream_key(3, 0, step, precision.SITE_STATE0 + 1)))
            be.update(job, dy, x)
            assert bool(((vs[i] == 1.0) | (vs[i] == low)).all()), step
            ones[i] += int((vs[i] == 1.0).sum())
        for i in range(1, len(backends)):
            assert torch.equal(vs[i], vs[0]), step
    for w in ws:
        assert torch.equal(w, w0)
    return [n / (steps * M * N) for n in ones]


GPU_SHAPES = [(4096, 4096), (14336, 4096), (128256, 4096)]
GPU_BTS = [512, 4096]


def test_explore_configs_only_on_request(monkeypatch):
    from forge_optim.kernels.launch import EXPLORE_SMALL_BT_CONFIGS, SMALL_BT_CONFIGS, candidate_configs

    monkeypatch.delenv("FORGE_TUNE_EXPLORE", raising=False)
    assert candidate_configs(512) == SMALL_BT_CONFIGS
    monkeypatch.setenv("FORGE_TUNE_EXPLORE", "1")
    assert candidate_configs(512) == SMALL_BT_CONFIGS + EXPLORE_SMALL_BT_CONFIGS
    from forge_optim.kernels.launch import LARGE_BT_CONFIGS

    assert candidate_configs(8192) == LARGE_BT_CONFIGS  # large BT unchanged
    assert not any(c.prefetch for c in LARGE_BT_CONFIGS)  # a trap at BT=8192 (launch.py, measured)
    assert all(c.BN % 64 == 0 for c in EXPLORE_SMALL_BT_CONFIGS)


def test_config_env_round_trips_every_field():
    """FORGE_TRITON_CONFIG (KernelConfig.env, parsed by launch._parse_cfg) carries every field, booleans
    included, and the short name marks the evict-first policy."""
    from dataclasses import fields

    from forge_optim.kernels.launch import KernelConfig, _parse_cfg

    cfg = KernelConfig(64, 128, 64, 4, 3, 8, 3, 8, maxnreg=168, prefetch=True, epi_lookahead=1, evict_first=True)
    assert KernelConfig(**_parse_cfg(cfg.env())) == cfg
    assert {f.name for f in fields(KernelConfig)} == set(_parse_cfg(cfg.env()))
    assert cfg.short().endswith(" ev") and " ev" not in KernelConfig().short()


def test_load_fence_defaults_by_tile_and_twins_are_named():
    """KernelConfig.load_fence: -1 takes the tile's default (on from 128x256), 0 / 1 force it; a forced value
    equal to the default is the same config (no duplicate candidates), a real twin is marked fc0 / fc1 in its
    short name and survives FORGE_TRITON_CONFIG; anything else is refused by name."""
    from forge_optim.kernels.launch import KernelConfig, _parse_cfg

    small, large = KernelConfig(64, 128), KernelConfig(128, 256, num_warps=16)
    assert (small.fence, large.fence) == (False, True)
    assert KernelConfig(64, 128, load_fence=0) == small and KernelConfig(128, 256, num_warps=16, load_fence=1) == large
    on, off = KernelConfig(64, 128, load_fence=1), KernelConfig(128, 256, num_warps=16, load_fence=0)
    assert (on.fence, off.fence) == (True, False)
    assert on.short().endswith(" fc1") and off.short().endswith(" fc0") and " fc" not in small.short() + large.short()
    for cfg in (small, on, off):
        assert KernelConfig(**_parse_cfg(cfg.env())) == cfg
    with pytest.raises(ValueError, match="load_fence"):
        KernelConfig(load_fence=2)


def test_split_rows_chunks_of_about_split_mb():
    """Chunks of the split schedule: about split_mb MiB of fp32 gradient, a multiple of 64 rows, at
    least 64, at most the weight; a negative size is refused by name."""
    from forge_optim.kernels.launch import KernelConfig, split_rows

    assert split_rows(14336, 4096, 32) == 2048  # 32 MiB / (4 B x 4096)
    assert split_rows(4096, 14336, 32) == 576  # 585 rounded down to a multiple of 64
    assert split_rows(100, 4096, 32) == 100
    assert split_rows(4096, 1 << 20, 1) == 64
    assert "split32" in KernelConfig(split_mb=32).short()
    assert "split" not in KernelConfig().short()
    with pytest.raises(ValueError, match="split_mb"):
        KernelConfig(split_mb=-1)


def test_elementwise_jobs_tune_once_per_power_of_two_rows():
    """An embedding's touched rows change in number every step: element-wise (BT=0) jobs share a tuning
    key per power of two of rows (no re-tuning every step); a fused layer's key keeps its exact shape."""
    from forge_optim.backends.triton_backend import TritonBackend, launch_kwargs

    be = TritonBackend()
    keys = []
    be.tuner.pick = lambda key, bt, run, device=None: keys.append(key)
    for rows, bt in ((500, 0), (510, 0), (512, 0), (513, 0), (500, 16), (510, 16)):
        job = make_job("AdamW", "bf16-sr", rows, 64)
        dy, x = torch.empty(bt, rows, dtype=torch.bfloat16), torch.empty(bt, 64, dtype=torch.bfloat16)
        be._config(job, dy, x, launch_kwargs(job, dy, x))
    shapes = [k[0] for k in keys]
    assert shapes == [(512, 64), (512, 64), (512, 64), (1024, 64), (500, 64), (510, 64)]


def test_tma_allocator_set_in_every_launching_thread():
    """Triton's allocator is a ContextVar (per thread); backward launches from autograd's threads."""
    import threading

    from triton.runtime import _allocation

    from forge_optim.kernels import launch as launch_mod

    seen = {}

    def worker():
        launch_mod._ensure_allocator()
        seen["set"] = _allocation._allocator.get() is not _allocation._NULL_ALLOCATOR

    for _ in range(2):  # a second thread, after the first has set it in its own context
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert seen.pop("set")


def test_direct_launch_key_holds_every_specialization():
    """The direct-launch cache key separates whatever Triton specializes a kernel on: pointer dtype
    and 16-byte alignment, an int that is 1, divisible by 16 or beyond int32, and every constexpr."""
    from forge_optim.kernels.launch import _spec_key

    base = torch.zeros(64, dtype=torch.bfloat16)
    meta, opts = ("m", 1), (("num_warps", 4),)

    def key(t=base[:32], ints=(3, 32), keys=(5, 7), meta=meta, opts=opts, device=0):
        return _spec_key((t, base), ints, keys, meta, opts, device)

    k = key()
    assert k == key(t=base[16:48], ints=(5, 48), keys=(9, 2**31 - 1))  # same classes, other values
    assert k != key(t=base[1:33])  # 2-byte offset: unaligned
    assert k != key(t=base.float()[:32])  # dtype
    assert k != key(ints=(1, 32))  # == 1
    assert k != key(ints=(3, 33))  # % 16
    assert k != key(ints=(3, 1 << 33))  # int64
    assert k != key(keys=(1, 7))  # a key of 1
    assert k != key(meta=("m", 2))  # constexpr
    assert k != key(opts=(("num_warps", 8),))  # launch option
    assert k != key(device=1)  # device


def test_direct_launch_taken_without_profiler_hooks():
    """Triton 3.6 keeps its launch hooks in a HookChain that is never None: an empty chain must not
    send every launch back through Triton's slow path (it did, unnoticed, in the first version)."""
    triton = pytest.importorskip("triton")
    from forge_optim.kernels.launch import _hooked

    rt = triton.knobs.runtime
    assert not _hooked(rt.launch_enter_hook) and not _hooked(rt.launch_exit_hook)
    hook = lambda *a: None  # noqa: E731
    rt.launch_enter_hook.add(hook)
    try:
        assert _hooked(rt.launch_enter_hook)
    finally:
        rt.launch_enter_hook.remove(hook)
    assert _hooked(hook) and not _hooked(None)


def _fixed_backend():
    """One config for the tests that check numerics, not speed (fewer compiles on the device)."""
    from forge_optim.backends.triton_backend import TritonBackend
    from forge_optim.kernels.launch import GPU_TEST_CONFIG

    return TritonBackend(config=GPU_TEST_CONFIG)


def _gpu_inputs(BT, M, N, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dy = torch.randn(BT, M, device="cuda", generator=gen, dtype=torch.float32).mul_(0.05).bfloat16()
    x = torch.randn(BT, N, device="cuda", generator=gen, dtype=torch.float32).bfloat16()
    return dy, x


def _relnorm(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("BT", GPU_BTS)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_fp32_state_vs_torch_adamw(shape, BT):
    """fp32 W and m, v: two steps equal torch.optim.AdamW (single-tensor) to fp32 round-off.

    torch.optim gets the kernel's own gradient (the accumulate mode with the same config sums the
    same tiles in the same order), so the only differences left are the rule's fp32 arithmetic;
    that gradient itself must equal the cuBLAS fp32 gradient up to summation order. (Against the
    cuBLAS gradient directly, Adam's first step lr*sign(g) flips wherever |g| is within round-off of
    zero, which is a property of the GEMM order, not of the kernel.)
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    M, N = shape
    gen = torch.Generator(device="cuda").manual_seed(M + BT)
    w = torch.randn(M, N, device="cuda", generator=gen) * 0.02
    w0 = w.clone()
    p = torch.nn.Parameter(w.clone())
    # the single-tensor torch.optim (foreach=False): like our rules it forms 1 - beta in double
    # precision. torch's fused=True kernel forms it in fp32 (1 - 0.999f = 0.00100005), so its v
    # differs from both by ~1e-5 relative (measured on the H200: v rel 1.29e-5, m rel 2.2e-7).
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, foreach=False)
    rule = RULES["AdamW"]
    group = dict(rule.defaults, lr=1e-3, weight_decay=0.1)
    specs = rule.state_specs(group)
    m = StateView(specs[0], torch.zeros(M, N, device="cuda"))
    v = StateView(specs[1], torch.zeros(M, N, device="cuda"))
    nf = torch.zeros((), dtype=torch.int64, device="cuda")
    be = _fixed_backend()
    gerrs = []
    for step in (1, 2):
        dy, x = _gpu_inputs(BT, M, N, seed=step * 1000 + M)
        g = torch.zeros(M, N, device="cuda")
        be.accumulate(g, dy, x)
        gerrs.append(_relnorm(g, dy.float().t() @ x.float()))  # cuBLAS fp32 (tf32 off)
        job = UpdateJob(weight=w, rule=rule, coeffs=rule.padded(rule.coefficients(group, {}, step)),
                        states=[m, v], nonfinite=nf)
        be.update(job, dy, x)
        p.grad = g
        opt.step()
        p.grad = None
        del dy, x, g
    torch.cuda.synchronize()
    assert int(nf) == 0
    assert torch.isfinite(w).all()
    upd = _relnorm(w - w0, p.detach() - w0)
    werr = ((w - p.detach()).abs().max() / (p.detach() - w0).abs().max()).item()
    em = _relnorm(m.data, opt.state[p]["exp_avg"])
    ev = _relnorm(v.data, opt.state[p]["exp_avg_sq"])
    print(f"fp32-state {shape} BT={BT}: grad vs cuBLAS {max(gerrs):.2e}, update rel {upd:.2e}, "
          f"max |dW| / max update {werr:.2e}, m rel {em:.2e}, v rel {ev:.2e}")
    assert max(gerrs) < 2e-5, gerrs
    assert em < 1e-6 and ev < 1e-6, (em, ev)
    assert upd < 1e-5, upd
    assert werr < 1e-3, werr


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096)])
def test_gpu_tuned_matches_fixed(shape):
    """The tuner (trials on clones) applies the update exactly once: tuned == fixed-config result."""
    from forge_optim.backends.triton_backend import TritonBackend

    M, N = shape
    dy, x = _gpu_inputs(512, M, N, seed=1)
    a = make_job("AdamW", "fp32", M, N, device="cuda", seed=2)
    b = copy.deepcopy(a)
    TritonBackend().update(a, dy, x)
    _fixed_backend().update(b, dy, x)
    torch.testing.assert_close(a.weight, b.weight, rtol=1e-5, atol=1e-6)
    for va, vb in zip(a.states, b.states):
        torch.testing.assert_close(va.data, vb.data, rtol=1e-4, atol=1e-7)


def _assert_twins_write_same_bits(mode, twins, off: dict, seed: int, bad_entry=None):
    """Each config in ``twins`` and its twin ``replace(cfg, **off)`` write the same W, states, scales and
    non-finite count, from the same AdamW job, on an odd shape (1000x3008, BT=515: masked edges and
    partial tiles) on the GPU. ``bad_entry``: a (token, row) of dY set to NaN, so that one row of the
    gradient is not finite (the per-tile count and the guard)."""
    from dataclasses import replace

    from forge_optim.backends.triton_backend import TritonBackend

    M, N, BT = 1000, 3008, 515
    dy, x = _gpu_inputs(BT, M, N, seed=seed)
    if bad_entry is not None:
        dy[bad_entry] = float("nan")
    assert twins
    for cfg in twins:
        a = make_job("AdamW", mode, M, N, device="cuda", seed=seed + 1)
        b = copy.deepcopy(a)
        TritonBackend(config=cfg).update(a, dy, x)
        TritonBackend(config=replace(cfg, **off)).update(b, dy, x)
        assert torch.equal(a.weight, b.weight), cfg.short()
        for va, vb in zip(a.states, b.states):
            assert torch.equal(va.data, vb.data), cfg.short()
            if va.quantized:
                assert torch.equal(va.scale, vb.scale), cfg.short()
        assert int(a.nonfinite) == int(b.nonfinite) == (0 if bad_entry is None else N), cfg.short()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16-sr", "int8"])
def test_gpu_prefetch_changes_no_bit(mode):
    """An L2 prefetch is only a hint: every prefetch config writes exactly the bits of its twin
    without prefetch (odd shape, so the clamped edge prefetches are exercised too)."""
    from forge_optim.kernels.launch import ALL_TUNED_CONFIGS

    _assert_twins_write_same_bits(mode, [c for c in ALL_TUNED_CONFIGS if c.prefetch], dict(prefetch=False), seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16-sr", "int8"])
def test_gpu_evict_first_changes_no_bit(mode):
    """An L2 eviction policy is only a hint: every evict-first config (the exploratory candidates) writes
    exactly the bits of its twin without it, non-finite count included."""
    from forge_optim.kernels.launch import ALL_TUNED_CONFIGS, EXPLORE_SMALL_BT_CONFIGS

    twins = [c for c in ALL_TUNED_CONFIGS + EXPLORE_SMALL_BT_CONFIGS if c.evict_first]
    _assert_twins_write_same_bits(mode, twins, dict(evict_first=False), seed=6, bad_entry=(3, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16-sr", "int8"])
def test_gpu_load_fence_changes_no_bit(mode):
    """The load fence only orders instructions: every config with it forced (the exploratory twins, and
    the large tiles' default) writes exactly the bits of its twin with it off, non-finite count included."""
    from forge_optim.kernels.launch import EXPLORE_SMALL_BT_CONFIGS, SMALL_BT_CONFIGS

    large = {c.short(): c for c in SMALL_BT_CONFIGS}["128x256x64 w16 s3 g8 p1 e8 tma la1"]
    twins = [c for c in EXPLORE_SMALL_BT_CONFIGS if c.load_fence == 1] + [large]
    assert len(twins) >= 2 and all(c.fence for c in twins)
    _assert_twins_write_same_bits(mode, twins, dict(load_fence=0), seed=8, bad_entry=(5, 9))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16-sr", "int8"])
def test_gpu_k_step_changes_no_bit(mode):
    """A 128-wide K step only groups the same wgmma instructions into fewer pipeline stages: the
    accumulator sums the K slices in the same order, so every BK=128 config writes exactly the bits of its
    BK=64 twin, non-finite count included."""
    from forge_optim.kernels.launch import ALL_TUNED_CONFIGS, EXPLORE_SMALL_BT_CONFIGS

    twins = [c for c in ALL_TUNED_CONFIGS + EXPLORE_SMALL_BT_CONFIGS if c.BK == 128]
    assert len(twins) >= 3
    _assert_twins_write_same_bits(mode, twins, dict(BK=64, num_stages=3), seed=9, bad_entry=(2, 13))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16-sr", "int8"])
def test_gpu_lookahead_changes_no_bit(mode):
    """Issuing the next slices' loads early only reorders memory traffic: every lookahead config writes
    exactly the bits of its twin with lookahead 0, non-finite counts included (on the GPU, where the
    compiler could contract the same arithmetic differently once operands arrive earlier: the
    interpreter cannot show that)."""
    from dataclasses import replace

    from forge_optim.kernels.launch import ALL_TUNED_CONFIGS, EXPLORE_SMALL_BT_CONFIGS, SMALL_BT_CONFIGS

    twins = list(dict.fromkeys(c for c in ALL_TUNED_CONFIGS + EXPLORE_SMALL_BT_CONFIGS if c.epi_lookahead))
    twins.append(replace(SMALL_BT_CONFIGS[-2], epi_lookahead=2))
    _assert_twins_write_same_bits(mode, twins, dict(epi_lookahead=0), seed=5, bad_entry=(7, 11))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16-sr", "int8"])
def test_gpu_split_schedule_matches_fused(mode):
    """The split schedule (cuBLAS fp32 gradient chunks + BT=0 launches) against the fused kernel on
    random inputs at BT=8192: equal up to the two GEMMs' reduction orders (fp32 state to fp32
    round-off; bf16 and int8 within one step, almost all bits equal: the same hash keys), the same
    non-finite count, and no chunk left out (the chunk size does not divide the rows)."""
    from dataclasses import replace

    from forge_optim.backends.triton_backend import TritonBackend
    from forge_optim.kernels.launch import LARGE_BT_CONFIGS, split_rows

    M, N, BT = 3000, 4096, 8192
    assert M % split_rows(M, N, 8) != 0
    dy, x = _gpu_inputs(BT, M, N, seed=11)
    dy[3, 7] = float("nan")
    a = make_job("AdamW", mode, M, N, device="cuda", seed=12)
    b = copy.deepcopy(a)
    w0 = a.weight.clone()
    TritonBackend(config=LARGE_BT_CONFIGS[1]).update(a, dy, x)
    TritonBackend(config=replace(LARGE_BT_CONFIGS[1], split_mb=8)).update(b, dy, x)
    torch.cuda.synchronize()
    assert int(a.nonfinite) == int(b.nonfinite) == N
    assert torch.equal(b.weight[7], w0[7])
    if mode == "fp32":
        torch.testing.assert_close(b.weight, a.weight, rtol=1e-5, atol=1e-6)
        for va, vb in zip(a.states, b.states):
            torch.testing.assert_close(vb.data, va.data, rtol=1e-4, atol=1e-9)
    else:
        assert_weight_close(b.weight, a.weight, f"split {mode}")
        for va, vb in zip(a.states, b.states):
            assert_state_close(vb, va, mode, f"split {mode} {va.spec.name}")


@pytest.mark.gpu
def test_gpu_fp32_inputs_ieee():
    """fp32 dy and x use an ieee fp32 dot (no tf32): the gradient matches cuBLAS fp32."""

    torch.backends.cuda.matmul.allow_tf32 = False
    M, N, BT = 4096, 4096, 512
    gen = torch.Generator(device="cuda").manual_seed(11)
    dy = torch.randn(BT, M, device="cuda", generator=gen)
    x = torch.randn(BT, N, device="cuda", generator=gen)
    buf = torch.zeros(M, N, device="cuda")
    _fixed_backend().accumulate(buf, dy, x)
    ref = dy.double().t() @ x.double()
    err = _relnorm(buf, ref)
    print(f"fp32 ieee accumulate rel err vs fp64 {err:.2e}")
    assert err < 1e-6


@pytest.mark.gpu
def test_gpu_bf16_state_sr_quarter_ulp():
    """A bf16 momentum buffer (slot 0: the high half of the weight's hash) growing by a quarter ULP per
    step for 100 steps moves by 25 ULP on average (unbiased), and the weight (lr = 0) keeps its bits."""
    from forge_optim.rules.base import StateSpec

    M, N, BT = 4096, 4096, 512
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    rule = RULES["SGD"]
    group = dict(rule.defaults, lr=0.0, momentum=1.0)  # buf += g
    buf = torch.ones(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(M, N, device="cuda", dtype=torch.bfloat16)
    dy = torch.full((BT, M), ulp / 4 / BT, device="cuda", dtype=torch.bfloat16)  # 2**-18: exact
    x = torch.ones(BT, N, device="cuda", dtype=torch.bfloat16)  # G = ulp / 4 everywhere
    be = _fixed_backend()
    steps = 100
    for step in range(2, steps + 2):
        job = UpdateJob(weight=w, rule=rule, coeffs=rule.padded(rule.coefficients(group, {}, step)),
                        states=[StateView(StateSpec("momentum_buffer", 0), buf)],
                        stochastic_weight=True, stochastic_state=True,
                        key_weight=precision.stream_key(0, 0, step, precision.SITE_WEIGHT),
                        key_states=(precision.stream_key(0, 0, step, precision.SITE_STATE0),))
        be.update(job, dy, x)
    torch.cuda.synchronize()
    change = (buf.float() - 1.0) / ulp
    mean = change.double().mean().item()
    print(f"quarter-ULP state SR: mean change {mean:.4f} ULP (expect {steps / 4})")
    assert abs(mean - steps / 4) < 0.02, mean
    assert change.std().item() > 1.0
    assert torch.equal(w, torch.ones_like(w))


@pytest.mark.gpu
def test_gpu_bf16_second_moment_sr_unbiased():
    """exp_avg_sq (slot 1: the mixed draw of the weight's hash) on the GPU at 4096x4096: 3/4 of the stores
    of a value three quarters of a ULP up round up over 20 steps (335M stores: std of the fraction
    2.4e-5), and the fused kernel's bits equal the torch backend's every step."""
    frac = _second_moment_sr_fraction([_fixed_backend(), TorchBackend(block_rows=4096)], 4096, 4096, 512, 20,
                                      device="cuda")
    print(f"slot-1 SR: fraction rounded up {frac[0]:.6f} (expect 0.75)")
    assert abs(frac[0] - 0.75) < 0.0003, frac


@pytest.mark.gpu
@pytest.mark.parametrize("stochastic", [True, False])
def test_gpu_bf16_sr_quarter_ulp(stochastic):
    """100 steps of +1/4 ULP: SR moves the mean by 25 ULP (unbiased); RNE never moves."""

    M, N, BT = 4096, 4096, 512
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    w = torch.ones(M, N, device="cuda", dtype=torch.bfloat16)
    dy = torch.ones(BT, M, device="cuda", dtype=torch.bfloat16)
    x = torch.ones(BT, N, device="cuda", dtype=torch.bfloat16)  # G = BT everywhere
    rule = RULES["SGD"]
    group = dict(rule.defaults, lr=ulp / 4 / BT)
    be = _fixed_backend()
    steps = 100
    for step in range(1, steps + 1):
        job = UpdateJob(weight=w, rule=rule, coeffs=rule.padded(rule.coefficients(group, {}, step)),
                        grad_sign=-1.0, stochastic_weight=stochastic,
                        key_weight=precision.stream_key(0, 0, step, precision.SITE_WEIGHT))
        be.update(job, dy, x)  # maximize: w += lr * G = +ulp/4
    torch.cuda.synchronize()
    change = (w.float() - 1.0) / ulp
    mean = change.double().mean().item()
    print(f"quarter-ULP SR={stochastic}: mean change {mean:.4f} ULP (expect {steps / 4 if stochastic else 0})")
    if stochastic:
        # per-element std ~ sqrt(100 * 3/16) ULP ~ 4.3; mean of 16.7M elements: std ~ 0.001
        assert abs(mean - steps / 4) < 0.02, mean
        assert change.std().item() > 1.0
    else:
        assert mean == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("BT", GPU_BTS)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_int8_and_bf16_vs_torch_backend(shape, BT):
    """int8 states (bf16 W, SR) and bf16 SR states: the kernel against the torch backend's
    apply_update on the kernel's own gradient (accumulate mode, same config): W bits and bf16 states
    equal but for FMA-contraction round-off, int8 within one quantization step."""
    M, N = shape
    be = _fixed_backend()
    for mode in ("int8", "bf16-sr"):
        job = make_job("AdamW", mode, M, N, device="cuda", seed=M + BT)
        dy, x = _gpu_inputs(BT, M, N, seed=BT + 7)
        ref = copy.deepcopy(job)
        be.update(job, dy, x)
        g = torch.zeros(M, N, device="cuda")
        be.accumulate(g, dy, x)
        for r0 in range(0, M, 8192):
            apply_update(ref, g[r0:r0 + 8192], r0, min(M, r0 + 8192))
        del g
        torch.cuda.synchronize()
        assert_weight_close(job.weight, ref.weight, f"{mode} {shape} {BT}", exact_frac=0.99)
        for va, vb in zip(job.states, ref.states):
            if va.quantized:
                # the rules' round-off differs too: the Triton rules form 1 - beta2 in fp32 from an fp32
                # beta2, the torch form in fp64 (1.3e-5 relative in the g^2 term of v for beta2 = 0.999)
                assert_int8_close(va, vb, f"{mode} {shape} {BT} {va.spec.name}")
            else:
                d = bf16_ulp_diff(va.data, vb.data)
                assert int(d.max()) <= 1
        assert int(job.nonfinite) == 0
        del job, ref, dy, x
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16-sr", "int8"])
def test_gpu_nonfinite_never_written(mode):

    M, N, BT = 4096, 4096, 512
    job = make_job("AdamW", mode, M, N, device="cuda", seed=3)
    dy, x = _gpu_inputs(BT, M, N, seed=5)
    dy[3, 7] = float("nan")
    x[5, 11] = float("inf")
    w0 = job.weight.clone()
    _fixed_backend().update(job, dy, x)
    torch.cuda.synchronize()
    assert int(job.nonfinite) == N + M - 1
    assert torch.isfinite(job.weight.float()).all()
    for v in job.states:
        assert torch.isfinite(v.data.float()).all()
    assert torch.equal(job.weight[7], w0[7]) and torch.equal(job.weight[:, 11], w0[:, 11])
    assert not torch.equal(job.weight[8], w0[8])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16-sr", "int8"])
def test_gpu_direct_launch_matches_triton_launch(monkeypatch, mode):
    """The direct launch (cached compiled kernel, Triton's argument specialization skipped) writes
    the bits of Triton's own launch path over several steps with new keys, coefficients and input
    pointers, including an unaligned input that must not reuse the aligned kernel."""
    from forge_optim.kernels import launch as launch_mod

    M, N, BT = 1000, 3008, 515
    jobs = {}
    for fast in (False, True):
        monkeypatch.setattr(launch_mod, "FAST_LAUNCH", fast)
        launch_mod._DIRECT.clear()
        job = make_job("AdamW", mode, M, N, device="cuda", seed=5)
        be = _fixed_backend()
        for step in range(1, 5):
            dy, x = _gpu_inputs(BT, M, N, seed=10 + step)
            if step == 3:  # x at a 2-byte offset: another specialization (no TMA, unaligned)
                x = torch.cat([x.new_zeros(1), x.reshape(-1)])[1:].view(BT, N)
            job.coeffs = RULES["AdamW"].padded(RULES["AdamW"].coefficients(dict(RULES["AdamW"].defaults), {}, step))
            job.key_weight = precision.stream_key(7, 1, step, 0)
            job.key_states = tuple(precision.stream_key(7, 1, step, 1 + i) for i in range(3))
            be.update(job, dy, x)
        torch.cuda.synchronize()
        jobs[fast] = (job, len(launch_mod._DIRECT))
    (a, _), (b, entries) = jobs[False], jobs[True]
    assert entries == 2  # the aligned and the unaligned specialization
    assert torch.equal(a.weight, b.weight)
    for va, vb in zip(a.states, b.states):
        assert torch.equal(va.data, vb.data)
        if va.quantized:
            assert torch.equal(va.scale, vb.scale)
    assert int(a.nonfinite) == int(b.nonfinite) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_gpu_prepared_launch_matches_full_path(monkeypatch, state_dtype):
    """The prepared launch plans relaunch the compiled kernel directly on the GPU: same bits as the
    full path (see test_prepared_launch_matches_full_path)."""
    prepared_vs_full(monkeypatch, state_dtype, "cuda")


@pytest.mark.gpu
def test_gpu_bf16_accumulation_buffer(monkeypatch):
    """The kernel's accumulate mode on a bf16 buffer on the GPU (a plain store there, rounded to nearest
    by the conversion), and the final update reading it: see helpers.bf16_accumulation_matches_reference."""
    from forge_optim.kernels.launch import GPU_TEST_CONFIG
    from helpers import bf16_accumulation_matches_reference

    monkeypatch.setenv("FORGE_TRITON_CONFIG", GPU_TEST_CONFIG.env())
    bf16_accumulation_matches_reference("triton", "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_gpu_static_launch_matches_triton_launcher(monkeypatch, state_dtype):
    """The prepared plans' static launch (torch's C++ launcher, plain-integer pointers) writes the bits
    of Triton's own launcher, step after step, with new inputs, token counts (two of the plan's BT
    classes), coefficients, keys and a maximize flip; and it is what the plans actually take on this GPU."""
    import forge_optim
    from forge_optim.kernels import launch as L
    from forge_optim.kernels.launch import GPU_TEST_CONFIG

    monkeypatch.setenv("FORGE_TRITON_CONFIG", GPU_TEST_CONFIG.env())
    runs = {}
    static_runs = []
    real_run = L.StaticLaunch.run
    monkeypatch.setattr(L.StaticLaunch, "run", lambda self, *a: static_runs.append(1) or real_run(self, *a))
    for static in (True, False):
        monkeypatch.setattr(L, "STATIC_LAUNCH", static)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(96, 80, bias=False), torch.nn.Tanh(),
                                    torch.nn.Linear(80, 64, bias=False)).to("cuda", torch.bfloat16)
        opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.1, backend="triton", state_dtype=state_dtype)
        for step, bt in enumerate((33, 40, 17, 48, 64, 9)):
            x = torch.randn(bt, 96, generator=torch.Generator().manual_seed(step)).to("cuda", torch.bfloat16)
            if step == 3:
                opt.param_groups[0]["maximize"] = True
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        runs[static] = [t.detach().clone() for t in model.parameters()] + [
            v.clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        if static:
            # two weights x steps 2, 4, 5: step 0 prepares the plan, steps 1 and 3 record the launch of
            # their BT class (not a multiple of 16; a multiple of 16), later steps of a class launch statically
            assert len(static_runs) == 2 * 3, static_runs
            assert all(rec[4] is not None for h in opt._handles.values() for rec in h.fast.plan.by_class.values())
    for a, b in zip(runs[True], runs[False]):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_prepared_plan_runs_from_another_thread(monkeypatch):
    """A plan recorded in autograd's backward thread relaunches through Triton's launcher from another
    thread: Triton's TMA scratch allocator is per thread, and the relaunch set it only where the plan was
    made ("no allocator was set" before 2026-12-05). The update it applies equals the same update
    launched again, from the same weights and states, in the test's own thread."""
    import threading

    import forge_optim
    from forge_optim.kernels import launch as L
    from forge_optim.kernels.launch import GPU_TEST_CONFIG

    monkeypatch.setenv("FORGE_TRITON_CONFIG", GPU_TEST_CONFIG.env())
    monkeypatch.setattr(L, "STATIC_LAUNCH", False)
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 128, bias=False).to("cuda", torch.bfloat16)
    opt = forge_optim.AdamW(lin, lr=1e-2, weight_decay=0.1, backend="triton", state_dtype="bf16")
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # the full path, then the plan's first launch (recorded in the backward thread)
        lin(x).float().square().mean().backward()
        opt.step()
    h = next(iter(opt._handles.values()))
    plan = h.fast.plan
    assert plan.by_class, "no launch was recorded"
    gi, idx = opt._locate(h.param)
    coeffs, kw, ks = opt._step_scalars(opt.param_groups[gi], h.fast.state, idx, h.fast.specs)
    dy = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)

    def states():  # the state tensors (not the step count)
        return [v for v in opt.state[h.param].values() if v.dim() > 0]

    before = (h.param.detach().clone(), [v.clone() for v in states()])
    errors = []

    def launch_here():
        try:
            plan.run(dy, x, coeffs, 1.0, kw, ks)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    worker = threading.Thread(target=launch_here)
    worker.start()
    worker.join()
    assert not errors, errors
    from_thread = (h.param.detach().clone(), [v.clone() for v in states()])
    with torch.no_grad():
        h.param.copy_(before[0])
        for v, b in zip(states(), before[1]):
            v.copy_(b)
    plan.run(dy, x, coeffs, 1.0, kw, ks)
    torch.cuda.synchronize()
    assert not torch.equal(from_thread[0], before[0])
    assert torch.equal(h.param, from_thread[0])
    for v, t in zip(states(), from_thread[1]):
        assert torch.equal(v, t)
