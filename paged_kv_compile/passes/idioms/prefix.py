"""Retained-prefix idioms: a masked attention whose cache holds a prompt prefix written once and read at every step.

HunyuanImage-3 writes them three ways: our reference model and vllm-omni store the prefix at the prefill and
concatenate it before the new keys at later steps (`PREFILL_STORE`, `PREFIX_STEP`); Tencent's HunyuanStaticCache
writes every forward's keys into a static cache at `position_ids` (`STATIC_CACHE`). In all three the mask is an
input of the graph: which keys a query sees is the runtime's layout (read from the prefill's mask), so a mask the
graph computes itself cannot be rewritten without risking a wrong answer (`mask.py: mask_problem`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..site import Site
from .base import Idiom, Match
from .mask import mask_problem


@dataclass(frozen=True)
class PrefixExpect:
    """What a compiled prefix site assumes: the dense prefix (or static cache) length it was compiled for."""

    prefix_capacity: int
    idiom: str = field(default="prefix-step", init=True)

    @property
    def context(self) -> int:
        return self.prefix_capacity


def _masked(site: Site) -> str:
    """Why the site's mask rules out a prefix idiom ("" when it has an input mask and is not is_causal)."""
    if site.args["is_causal"]:
        return "is_causal=True is not a prefix idiom (it passes an explicit causal/full mask)"
    if site.args["attn_mask"] is None:
        return "a prefix idiom's attention carries a 4-D mask; this site has none"
    return mask_problem(site.args["attn_mask"])


def match_prefix_step(site: Site) -> Match | str:
    """A later step: the target span's keys after the whole cached prefix, ``cat([cached_key, key])`` after
    ``repeat_kv``, attending with the mask sliced to the target rows. Read structurally, its key columns are cache
    positions ``[0, P)`` of a (B, P, H, D) stand-in, then every new token."""
    why = _masked(site)
    if why:
        return why
    if site.writes.positioned or not site.keys.history:
        return "it reads no cached prefix before its new keys"
    if site.cache.ndim != 4:
        return "the cached prefix must be a (B, P, H, D) stand-in"
    prefix = site.cache.length
    if site.keys.history != list(range(prefix)):
        return "a later step must read the whole cached prefix [0, P) in order before the new tokens"
    if len(site.keys.new_sizes) != 1:
        return "a later step appends one new key tensor after the prefix"
    return Match("prefix-step", PrefixExpect(prefix, "prefix-step"))


def match_prefill_store(site: Site) -> Match | str:
    """The prefill: the whole sequence projected, its first P keys stored into the cache stand-in (per row,
    zero-padded: ``torch.where(valid, key[:, :P], 0)``), attention over the new keys only with the full mask.
    The new keys may come from several tensors joined along the sequence (Ulysses: text prefix, then image)."""
    why = _masked(site)
    if why:
        return why
    if site.writes.positioned or site.keys.history:
        return "it reads cached keys (a prefill attends over its new keys only)"
    if not site.writes.stores:
        return "no cached prefix is read and none is stored: not a KV-cache site"
    # several new key tensors in sequence order: under Ulysses the joint text prefix (this rank's heads of the
    # replicated prompt) then the image tokens an all-to-all received; the op reads them concatenated
    return Match("prefill-store", PrefixExpect(site.writes.length, "prefill-store"))


def match_static_cache(site: Site) -> Match | str:
    """Tencent's HunyuanStaticCache: the new K/V written into a static (B, Hkv, S, D) cache with `index_copy_` at
    `position_ids`, then attention over the whole cache with the mask.

    Read structurally (passes/writes.py: plan_writes), the key columns are the cache columns the new tokens did
    not overwrite, in order, then the new tokens (the probe puts them last). Which dense column holds which
    logical position is the layout read from the prefill mask; the runtime checks `position_ids` against it at
    every call (layout.write_positions_problem), so a write elsewhere is refused, never computed.
    """
    why = _masked(site)
    if why:
        return why
    if not site.writes.positioned:
        return "it writes no keys into a static cache at positions that are a graph input"
    lengths = {write.cache_length for write in site.writes.positioned}
    if len(lengths) != 1:
        return "keys and values are written into caches of different lengths"
    S = lengths.pop()
    if len(site.keys.new_sizes) != 1:
        return "a static-cache site writes one new key tensor"
    T = site.keys.new_sizes[0]
    if site.keys.history != list(range(S - T)):
        return (f"after writing {T} new tokens at position_ids the attention must read the whole static cache "
                f"[0, {S}) in order (it reads {len(site.keys.history)} other cache columns)")
    return Match("static-cache", PrefixExpect(S, "static-cache"))


PREFIX_STEP = Idiom("prefix-step", match_prefix_step)
PREFILL_STORE = Idiom("prefill-store", match_prefill_store)
STATIC_CACHE = Idiom("static-cache", match_static_cache)
