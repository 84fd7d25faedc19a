"""The model families the runtime serves, one module each, behind the `Family` protocol (`base.py`).

Adding a family: write `families/<name>.py` implementing `Family` (and its reference model under
`models/`), then add its instance to `FAMILIES` below.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigError, RequestError
from .base import Expectation, Family, ForwardPlan, Owner
from .dreamzero import DREAMZERO, DreamZeroExpect, DreamZeroSpec
from .hunyuan_image3 import HUNYUAN_IMAGE3, HunyuanExpect, HunyuanSpec

FAMILIES: tuple[Family, ...] = (DREAMZERO, HUNYUAN_IMAGE3)
_BY_NAME = {f.name: f for f in FAMILIES}


def register(family: Family) -> Family:
    """Add a family (e.g. from a plug-in or a test); a name can be registered once."""
    global FAMILIES
    if _BY_NAME.get(family.name, family) is not family:
        raise ConfigError(f"a different family is already registered as {family.name!r}")
    if family.name not in _BY_NAME:
        _BY_NAME[family.name] = family
        FAMILIES = FAMILIES + (family,)
    return family


def unregister(name: str) -> None:
    """Remove a family added with `register` (the built-in ones stay)."""
    global FAMILIES
    if name in (DREAMZERO.name, HUNYUAN_IMAGE3.name):
        raise ConfigError(f"{name!r} is a built-in family")
    family = _BY_NAME.pop(name, None)
    FAMILIES = tuple(f for f in FAMILIES if f is not family)


def get(name: str) -> Family:
    """The family registered under `name`."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(f"unknown model family {name!r}; known: {', '.join(_BY_NAME)}") from None


def for_spec(spec: Any) -> Family:
    """The family whose spec type `spec` is."""
    for family in FAMILIES:
        if isinstance(spec, family.spec_type):
            return family
    raise RequestError(
        f"{type(spec).__name__} is no family's spec; use one of "
        + ", ".join(f.spec_type.__name__ for f in FAMILIES)
    )


def for_model(model: torch.nn.Module) -> Family:
    """The family of a reference model."""
    for family in FAMILIES:
        if family.owns_model(model):
            return family
    raise ConfigError(
        f"no model family knows {type(model).__name__}; build CapturedBlocks(blocks, runtime, "
        "example_inputs=fn) with fn(bucket) -> (args, kwargs) of one block call, or add a family "
        "module under paged_kv_compile/families/"
    )


__all__ = [
    "FAMILIES",
    "DREAMZERO",
    "HUNYUAN_IMAGE3",
    "DreamZeroExpect",
    "DreamZeroSpec",
    "Expectation",
    "Family",
    "ForwardPlan",
    "HunyuanExpect",
    "HunyuanSpec",
    "Owner",
    "for_model",
    "for_spec",
    "get",
    "register",
    "unregister",
]
