"""The conditioning-prefix idiom: a read-only prefix reused by every denoising step, attended with full visibility.

An image edit's condition image (vllm-omni's GLM-Image: ``key = cat([k_cached, key], dim=1)`` in
`GlmImageAttention`), a unified model's understanding prefix, a robot policy's observation prefix: the prefix K/V
come from a separate forward (or another tower, or the first step) and are kept by the model by attribute
assignment or a return value, not written into a cache the passes see. Every later step concatenates them before
its own keys and attends with no mask: every query sees the whole prefix and every new token.

Read structurally (on tags, `passes/site.py`): the key columns are every position ``[0, P)`` of a (B, P, H, D)
cache stand-in (or, for an attention of one row, a packed (P, H, D) one: BAGEL's `NaiveCache` of one CFG branch),
in order, then the new tokens; there is no mask, no causal flag and no store into the stand-in.
The paged op reads the prefix from the pool, where the owner's family put it once (`families/conditioning_prefix.py`:
`store_prefix`); the new tokens are transient. Every row must hold exactly P prefix tokens: without a mask, a row
whose prefix is shorter would read the dense stand-in's padding, which the paged op does not hold (the family
checks it at every call). Rows of different prefix lengths pass a padding mask instead: that site is the
`prefix-step` idiom (`prefix.py`), which the conditioning-prefix family accepts too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..graph import example
from ..site import Site
from .base import Idiom, Match


@dataclass(frozen=True)
class ConditioningPrefixExpect:
    """What a compiled conditioning-prefix site assumes: every row holds `prefix_tokens` prefix tokens (the dense
    stand-in's length, all of them attended)."""

    prefix_tokens: int
    idiom: str = field(default="conditioning-prefix", init=False)

    @property
    def context(self) -> int:
        return self.prefix_tokens


def match_conditioning_prefix(site: Site) -> Match | str:
    """The conditioning-prefix idiom, or why this site is not one."""
    if site.args["is_causal"]:
        return "is_causal=True: a conditioning prefix is attended with full visibility"
    if site.args["attn_mask"] is not None:
        return ("it passes a mask (a conditioning prefix with a padding mask is the prefix-step idiom; "
                "an unmasked one attends over the whole prefix)")
    if site.writes.stores or site.writes.positioned or site.writes.read_back:
        return "it writes the cache stand-in (a conditioning prefix is read-only: its family stores it once)"
    if site.cache.ndim == 3 and example(site.node).shape[0] != 1:
        return "a packed (P, H, D) prefix stand-in is one row's: its attention must compute one row (batch 1)"
    if site.cache.ndim not in (3, 4):
        return "the conditioning prefix must be a (B, P, H, D) stand-in (or one row's packed (P, H, D))"
    prefix = site.cache.length
    if not site.keys.history:
        return "it reads no prefix before its new keys"
    if site.keys.history != list(range(prefix)):
        return (f"it must read the whole prefix [0, {prefix}) in order before its new keys (it reads "
                f"{len(site.keys.history)} other stand-in columns)")
    return Match("conditioning-prefix", ConditioningPrefixExpect(prefix), visibility="full")


CONDITIONING_PREFIX = Idiom("conditioning-prefix", match_conditioning_prefix)
