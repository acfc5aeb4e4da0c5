"""Lion (Chen et al., 2023): sign of an interpolated momentum, decoupled weight decay.

torch.optim has no Lion; the tests check this against an independent reference written from the
paper's Algorithm 2 (tests/reference_optimizers.py).
"""
from __future__ import annotations

import torch

from .._triton import jit, tl  # noqa: F401
from .base import Rule, StateSpec


class Lion(Rule):
    name = "Lion"
    torch_name = None
    defaults = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False)

    @classmethod
    def state_specs(cls, group):
        return (StateSpec("exp_avg", 0),)

    @staticmethod
    def coefficients(group, state, step):
        beta1, beta2 = group["betas"]
        return (1 - group["lr"] * group["weight_decay"], group["lr"], beta1, 1 - beta1, beta2, 1 - beta2)

    @staticmethod
    def update(w, g, s, c):
        decay, lr, beta1, omb1, beta2, omb2 = c[:6]
        (m,) = s
        w = w * decay
        direction = torch.sign(m * beta1 + g * omb1)
        w = w - lr * direction
        m = m * beta2 + g * omb2
        return w, [m]

    @staticmethod
    @jit
    def triton_update(w, g, s0, s1, s2, decay, lr, beta1, omb1, beta2, omb2, c6, c7):
        w = w * decay
        c = s0 * beta1 + g * omb1
        direction = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
        w = w - lr * direction
        s0 = s0 * beta2 + g * omb2
        return w, s0, s1, s2
