"""Which idiom an attention site is: every idiom the registered families accept is asked; exactly one must match."""

from __future__ import annotations

from .. import families
from .idioms import Match
from .site import Site


def match_site(site: Site) -> Match | str:
    """The one idiom of the registered families that `site` is, or why it is none of them (or several: a site two
    idioms match is ambiguous and refused, both named, rather than rewritten by whichever is asked first)."""
    hits, reasons = [], []
    for idiom, accepted_by in families.accepted_idioms():
        got = idiom.match(site)
        if isinstance(got, Match):
            hits.append((idiom, accepted_by, got))
        else:
            reasons.append(f"{idiom.name}: {got}")
    if len(hits) == 1:
        return hits[0][2]
    if hits:
        return ("ambiguous: it matches " + " and ".join(
            f"idiom {idiom.name!r} (accepted by {', '.join(by)})" for idiom, by, _ in hits)
            + "; one site must be one idiom: make one family's idiom stricter or do not register both families")
    return "; ".join(reasons) or "no registered family accepts an idiom"
