"""Which idiom an attention site is: every idiom it is handed is asked; exactly one must match.

The idioms come from the caller (the backend hands in those the registered families accept), so what a compile
matches does not depend on whatever a registry holds when dynamo runs the passes.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .idioms import Idiom, Match
from .site import Site

#: idioms to ask, each with the names of the families that accept it (for messages)
AcceptedIdioms = Sequence[tuple[Idiom, Sequence[str]]]


def match_site(site: Site, idioms: AcceptedIdioms) -> Match | str:
    """The one idiom of `idioms` that `site` is, or why it is none of them (or several: a site two idioms match
    is ambiguous and refused, both named, rather than rewritten by whichever is asked first)."""
    hits, reasons = [], []
    for idiom, accepted_by in idioms:
        got = idiom.match(site)
        if isinstance(got, Match):
            hits.append((idiom, accepted_by, got))
        else:
            reasons.append(f"{idiom.name}: {got}")
    if len(hits) == 1:
        idiom, _, got = hits[0]
        return dataclasses.replace(got, idiom=idiom)
    if hits:
        return ("ambiguous: it matches " + " and ".join(
            f"idiom {idiom.name!r} (accepted by {', '.join(by)})" for idiom, by, _ in hits)
            + "; one site must be one idiom: make one family's idiom stricter or do not register both families")
    return "; ".join(reasons) or "no registered family accepts an idiom"
