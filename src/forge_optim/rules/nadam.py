"""NAdam with momentum decay (torch.optim.NAdam), L2 or decoupled weight decay."""
from __future__ import annotations

from .._triton import fast_div, jit, tl  # noqa: F401
from ._moments import ADAM_STATES, adam_moments, adam_moments_tl, apply_weight_decay, apply_weight_decay_tl
from .base import Rule, weight_decay_term


class NAdam(Rule):
    name = "NAdam"
    torch_name = "NAdam"
    defaults = dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
                    decoupled_weight_decay=False, maximize=False)
    scalar_states = {"mu_product": 1.0}

    @classmethod
    def state_specs(cls, group):
        return ADAM_STATES

    @classmethod
    def validate(cls, group):
        super().validate(group)
        if not group["momentum_decay"] >= 0.0:
            raise ValueError(f"invalid momentum_decay: {group['momentum_decay']} (need >= 0)")

    @staticmethod
    def coefficients(group, state, step):
        beta1, beta2 = group["betas"]
        lr, md = group["lr"], group["momentum_decay"]
        mu = beta1 * (1.0 - 0.5 * (0.96 ** (step * md)))
        mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * md)))
        # torch keeps mu_product as an fp32 tensor and multiplies in fp32: do the same.
        state["mu_product"] *= mu
        mu_product = state["mu_product"].item()
        return (weight_decay_term(group), 1 - beta1, beta2, 1 - beta2, group["eps"],
                1 - beta2**step,
                -lr * (1.0 - mu) / (1.0 - mu_product),
                -lr * mu_next / (1.0 - mu_product * mu_next))


    @staticmethod
    def update(w, g, s, c):
        wd_term, omb1, beta2, omb2, eps, bc2, c_grad, c_avg = c[:8]
        w, g = apply_weight_decay(w, g, wd_term)
        m, v = adam_moments(*s, g, omb1, beta2, omb2)
        denom = (v / bc2).sqrt() + eps
        w = w + c_grad * (g / denom)
        w = w + c_avg * (m / denom)
        return w, [m, v]

    @staticmethod
    @jit
    def triton_update(w, g, s0, s1, s2, wd_term, omb1, beta2, omb2, eps, bc2, c_grad, c_avg):
        w, g = apply_weight_decay_tl(w, g, wd_term)
        s0, s1 = adam_moments_tl(s0, s1, g, omb1, beta2, omb2)
        denom = tl.sqrt(s1 * (1.0 / bc2)) + eps
        w = w + c_grad * fast_div(g, denom)
        w = w + c_avg * fast_div(s0, denom)
        return w, s0, s1, s2

