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
