"""RMSprop, optionally centered and with momentum (torch.optim.RMSprop)."""
from __future__ import annotations

import torch

from .._triton import fast_div, jit, tl  # noqa: F401
from .base import Rule, StateSpec


class RMSprop(Rule):
    name = "RMSprop"
    torch_name = "RMSprop"
    defaults = dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False, maximize=False)

    @classmethod
    def state_specs(cls, group):
        specs = [StateSpec("square_avg", 0, nonnegative=True)]
        if group["momentum"] > 0:
            specs.append(StateSpec("momentum_buffer", 1))
        if group["centered"]:
            specs.append(StateSpec("grad_avg", 2))
        return tuple(specs)

    @classmethod
    def validate(cls, group):
        super().validate(group)
        if not 0.0 <= group["alpha"]:
            raise ValueError(f"invalid alpha value: {group['alpha']} (need >= 0)")
        if not 0.0 <= group["momentum"]:
            raise ValueError(f"invalid momentum value: {group['momentum']} (need >= 0)")

    @staticmethod
    def coefficients(group, state, step):
        return (group["lr"], group["weight_decay"], group["alpha"], 1 - group["alpha"], group["eps"],
                group["momentum"], 1.0 if group["centered"] else 0.0)

    @staticmethod
    def update(w, g, s, c):
        lr, wd, alpha, oma, eps, momentum, centered = c[:7]
        if wd != 0:
            g = g + w * wd
        s = list(s)
        sq = s[0] * alpha + g * g * oma
        s[0] = sq
        if centered:
            ga = torch.lerp(s[-1], g, oma)
            s[-1] = ga
            # clamped: in bf16/int8 states rounding can leave sq below ga^2, and a NaN would reach W
            # (torch.optim's fp32 form never goes below 0 there except by round-off, where it gives NaN)
            avg = (sq - ga * ga).clamp_min(0.0).sqrt() + eps
        else:
            avg = sq.sqrt() + eps
        if momentum > 0:
            buf = s[1] * momentum + g / avg
            s[1] = buf
            w = w - lr * buf
        else:
            w = w - lr * (g / avg)
        return w, s

    @staticmethod
    @jit
    def triton_update(w, g, s0, s1, s2, lr, wd, alpha, oma, eps, momentum, centered, c7):
        # slots: s0 = square_avg, s1 = momentum_buffer, s2 = grad_avg
        g = g + w * wd
        s0 = s0 * alpha + g * g * oma
        if centered != 0:
            s2 = s2 + oma * (g - s2)
            avg = tl.sqrt(tl.maximum(s0 - s2 * s2, 0.0)) + eps  # clamped: see the torch form
        else:
            avg = tl.sqrt(s0) + eps
        if momentum > 0:
            s1 = s1 * momentum + fast_div(g, avg)
            w = w - lr * s1
        else:
            w = w - lr * fast_div(g, avg)
        return w, s0, s1, s2
