"""What an idiom is: a named structural matcher over a `passes.site.Site`, and what it expects at run time.

Idioms are the matching unit of the passes. Each is declared once (`window.py`, `prefix.py`, or a family's own
module) and each family says which idioms its owners may run (`Family.idioms`). The rewrite pass asks every
accepted idiom of every registered family about every attention site: exactly one must match, else the site is
refused (ambiguous when two match, with both named). The expectation a match records is checked against the live
owner at every call: its family must accept the idiom, then checks the values (`Family.check_expectation`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable


@runtime_checkable
class Expectation(Protocol):
    """What a compiled attention site assumes about the forward it runs in: a frozen dataclass per idiom.

    `idiom` names the idiom that built it; `context` is the dense cache length the site was compiled for.
    """

    idiom: str

    @property
    def context(self) -> int: ...


@dataclass
class Match:
    """An idiom recognized at a site; `expect` is checked against the live owner at call time.

    visibility: the op's hint for vendor kernels: "full" when every query sees its whole row.
    """

    pattern: str
    expect: Expectation
    visibility: str = "general"
    idiom: Idiom | None = None  # the idiom that matched (`passes.match.match_site` sets it): compared by identity


@dataclass(frozen=True)
class Idiom:
    """A named matcher: `match(site)` is a `Match` when the site's structure is this idiom, else why not (a str
    for the pass report)."""

    name: str
    match: Callable[..., "Match | str"]

    def __repr__(self) -> str:
        return f"Idiom({self.name!r})"
