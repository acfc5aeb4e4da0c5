"""AdamW: Adam with decoupled weight decay (torch.optim.AdamW)."""
from __future__ import annotations

import math

from .._triton import fast_div, jit, tl  # noqa: F401  (tl is used inside the jitted function)
from ._moments import ADAM_STATES, adam_moments, adam_moments_tl
from .base import Rule


class AdamW(Rule):
    name = "AdamW"
    torch_name = "AdamW"
    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, maximize=False)

    @classmethod
    def state_specs(cls, group):
        return ADAM_STATES

    @staticmethod
    def coefficients(group, state, step):
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        # 1 - beta and 1 - lr*wd are formed here in fp64, as torch.optim forms them in Python
        return (1 - lr * group["weight_decay"], 1 - beta1, beta2, 1 - beta2, group["eps"],
                lr / bias_correction1, math.sqrt(bias_correction2))

    @staticmethod
    def update(w, g, s, c):
        decay, omb1, beta2, omb2, eps, step_size, bc2_sqrt = c[:7]
        w = w * decay
        m, v = adam_moments(*s, g, omb1, beta2, omb2)
        denom = v.sqrt() / bc2_sqrt + eps
        w = w - step_size * (m / denom)
        return w, [m, v]

    @staticmethod
    @jit
    def triton_update(w, g, s0, s1, s2, decay, omb1, beta2, omb2, eps, step_size, bc2_sqrt, c7):
        w = w * decay
        s0, s1 = adam_moments_tl(s0, s1, g, omb1, beta2, omb2)
        denom = tl.sqrt(s1) * (1.0 / bc2_sqrt) + eps
        w = w - step_size * fast_div(s0, denom)
        return w, s0, s1, s2
