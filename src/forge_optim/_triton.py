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


if HAS_TRITON:
    @jit
    def _div_approx(a, b):
        # PTX div.approx.f32: a * (1/b), <= 2 ulp for 2**-126 <= |b| <= 2**126 (a rule's denominators:
        # sqrt(v)+eps). The plain "/" lowers to div.full.f32, also <= 2 ulp, plus a range check and
        # rescaling of both operands: 7 more instructions per element in the fused epilogue.
        return tl.inline_asm_elementwise("div.approx.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)

    @jit
    def _div_plain(a, b):
        return a / b

    def _ptx_target() -> bool:
        import torch

        return not interpreting() and torch.version.hip is None

    # fp32 a / b for the rules' Triton updates (the interpreter and ROCm have no PTX inline assembly)
    fast_div = _div_approx if _ptx_target() else _div_plain
else:  # pragma: no cover
    fast_div = None
