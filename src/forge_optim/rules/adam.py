"""Adam with L2 (coupled) weight decay (torch.optim.Adam, decoupled_weight_decay=False)."""
from __future__ import annotations

import math

from .._triton import fast_div, jit, tl  # noqa: F401
from ._moments import ADAM_STATES, adam_moments, adam_moments_tl
from .base import Rule


class Adam(Rule):
    name = "Adam"
    torch_name = "Adam"
    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, maximize=False)

    @classmethod
    def state_specs(cls, group):
        return ADAM_STATES

    @staticmethod
    def coefficients(group, state, step):
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        return (group["weight_decay"], 1 - beta1, beta2, 1 - beta2, group["eps"],
                lr / (1 - beta1**step), math.sqrt(1 - beta2**step))

    @staticmethod
    def update(w, g, s, c):
        wd, omb1, beta2, omb2, eps, step_size, bc2_sqrt = c[:7]
        if wd != 0:
            g = g + w * wd
        m, v = adam_moments(*s, g, omb1, beta2, omb2)
        denom = v.sqrt() / bc2_sqrt + eps
        w = w - step_size * (m / denom)
        return w, [m, v]

    @staticmethod
    @jit
    def triton_update(w, g, s0, s1, s2, wd, omb1, beta2, omb2, eps, step_size, bc2_sqrt, c7):
        g = g + w * wd
        s0, s1 = adam_moments_tl(s0, s1, g, omb1, beta2, omb2)
        denom = tl.sqrt(s1) * (1.0 / bc2_sqrt) + eps
        w = w - step_size * fast_div(s0, denom)
        return w, s0, s1, s2
