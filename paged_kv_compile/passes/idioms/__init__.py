"""The attention idioms the passes rewrite (see `base.py`); families list the ones they accept."""

from .base import Expectation, Idiom, Match
from .lingbot import CAPACITY_WINDOW, CapacityWindowExpect
from .mask import mask_problem
from .prefix import PREFILL_STORE, PREFIX_STEP, STATIC_CACHE, PrefixExpect
from .window import ROLLING_CACHE, WINDOW, RollingExpect, WindowExpect

__all__ = [
    "CAPACITY_WINDOW",
    "CapacityWindowExpect",
    "Expectation",
    "Idiom",
    "Match",
    "PREFILL_STORE",
    "PREFIX_STEP",
    "PrefixExpect",
    "ROLLING_CACHE",
    "RollingExpect",
    "STATIC_CACHE",
    "WINDOW",
    "WindowExpect",
    "mask_problem",
]
