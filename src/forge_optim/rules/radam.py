"""RAdam: Adam with a variance-rectification term (torch.optim.RAdam)."""
from __future__ import annotations

import math

from .._triton import fast_div, jit, tl  # noqa: F401
from ._moments import ADAM_STATES, adam_moments, adam_moments_tl, apply_weight_decay, apply_weight_decay_tl
from .base import Rule, weight_decay_term


class RAdam(Rule):
    name = "RAdam"
    torch_name = "RAdam"
    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False,
                    maximize=False)

    @classmethod
    def state_specs(cls, group):
        return ADAM_STATES

    @staticmethod
    def coefficients(group, state, step):
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * (beta2**step) / bias_correction2
        if rho_t > 5.0:
            rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
            adaptive = 1.0
        else:
            rect, adaptive = 0.0, 0.0
        return (weight_decay_term(group), 1 - beta1, beta2, 1 - beta2, group["eps"],
                lr / bias_correction1, rect * math.sqrt(bias_correction2), adaptive)

    @staticmethod
    def update(w, g, s, c):
        wd_term, omb1, beta2, omb2, eps, lr_bc1, rect_sqrt_bc2, adaptive = c[:8]
        w, g = apply_weight_decay(w, g, wd_term)
        m, v = adam_moments(*s, g, omb1, beta2, omb2)
        if adaptive:  # rectified: lr/bc1 * m * rect * sqrt(bc2) / (sqrt(v) + eps)
            w = w - (m * lr_bc1) * (rect_sqrt_bc2 / (v.sqrt() + eps))
        else:  # variance not yet tractable: un-adapted momentum step
            w = w - m * lr_bc1
        return w, [m, v]

    @staticmethod
    @jit
    def triton_update(w, g, s0, s1, s2, wd_term, omb1, beta2, omb2, eps, lr_bc1, rect_sqrt_bc2, adaptive):
        w, g = apply_weight_decay_tl(w, g, wd_term)
        s0, s1 = adam_moments_tl(s0, s1, g, omb1, beta2, omb2)
        if adaptive != 0:
            w = w - (s0 * lr_bc1) * fast_div(rect_sqrt_bc2, tl.sqrt(s1) + eps)
        else:
            w = w - s0 * lr_bc1
        return w, s0, s1, s2
