"""The fused linear: forward is F.linear; backward computes dX with the old W, then hands
(dY, X) to the weight's :class:`~forge_optim.optim.FusedWeight`, which updates W in place.

The weight gradient is never returned to autograd, so a fused weight's ``.grad`` stays None.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


class Use:
    """One counted forward use of a fused weight; releases its count if its graph is dropped."""

    __slots__ = ("handle", "kind", "done", "__weakref__")

    def __init__(self, handle, kind):
        self.handle, self.kind, self.done = handle, kind, False

    def __del__(self):
        if not self.done and self.kind is not None:
            self.handle.release(self.kind)


class FusedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, handle, use):
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            # Cast as autocast would, and keep the cast copies for backward (dX uses the old W).
            dt = torch.get_autocast_dtype(dev)
            x, w = x.to(dt), weight.to(dt)
            bias = None if bias is None else bias.to(dt)
            with torch.autocast(dev, enabled=False):
                out = F.linear(x, w, bias)
        else:
            w = weight
            out = F.linear(x, w, bias)
        ctx.save_for_backward(x, w)
        ctx.handle, ctx.use = handle, use
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        dy = grad_out.reshape(-1, w.shape[0])
        dx = db = None
        if ctx.needs_input_grad[0]:
            # Invariant 1: dX = dY W with the weight as it was before this step's update.
            dx = (grad_out.to(w.dtype) @ w).to(ctx.x_dtype)
        if ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        ctx.handle.consume(dy, x.reshape(-1, x.shape[-1]), ctx.use)
        return dx, None, db, None, None


def fused_linear(x, weight, bias, handle):
    """Apply the fused linear; counts this call as a pending use of ``weight`` (invariant 2)."""
    return FusedLinearFunction.apply(x, weight, bias, handle, handle.new_use())
