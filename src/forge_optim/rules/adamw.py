"""AdamW: Adam with decoupled weight decay (torch.optim.AdamW)."""
from __future__ import annotations

import math

import torch

from .._triton import jit, tl  # noqa: F401  (tl is used inside the jitted function)
from .base import Rule, StateSpec


class AdamW(Rule):
    name = "AdamW"
    torch_name = "AdamW"
    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, maximize=False)

    @classmethod
    def state_specs(cls, group):
        return (StateSpec("exp_avg", 0), StateSpec("exp_avg_sq", 1, nonnegative=True))

    @staticmethod
    def coefficients(group, state, step):
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        return (lr, group["weight_decay"], beta1, beta2, group["eps"],
                lr / bias_correction1, math.sqrt(bias_correction2))

    @staticmethod
    def update(w, g, s, c):
        lr, wd, beta1, beta2, eps, step_size, bc2_sqrt = c[:7]
        m, v = s
        w = w * (1 - lr * wd)
        m = torch.lerp(m, g, 1 - beta1)
        v = v * beta2 + g * g * (1 - beta2)
        denom = v.sqrt() / bc2_sqrt + eps
        w = w - step_size * (m / denom)
        return w, [m, v]

    @staticmethod
    @jit
    def triton_update(w, g, s0, s1, s2, lr, wd, beta1, beta2, eps, step_size, bc2_sqrt, c7):
        w = w * (1 - lr * wd)
        s0 = s0 + (1 - beta1) * (g - s0)
        s1 = s1 * beta2 + g * g * (1 - beta2)
        denom = tl.sqrt(s1) / bc2_sqrt + eps
        w = w - step_size * (s0 / denom)
        return w, s0, s1, s2
