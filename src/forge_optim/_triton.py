"""Optional Triton import: the rules define their Triton form with ``jit`` even where Triton is absent."""
from __future__ import annotations

import os

try:  # Triton ships for Linux only; the torch backend needs none of it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
    jit = triton.jit
except ImportError:  # pragma: no cover - exercised on platforms without Triton
    triton = None
    tl = None
    HAS_TRITON = False

    def jit(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Rules divide only by positive denominators (sqrt(v) + eps). Below 2**-126 (possible only with
# eps < 2**-126) the denominator is raised to 2**-126: the quotient is then already beyond 2**126 |a|
# in torch.optim too, and 0 / 0 (torch: NaN) gives 0 here.
FLT_MIN = 1.1754943508222875e-38

if HAS_TRITON:
    _FLT_MIN = tl.constexpr(FLT_MIN)

    @jit
    def _div_approx(a, b):
        # PTX div.approx.ftz.f32: a * (1/b), <= 2 ulp for 2**-126 <= b <= 2**126 (MUFU.RCP + FMUL). The
        # plain "/" lowers to div.full.f32, also <= 2 ulp, plus a range check and a rescale of both
        # operands (7 more instructions per element in the fused epilogue); without .ftz, 4 more for
        # denormal denominators, which the clamp to FLT_MIN (one FMNMX) excludes.
        return tl.inline_asm_elementwise("div.approx.ftz.f32 $0, $1, $2;", "=f,f,f", [a, tl.maximum(b, _FLT_MIN)],
                                         dtype=tl.float32, is_pure=True, pack=1)

    @jit
    def _div_plain(a, b):
        return a / tl.maximum(b, _FLT_MIN)

    def _ptx_target() -> bool:
        import torch

        return not interpreting() and torch.version.hip is None

    # a / b (b > 0) for the rules' Triton updates (the interpreter and ROCm have no PTX inline assembly)
    fast_div = _div_approx if _ptx_target() else _div_plain
else:  # pragma: no cover
    fast_div = None
