"""Element-wise optimizer rules, one per file. ``RULES`` maps a name to its rule."""
from .adagrad import Adagrad
from .adam import Adam
from .adamw import AdamW
from .base import NUM_COEFFS, NUM_SLOTS, Rule, StateSpec
from .lion import Lion
from .nadam import NAdam
from .radam import RAdam
from .rmsprop import RMSprop
from .sgd import SGD

RULES: dict[str, type[Rule]] = {r.name: r for r in (AdamW, Adam, NAdam, RAdam, Lion, RMSprop, Adagrad, SGD)}

# Rules that need a row, column, block or global statistic cannot be formed inside one tile.
NOT_ELEMENTWISE = ("Adafactor", "LAMB", "Adam-mini", "SM3", "Muon", "Shampoo")

__all__ = ["RULES", "NOT_ELEMENTWISE", "NUM_COEFFS", "NUM_SLOTS", "Rule", "StateSpec",
           "AdamW", "Adam", "NAdam", "RAdam", "Lion", "RMSprop", "Adagrad", "SGD"]
