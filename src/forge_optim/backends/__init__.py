"""Backends behind one interface (:class:`~forge_optim.backends.base.Backend`): torch (tiled) and triton."""
from __future__ import annotations


import torch

from .base import Backend, StateView, UpdateJob
from .torch_backend import TorchBackend, apply_update

BACKEND_NAMES = ("auto", "torch", "triton")


def triton_available() -> tuple[bool, str]:
    """Whether the Triton backend can run here, and if not, why (for error messages)."""
    from .._triton import HAS_TRITON, interpreting

    if not HAS_TRITON:
        return False, "triton is not installed (it ships for Linux: pip install triton)"
    if interpreting():
        return True, ""
    if not torch.cuda.is_available():
        return False, ("no CUDA device is visible; use backend='torch' (or 'auto'), or set "
                       "TRITON_INTERPRET=1 to run the Triton kernels on the CPU interpreter for testing")
    return True, ""


def make_backend(name: str, device: torch.device, block_rows: int) -> Backend:
    """The backend that serves a weight on ``device`` for the user's ``backend=`` choice."""
    if name == "torch":
        return TorchBackend(block_rows)
    if name == "auto" and device.type != "cuda":
        return TorchBackend(block_rows)
    try:
        from .triton_backend import TritonBackend
    except ImportError as err:  # the kernel module is missing or triton is absent
        if name == "triton":
            raise RuntimeError(f"backend='triton' is unavailable: {err}") from err
        return TorchBackend(block_rows)
    ok, why = triton_available()
    if not ok:
        if name == "triton":
            raise RuntimeError(f"backend='triton' cannot run: {why}")
        return TorchBackend(block_rows)
    return TritonBackend(fallback_block_rows=block_rows)


__all__ = ["Backend", "StateView", "UpdateJob", "TorchBackend", "apply_update", "make_backend",
           "triton_available", "BACKEND_NAMES"]
