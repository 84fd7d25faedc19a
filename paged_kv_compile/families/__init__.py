"""The model families the runtime serves, one module each, behind the `Family` base class (`base.py`).

Adding a family: write `families/<name>.py` with a `Family` subclass (and its reference model), then register an
instance: built-in ones are listed in `FAMILIES` below, others call `register` (a plug-in, a test).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigError, RequestError
from ..passes.idioms import Expectation, Idiom
from .base import Family, ForwardPlan, Owner, missing_members
from .conditioning_prefix import CONDITIONING_PREFIX_FAMILY
from .dreamzero import DREAMZERO
from .hunyuan_image3 import HUNYUAN_IMAGE3

FAMILIES: tuple[Family, ...] = (DREAMZERO, HUNYUAN_IMAGE3, CONDITIONING_PREFIX_FAMILY)
_BUILT_IN = {f.name for f in FAMILIES}
_BY_NAME = {f.name: f for f in FAMILIES}


def _check_family(family: Any) -> None:
    """A family must be a complete `Family`: every attribute set, every abstract method implemented."""
    missing = missing_members(family)
    cls = family if isinstance(family, type) else type(family)
    if missing or not issubclass(cls, Family):
        raise ConfigError(
            f"{cls.__name__} is not a complete Family"
            + (f": it lacks {', '.join(missing)}" if missing else ": subclass paged_kv_compile.families.base.Family")
            + "; implement them (see families/base.py) before registering it"
        )
    for idiom in family.idioms:
        if not isinstance(idiom, Idiom):
            raise ConfigError(f"family {family.name!r} lists {idiom!r} among its idioms; list passes.idioms.Idiom objects")
        for name, other in accepted_idioms():
            if name.name == idiom.name and name is not idiom:
                raise ConfigError(f"family {family.name!r} declares an idiom {idiom.name!r} but another idiom of that "
                                  f"name is accepted by {', '.join(other)}: an idiom name names one matcher")


def register(family: Family | type[Family]) -> Family:
    """Add a family (an instance, or a `Family` subclass to instantiate; e.g. from a plug-in or a test). A family
    that leaves out a required attribute or method is refused here, naming them; a name can be registered once."""
    global FAMILIES
    _check_family(family)
    if isinstance(family, type):
        family = family()
    if _BY_NAME.get(family.name, family) is not family:
        raise ConfigError(f"a different family is already registered as {family.name!r}")
    if family.name not in _BY_NAME:
        _BY_NAME[family.name] = family
        FAMILIES = FAMILIES + (family,)
    return family


def unregister(name: str) -> None:
    """Remove a family added with `register` (the built-in ones stay)."""
    global FAMILIES
    if name in _BUILT_IN:
        raise ConfigError(f"{name!r} is a built-in family")
    family = _BY_NAME.pop(name, None)
    FAMILIES = tuple(f for f in FAMILIES if f is not family)


def get(name: str) -> Family:
    """The family registered under `name` (a '-' in it reads as '_': the command line's `hunyuan-image3`)."""
    family = _BY_NAME.get(name) or _BY_NAME.get(name.replace("-", "_"))
    if family is None:
        raise ConfigError(f"unknown model family {name!r}; known: {', '.join(_BY_NAME)}")
    return family


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


def accepted_idioms() -> list[tuple[Idiom, list[str]]]:
    """Every idiom some registered family accepts, once, with the names of the families that accept it."""
    out: dict[int, tuple[Idiom, list[str]]] = {}
    for family in FAMILIES:
        for idiom in family.idioms:
            out.setdefault(id(idiom), (idiom, []))[1].append(family.name)
    return list(out.values())


def accepts(family: Family, idiom: Idiom | None) -> bool:
    """Whether owners of `family` may run a site of `idiom` (`Family.accepts`: by identity, never by name)."""
    return family.accepts(idiom)


__all__ = [
    "FAMILIES",
    "Expectation",
    "Family",
    "ForwardPlan",
    "Owner",
    "accepted_idioms",
    "accepts",
    "for_model",
    "for_spec",
    "get",
    "register",
    "unregister",
]
