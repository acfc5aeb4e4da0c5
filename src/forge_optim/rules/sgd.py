"""SGD with momentum, dampening and Nesterov (torch.optim.SGD)."""
from __future__ import annotations

from .._triton import jit, tl  # noqa: F401
from .base import Rule, StateSpec


class SGD(Rule):
    name = "SGD"
    torch_name = "SGD"
    defaults = dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
    has_step = False  # torch.optim.SGD keeps no step; forge keeps one (stochastic-rounding seed)

    @classmethod
    def state_specs(cls, group):
        return (StateSpec("momentum_buffer", 0),) if group["momentum"] != 0 else ()

    @classmethod
    def validate(cls, group):
        super().validate(group)
        if group["momentum"] < 0.0:
            raise ValueError(f"invalid momentum value: {group['momentum']} (need >= 0)")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    @staticmethod
    def coefficients(group, state, step):
        momentum = group["momentum"]
        first = step == 1  # torch starts the buffer as a copy of the gradient, undamped
        return (group["lr"], group["weight_decay"], 0.0 if first else momentum,
                1.0 if first else 1.0 - group["dampening"], momentum if group["nesterov"] else 0.0,
                1.0 if momentum != 0 else 0.0)

    @staticmethod
    def update(w, g, s, c):
        lr, wd, buf_decay, grad_scale, nesterov_momentum, has_buf = c[:6]
        if wd != 0:
            g = g + w * wd
        if has_buf:
            (buf,) = s
            buf = buf * buf_decay + g * grad_scale
            g = g + buf * nesterov_momentum if nesterov_momentum != 0 else buf
            s = [buf]
        w = w - lr * g
        return w, s

    @staticmethod
    @jit
    def triton_update(w, g, s0, s1, s2, lr, wd, buf_decay, grad_scale, nesterov_momentum, has_buf, c6, c7):
        g = g + w * wd
        if has_buf != 0:
            s0 = s0 * buf_decay + g * grad_scale
            if nesterov_momentum != 0:
                g = g + s0 * nesterov_momentum
            else:
                g = s0
        w = w - lr * g
        return w, s0, s1, s2
