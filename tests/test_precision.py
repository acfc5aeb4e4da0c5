"""bf16 / int8 stores: stochastic rounding is unbiased, int8 and bf16 states stay within their bounds."""
import math

import pytest
import torch
import torch.nn as nn

import forge_optim
from forge_optim import precision
from forge_optim.backends import StateView, UpdateJob, apply_update
from forge_optim.rules import AdamW as AdamWRule
from helpers import batches, loss_fn, twin

QUARTER_ULP = 2.0**-10  # bf16 ULP on [0.5, 1) is 2**-8


def _quarter_ulp_run(stochastic: bool, steps=100):
    """SGD(lr=1) on a bf16 weight of 0.75 whose gradient is a quarter ULP, through the fused layer."""
    lin = nn.Linear(256, 64, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.fill_(0.75)
    forge_optim.SGD(lin, lr=1.0, stochastic_rounding=stochastic, seed=123)
    x = torch.ones(1, 256, dtype=torch.bfloat16)
    for _ in range(steps):
        (lin(x).float().sum() * QUARTER_ULP).backward()  # dY = 2**-10, X = 1: G = quarter ULP
    return (lin.weight.float() - 0.75).mean().item()


def test_stochastic_rounding_is_unbiased_at_a_quarter_ulp():
    expected = -100 * QUARTER_ULP  # what an fp32 master weight would move: -0.0977
    moved = _quarter_ulp_run(stochastic=True)
    assert abs(moved - expected) < 0.01 * abs(expected), (moved, expected)


def test_round_to_nearest_loses_a_quarter_ulp_update():
    assert _quarter_ulp_run(stochastic=False) == 0.0


def test_stochastic_rounding_is_reproducible_per_seed():
    a, b = _quarter_ulp_run(True, steps=10), _quarter_ulp_run(True, steps=10)
    assert a == b


def test_to_bf16_brackets_and_keeps_specials():
    x = torch.randn(10000) * 3
    x[:3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    offs = torch.arange(x.numel())
    y = precision.to_bf16(x, True, key=99, offsets=offs).float()
    down = x.to(torch.bfloat16).float()
    assert torch.isinf(y[:2]).all() and torch.isnan(y[2])
    f = x[3:]
    lo = torch.minimum(f.abs(), y[3:].abs())
    # result is one of the two bf16 neighbours of x: |y - x| < 1 ULP(x) <= 2**-7 |x|
    assert ((y[3:] - f).abs() <= f.abs() * 2.0**-7 + 1e-30).all()
    assert (torch.sign(y[3:]) == torch.sign(f)).all() and lo.min() >= 0
    assert not torch.equal(y[3:], down[3:])  # stochastic, not nearest


def test_random16_draws_three_uniform_uncorrelated_values_from_one_hash():
    """The weight's store takes the hash's low 16 bits, slot 0's state its high 16 bits and slot 1's the
    high 16 bits of the hash times DRAW2_MUL (the kernel computes one hash for all three): each draw is
    uniform, and no two are correlated."""
    offs = torch.arange(1 << 16)
    lo, hi, mixed = (precision.random16(offs, 12345, d)
                     for d in (precision.DRAW_LOW, precision.DRAW_HIGH, precision.DRAW_MIXED))
    h = precision.hash32((offs + 12345) & precision.MASK32)
    assert torch.equal(lo, h & 0xFFFF) and torch.equal(hi, h >> 16)
    assert torch.equal(mixed, ((h * precision.DRAW2_MUL) & precision.MASK32) >> 16)
    for r in (lo, hi, mixed):  # uniform on [0, 2**16): mean and the 16 bucket counts of the top 4 bits
        assert abs(r.double().mean().item() / 65535 - 0.5) < 0.01
        counts = torch.bincount(r >> 12, minlength=16).double()
        assert ((counts - 4096).abs() < 5 * 64).all()  # 5 sigma of a binomial(65536, 1/16)
    corr = torch.corrcoef(torch.stack([lo.double(), hi.double(), mixed.double()]))
    assert (corr - torch.eye(3, dtype=torch.float64)).abs().max().item() < 0.02
    for a, b in ((lo, hi), (lo, mixed), (hi, mixed)):
        assert (a == b).float().mean().item() < 0.001


def test_mixed_draw_is_uniform_over_keys_for_each_element():
    """What makes a store unbiased: for one element, over random per-step keys, its draw is uniform
    (the hash of a uniform key is uniform; the multiply by an odd constant is a bijection mod 2**32).
    Checked for the third draw on 8 elements over 2**14 keys."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 2**31 - 1, (1 << 14,), generator=g)
    for off in range(8):
        r = precision.random16(keys + off, 0, precision.DRAW_MIXED)  # hash(offset + key) for each key
        assert abs(r.double().mean().item() / 65535 - 0.5) < 0.015
        counts = torch.bincount(r >> 13, minlength=8).double()
        assert ((counts - 2048).abs() < 5 * 42.3).all()  # 5 sigma of a binomial(16384, 1/8)


def test_states_round_with_draws_of_the_weights_hash():
    """torch backend: W and the slot-0 and slot-1 states (exp_avg, exp_avg_sq) of one update are rounded
    with three draws of hash(offset + key_weight) (their own keys are not used); the Triton kernel draws
    the same."""
    rows, cols = 8, 64
    w = torch.randn(rows, cols).bfloat16()
    m, v = (torch.randn(rows, cols) * 0.01).bfloat16(), (torch.rand(rows, cols) * 0.01).bfloat16()
    group = dict(AdamWRule.defaults)
    specs = AdamWRule.state_specs(group)
    job = UpdateJob(weight=w.clone(), rule=AdamWRule, coeffs=AdamWRule.padded(AdamWRule.coefficients(group, {}, 1)),
                    states=[StateView(specs[0], m.clone()), StateView(specs[1], v.clone())],
                    stochastic_weight=True, stochastic_state=True, key_weight=1111, key_states=(2222, 3333))
    g = torch.randn(rows, cols)
    apply_update(job, g)
    w_new, (m_new, v_new) = AdamWRule.update(w.float(), g, [m.float(), v.float()], job.coeffs)
    offs = torch.arange(rows * cols).view(rows, cols)
    assert torch.equal(job.weight, precision.to_bf16(w_new, True, 1111, offs))
    assert torch.equal(job.states[0].data, precision.to_bf16(m_new, True, 1111, offs, precision.DRAW_HIGH))
    assert torch.equal(job.states[1].data, precision.to_bf16(v_new, True, 1111, offs, precision.DRAW_MIXED))
    assert not torch.equal(job.states[1].data, precision.to_bf16(v_new, True, 1111, offs, precision.DRAW_HIGH))


@pytest.mark.parametrize("nonnegative", [False, True])
def test_int8_quantization_error_is_half_a_step(nonnegative):
    x = torch.randn(7, 150).abs() if nonnegative else torch.randn(7, 150)
    x[0, :64] *= 1000  # an outlier block inflates only its own scale
    q, scale = precision.quantize(x, nonnegative)
    back = precision.dequantize(q, scale)
    step = scale.repeat_interleave(64, dim=1)[:, :150]
    err = (back - x).abs()
    if nonnegative:  # floored: a positive value may read back as one step
        assert (err <= step + 1e-12).all() and (back[x > 0] > 0).all()
    else:
        assert (err <= step / 2 + 1e-6 * step).all()
    assert q.dtype == (torch.uint8 if nonnegative else torch.int8)


@pytest.mark.parametrize("nonnegative", [False, True])
def test_int8_scales_are_the_smallest_bf16_at_or_above_absmax_over_qmax(nonnegative):
    """Scales are stored in bf16, rounded up (precision.SCALE_DTYPE): checked against an fp64 reference
    that takes the bf16 grid from frexp, on values across the exponent range (fp32's: bf16 shares it)."""
    torch.manual_seed(1)
    x = torch.randn(64, 256) * torch.logspace(-30, 30, 64).unsqueeze(1)
    x = x.abs() if nonnegative else x
    x[3, 64:128] = 0.0  # an all-zero block: scale 0, codes 0
    qmax = 255.0 if nonnegative else 127.0
    x[5, :64] = 2.0 ** -20 * qmax  # absmax/qmax = 2**-20, on the bf16 grid
    q, scale = precision.quantize(x, nonnegative)
    assert scale.dtype == torch.bfloat16 and scale.shape == (64, 4)
    target = (x.view(64, 4, 64).abs().amax(-1) / qmax).double()  # fp32 absmax/qmax, as the kernel forms it
    mant, exp = torch.frexp(target)  # target = mant * 2**exp, mant in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(target), exp - 8)  # bf16: 8 significant bits
    expected = torch.where(target > 0, torch.ceil(target / ulp) * ulp, torch.zeros_like(target))
    assert torch.equal(scale.double(), expected)
    assert float(scale[5, 0]) == float(target[5, 0])  # already on the grid: not rounded further up
    assert (q[3, 64:128] == 0).all() and float(scale[3, 1]) == 0.0
    # codes stay inside [-qmax, qmax] and read back within half a step of the stored scale
    assert int(q.to(torch.int16).abs().max()) <= qmax
    step = scale.float().repeat_interleave(64, dim=1)
    err = (precision.dequantize(q, scale) - x).abs()
    assert (err <= (step if nonnegative else step / 2) * (1 + 1e-6)).all()


def _adamw_state_trajectory(mode: str, grads, beta1=0.9, beta2=0.99):
    """Run the AdamW rule on a fixed gradient stream; return [(m, v)] per step, dequantized."""
    shape = grads[0].shape
    w = torch.zeros(shape)
    group = dict(lr=1e-3, betas=(beta1, beta2), eps=1e-8, weight_decay=0.0)
    views = []
    for spec in AdamWRule.state_specs(group):
        if mode == "int8":
            q, s = precision.quantize(torch.zeros(shape), spec.nonnegative)
            views.append(StateView(spec, q, s))
        else:
            views.append(StateView(spec, torch.zeros(shape, dtype=torch.bfloat16 if mode == "bf16" else torch.float32)))
    out = []
    for t, g in enumerate(grads, start=1):
        job = UpdateJob(weight=w, rule=AdamWRule, coeffs=AdamWRule.padded(AdamWRule.coefficients(group, {}, t)),
                        states=views, stochastic_state=True,
                        key_states=(precision.stream_key(0, 0, t, 1), precision.stream_key(0, 0, t, 2), 0))
        apply_update(job, g)
        out.append(tuple(precision.dequantize(v.data, v.scale) if v.quantized else v.data.float().clone() for v in views))
    return out


def test_int8_and_bf16_states_stay_within_their_bounds():
    torch.manual_seed(0)
    beta1, beta2 = 0.9, 0.99
    grads = [torch.randn(16, 128) * (1 + 0.1 * t) for t in range(60)]
    exact = _adamw_state_trajectory("fp32", grads, beta1, beta2)
    int8 = _adamw_state_trajectory("int8", grads, beta1, beta2)
    bf16 = _adamw_state_trajectory("bf16", grads, beta1, beta2)
    max_m = max(m.abs().max().item() for m, _ in exact)
    max_v = max(v.abs().max().item() for _, v in exact)
    # int8: each store errs by <= s/2 (m, s = absmax/127 rounded up to bf16: < 2**-7 more) or <= s (v,
    # floored, s = absmax/255 rounded up); errors decay
    # geometrically: |m~ - m| <= s_max / (2 (1 - beta1)), |v~ - v| <= s_max / (1 - beta2) (Appendix B).
    bound_m = (1.05 * max_m / 127) / (2 * (1 - beta1))
    bound_v = (1.05 * max_v / 255) / (1 - beta2)
    for (m, v), (mq, vq) in zip(exact, int8):
        assert (mq - m).abs().max() <= bound_m
        assert (vq - v).abs().max() <= bound_v
    # bf16 with stochastic rounding: each store errs by < 1 ULP <= 2**-7 |value|
    for (m, v), (mb, vb) in zip(exact, bf16):
        assert (mb - m).abs().max() <= 2.0**-7 * 1.05 * max_m / (1 - beta1)
        assert (vb - v).abs().max() <= 2.0**-7 * 1.05 * max_v / (1 - beta2)
    # and in practice far inside: the RMS error of m is about one quantization step
    rms = ((int8[-1][0] - exact[-1][0]).pow(2).mean().sqrt()).item()
    assert rms <= max_m / 127


@pytest.mark.parametrize("state_dtype,bound", [("bf16", 0.02), ("int8", 0.05)])
def test_low_precision_state_trajectory_stays_close_to_fp32_state(state_dtype, bound):
    """Whole-model check (fp32 weights, 20 AdamW steps): weights drift from the fp32-state run by at most
    ``bound`` of the distance they travelled (README: bf16 state 2%, int8 state 5%)."""
    model, ref_model = twin()
    start = [p.detach().clone() for p in ref_model.parameters()]
    opt = forge_optim.AdamW(model, lr=1e-2, state_dtype=state_dtype)
    ref = forge_optim.AdamW(ref_model, lr=1e-2, state_dtype="fp32")
    for b in batches(20):
        for m, o in ((model, opt), (ref_model, ref)):
            loss_fn(m, b).backward(); o.step(); o.zero_grad()
    moved = math.sqrt(sum((p - s).pow(2).sum().item() for p, s in zip(ref_model.parameters(), start)))
    drift = math.sqrt(sum((p - q).pow(2).sum().item() for p, q in zip(model.parameters(), ref_model.parameters())))
    assert drift <= bound * moved, (drift / moved)
