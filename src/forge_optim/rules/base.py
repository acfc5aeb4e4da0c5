"""What a rule is: hyper-parameters, state spec, and its element-wise update written twice.

A rule's update is element-wise: each coordinate's new (w, states) depends only on its own
(w, g, states) and a handful of per-step scalars. That is what makes it fusable per tile.

- ``coefficients(group, state, step)`` runs once per parameter per step on the host and turns the
  param group's hyper-parameters (read at backward time, so LR schedulers work) into at most
  ``NUM_COEFFS`` floats; it may advance scalar states (NAdam's ``mu_product``).
- ``update(w, g, states, c)`` is the PyTorch form (fp32 tensors in, fp32 tensors out). It follows
  torch.optim's single-tensor code line by line; it is the torch backend's math.
- ``triton_update(w, g, s0, s1, s2, c0..c7)`` is the same math as a ``@triton.jit`` function, written
  separately; the fused kernel inlines it in its epilogue. Unused state slots pass through.

``maximize`` is applied by the caller (the gradient is negated before the rule sees it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

NUM_COEFFS = 8
NUM_SLOTS = 3


@dataclass(frozen=True)
class StateSpec:
    """One element-wise state tensor: torch.optim's key, its kernel slot, its sign."""

    name: str
    slot: int
    nonnegative: bool = False  # second moments: stored unsigned in int8 mode, floored above zero
    init: str | None = None  # group key holding a non-zero initial value (Adagrad)


class Rule:
    """Base class of an element-wise optimizer rule. Subclasses are stateless namespaces."""

    name: ClassVar[str]
    torch_name: ClassVar[str | None] = None  # torch.optim class with the same update, if any
    defaults: ClassVar[dict[str, Any]]
    scalar_states: ClassVar[dict[str, float]] = {}  # per-parameter scalar state and initial value
    has_step: ClassVar[bool] = True  # torch.optim keeps state['step'] for this rule

    @classmethod
    def state_specs(cls, group: dict) -> tuple[StateSpec, ...]:
        raise NotImplementedError

    @classmethod
    def validate(cls, group: dict) -> None:
        """Raise ValueError naming the bad hyper-parameter, as torch.optim does."""
        _check(group, "lr", lambda v: v >= 0.0, "a learning rate >= 0")
        if "eps" in group:
            _check(group, "eps", lambda v: v >= 0.0, "eps >= 0")
        if "weight_decay" in group:
            _check(group, "weight_decay", lambda v: v >= 0.0, "weight_decay >= 0")
        if "betas" in group:
            b = group["betas"]
            if not (isinstance(b, (tuple, list)) and len(b) == 2):
                raise ValueError(f"{cls.name}: betas must be a pair (beta1, beta2), got {b!r}")
            for i, bi in enumerate(b):
                if not 0.0 <= float(bi) < 1.0:
                    raise ValueError(f"{cls.name}: invalid beta parameter at index {i}: {bi} (need 0 <= beta < 1)")

    @staticmethod
    def coefficients(group: dict, state: dict, step: int) -> tuple[float, ...]:
        raise NotImplementedError

    @staticmethod
    def update(w: torch.Tensor, g: torch.Tensor, s: list, c: tuple) -> tuple[torch.Tensor, list]:
        raise NotImplementedError

    triton_update: ClassVar[Any] = None

    @classmethod
    def padded(cls, coeffs: tuple[float, ...]) -> tuple[float, ...]:
        coeffs = tuple(float(x) for x in coeffs)
        assert len(coeffs) <= NUM_COEFFS, cls.name
        return coeffs + (0.0,) * (NUM_COEFFS - len(coeffs))


def _check(group: dict, key: str, ok, what: str) -> None:
    v = group[key]
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"invalid {key}: {v!r} is a {type(v).__name__}, not a number (need {what}; "
                         f"pass a float, e.g. {key}=1e-3)")
    if not (math.isfinite(v) and ok(v)):
        raise ValueError(f"invalid {key}: {v!r} (need {what})")


def weight_decay_term(group: dict) -> float:
    """One coefficient for either kind of weight decay: > 0 is the decoupled factor 1 - lr*wd,
    <= 0 is minus the L2 coefficient (so -0.0 when there is no decay)."""
    if group["decoupled_weight_decay"]:
        return 1 - group["lr"] * group["weight_decay"]
    return -group["weight_decay"]
