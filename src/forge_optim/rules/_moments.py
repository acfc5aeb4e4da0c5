"""The first and second moment updates shared by the Adam family (AdamW, Adam, NAdam, RAdam),
in torch.optim's operation order, once for PyTorch and once for Triton."""
from __future__ import annotations

import torch

from .._triton import jit, tl  # noqa: F401  (jitted functions need tl in their globals)
from .base import StateSpec

ADAM_STATES = (StateSpec("exp_avg", 0), StateSpec("exp_avg_sq", 1, nonnegative=True))


def adam_moments(m, v, g, omb1: float, beta2: float, omb2: float):
    """exp_avg.lerp_(g, 1-beta1); exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1-beta2)."""
    return torch.lerp(m, g, omb1), v * beta2 + g * g * omb2


@jit
def adam_moments_tl(m, v, g, omb1, beta2, omb2):
    return m + omb1 * (g - m), v * beta2 + g * g * omb2


def apply_weight_decay(w, g, wd_term: float):
    """Decoupled (wd_term > 0: w *= 1 - lr*wd) or L2 (wd_term < 0: g += wd*w); see weight_decay_term."""
    if wd_term > 0:
        return w * wd_term, g
    if wd_term < 0:
        return w, g + w * (-wd_term)
    return w, g


@jit
def apply_weight_decay_tl(w, g, wd_term):
    if wd_term > 0:
        w = w * wd_term
    else:
        g = g - w * wd_term
    return w, g
