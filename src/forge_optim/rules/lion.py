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
        return (group["lr"], group["weight_decay"], beta1, beta2)

    @staticmethod
    def update(w, g, s, c):
        lr, wd, beta1, beta2 = c[:4]
        (m,) = s
        w = w * (1 - lr * wd)
        direction = torch.sign(m * beta1 + g * (1 - beta1))
        w = w - lr * direction
        m = m * beta2 + g * (1 - beta2)
        return w, [m]

    @staticmethod
    @jit
    def triton_update(w, g, s0, s1, s2, lr, wd, beta1, beta2, c4, c5, c6, c7):
        w = w * (1 - lr * wd)
        c = s0 * beta1 + g * (1 - beta1)
        direction = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
        w = w - lr * direction
        s0 = s0 * beta2 + g * (1 - beta2)
        return w, s0, s1, s2
