"""The int8 block scale without divisions (kernels/fused.py ``_block_scale``) writes the bits of the two
correctly rounded divisions it replaces (``_block_scale_div``, precision._block_scale).

On the CPU the algorithm is checked in exact arithmetic: numpy emulates each PTX instruction with one
rounding (an FMA through float64 and an exact two-sum), over every fp32 value of whole binades and all
subnormals for the quotient, and from every start within 2 ulp of the reciprocal (``rcp.approx`` is
within 1) for each of the 2**15 positive bf16 scales. On the GPU the compiled kernel is compared with the
divisions over every non-negative fp32 bit pattern, NaN and infinity included.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

F32 = np.float32
F64 = np.float64


def _fma32(a, b, c):
    """fp32 fma(a, b, c) with one rounding: a*b is exact in float64 (48 bits); the float64 sum s and its
    exact error err (two-sum) round to fp32 as the exact sum does, except where s is an fp32 midpoint:
    there the exact sum lies on err's side of it (err == 0: a true tie, numpy's half-even is right)."""
    a, b, c = (np.asarray(t, F32).astype(F64) for t in (a, b, c))
    p = a * b
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c
        bp = s - c
        err = (p - bp) + (c - (s - bp))
        r = s.astype(F32)
        r64 = r.astype(F64)
        other = np.nextafter(r, np.where(s > r64, F32(np.inf), F32(-np.inf))).astype(F32)
        o64 = other.astype(F64)
        mid = (s != r64) & (s == (r64 + o64) / 2) & (err != 0)
        up = np.where(o64 > r64, other, r)
        down = np.where(o64 > r64, r, other)
        r = np.where(mid, np.where(err > 0, up, down), r)
    return r.astype(F32)


def _quotient(x, qmax):
    """The kernel's RN(x / qmax): q = RN(x * c), c = RN(1/qmax); q += RN(x - q*qmax) * c by fma."""
    c = F32(1) / F32(qmax)
    q = (x * c).astype(F32)
    r = _fma32(q, F32(-qmax), x)
    return _fma32(r, c, q)


def _binades(exponents):
    """Every fp32 value of the binades [2**e, 2**(e+1)) (e = -127: all subnormals and zero)."""
    mant = np.arange(1 << 23, dtype=np.uint32)
    out = []
    for e in exponents:
        if e == -127:
            out.append(mant)
        else:
            out.append(((e + 127) << 23) | mant)
    return np.concatenate(out).view(F32)


@pytest.mark.parametrize("qmax", [127.0, 255.0])
def test_quotient_by_qmax_is_the_correctly_rounded_division(qmax):
    for e in (-127, -126, -100, -1, 0, 7, 120, 127):
        x = _binades([e])
        want = x / F32(qmax)
        got = _quotient(x, qmax)
        bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        assert bad.size == 0, (e, x[bad[:5]], got[bad[:5]], want[bad[:5]])


def test_fma_emulation_rounds_once():
    """The emulation itself: 1 + 2**-23 + 2**-24 - 2**-70 (float64 rounds it to the fp32 midpoint
    1 + 2**-23 + 2**-24) rounds down to 1 + 2**-23, where a double rounding would tie to the even
    1 + 2**-22; an exact midpoint ties to even."""
    c = F32(1 + 2.0 ** -23)
    a = F32(2.0 ** -24 * (1 + 2.0 ** -23))
    assert _fma32(a, F32(1 - 2.0 ** -23), c) == c
    assert _fma32(F32(2.0 ** -24), F32(1.0), c) == F32(1 + 2.0 ** -22)


def test_reciprocal_of_a_bf16_scale_by_one_newton_step():
    """For every positive finite bf16 scale s: from any start y within 2 ulp of RN(1/s) (rcp.approx.ftz
    is within 1 for the normal operand it gets), y + y*(1 - s'*y) by two fmas, with s' = s * 2**24 for a
    subnormal s and the result scaled back, is RN(1/s) (inf where 1/s overflows)."""
    s = (np.arange(1, 0x7F80, dtype=np.uint32) << 16).view(F32)
    sub = s < F32(2.0 ** -126)
    k = np.where(sub, F32(2.0 ** 24), F32(1.0)).astype(F32)
    sk = (s * k).astype(F32)
    with np.errstate(divide="ignore", over="ignore"):
        ref = (F32(1) / sk).astype(F32)
        want = (F32(1) / s).astype(F32)
    assert np.isfinite(ref).all()  # the scaled operand is normal: its reciprocal is finite
    for d in (-2, -1, 0, 1, 2):
        y = (ref.view(np.uint32).astype(np.int64) + d).astype(np.uint32).view(F32)
        e = _fma32(-sk, y, F32(1.0))
        y1 = _fma32(y, e, y)
        with np.errstate(over="ignore"):
            got = (y1 * k).astype(F32)
        bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        assert bad.size == 0, (d, s[bad[:5]], got[bad[:5]], want[bad[:5]])


def test_int8_kernel_has_no_correctly_rounded_division():
    """The int8 epilogue's block scale compiles without div.rn (whose SASS is a reciprocal, four FMAs, a
    range check and a call to a slow path per block, lane and state): offline, sm_90a."""
    pytest.importorskip("triton")
    from forge_optim.kernels import fused, ptxas
    from forge_optim.kernels.launch import SMALL_BT_CONFIGS
    from forge_optim.kernels.offline import compile_fused

    cfg = SMALL_BT_CONFIGS[-2]
    ptx = compile_fused(cfg, fused.S_INT8, fused.S_UINT8).asm["ptx"]
    assert "div.rn.f32" not in ptx
    assert ptx.count("rcp.approx.ftz.f32") == 2 * cfg.epi_split  # one per state and slice (per lane)
    sass = ptxas.ptxas_usage(ptx, sass=True)["sass"]
    assert "FCHK" not in sass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", [3, 4])
def test_gpu_block_scale_equals_the_divisions_for_every_fp32(kind):
    """Every non-negative fp32 bit pattern (0 to 0x7FFFFFFF: subnormals, infinity and NaNs included) as
    a block's absmax: ``_block_scale`` and ``_block_scale_div`` give the same bits for the scale and its
    reciprocal, on this GPU."""
    import triton
    import triton.language as tl

    from forge_optim.kernels import fused

    @triton.jit
    def compare(bad_ptr, first_ptr, start, KIND: tl.constexpr, BLOCK: tl.constexpr):
        bits = start + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = bits.to(tl.int32).to(tl.float32, bitcast=True)
        s1, i1 = fused._block_scale(x, KIND)
        s0, i0 = fused._block_scale_div(x, KIND)
        diff = (s1.to(tl.int32, bitcast=True) != s0.to(tl.int32, bitcast=True)) | \
               (i1.to(tl.int32, bitcast=True) != i0.to(tl.int32, bitcast=True))
        n = tl.sum(diff.to(tl.int32))
        if n > 0:
            tl.atomic_add(bad_ptr, n)
            tl.atomic_min(first_ptr, tl.min(tl.where(diff, bits, 0x7FFFFFFF)))

    BLOCK = 1024
    bad = torch.zeros((), dtype=torch.int32, device="cuda")
    first = torch.full((), 0x7FFFFFFF, dtype=torch.int32, device="cuda")
    chunk = 1 << 28
    for start in range(0, 1 << 31, chunk):
        compare[(chunk // BLOCK,)](bad, first, start, KIND=kind, BLOCK=BLOCK)
    torch.cuda.synchronize()
    assert int(bad) == 0, f"{int(bad)} patterns differ, first {int(first):#010x}"
