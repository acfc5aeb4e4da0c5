"""Adagrad with learning-rate decay (torch.optim.Adagrad)."""
from __future__ import annotations

from .._triton import fast_div, jit, tl  # noqa: F401
from .base import Rule, StateSpec


class Adagrad(Rule):
    name = "Adagrad"
    torch_name = "Adagrad"
    defaults = dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                    maximize=False)

    @classmethod
    def state_specs(cls, group):
        return (StateSpec("sum", 0, nonnegative=True, init="initial_accumulator_value"),)

    @classmethod
    def validate(cls, group):
        super().validate(group)
        if not 0.0 <= group["lr_decay"]:
            raise ValueError(f"invalid lr_decay value: {group['lr_decay']} (need >= 0)")
        if not 0.0 <= group["initial_accumulator_value"]:
            raise ValueError(f"invalid initial_accumulator_value: {group['initial_accumulator_value']} (need >= 0)")

    @staticmethod
    def coefficients(group, state, step):
        clr = group["lr"] / (1 + (step - 1) * group["lr_decay"])
        return (clr, group["weight_decay"], group["eps"])

    @staticmethod
    def update(w, g, s, c):
        clr, wd, eps = c[:3]
        if wd != 0:
            g = g + w * wd
        (acc,) = s
        acc = acc + g * g
        w = w - clr * (g / (acc.sqrt() + eps))
        return w, [acc]

    @staticmethod
    @jit
    def triton_update(w, g, s0, s1, s2, clr, wd, eps, c3, c4, c5, c6, c7):
        g = g + w * wd
        s0 = s0 + g * g
        w = w - clr * fast_div(g, tl.sqrt(s0) + eps)
        return w, s0, s1, s2
