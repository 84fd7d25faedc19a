"""Sliding-window idioms: a window cache concatenated with new keys and sliced, or a rolling cache written in place.

DreamZero (vllm-omni's and our reference model) writes the first; CausVid / Self-Forcing write the second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..site import Site
from .base import Idiom, Match


@dataclass(frozen=True)
class WindowExpect:
    """What a compiled window site assumes (read from the graph by `match_window`)."""

    window_tokens: int
    sink_tokens: int
    chunk_tokens: int
    action_tokens: int  # register tokens after the chunk that never join the window
    idiom: str = field(default="window", init=False)

    @property
    def context(self) -> int:
        return self.window_tokens


@dataclass(frozen=True)
class RollingExpect:
    """What a compiled frame of a rolling in-place cache with static indices assumes (Self-Forcing's, its
    indices kept as a fill state; read from the graph by `match_rolling`).

    The frame reads `history_tokens` cache slots as they were before the forward plus the new chunk; one frame
    exists per fill state, so the count is a constant of the frame. sink_tokens: the leading run of slots kept
    when the frame reads a gap after it (an evicting frame); None when it reads one contiguous prefix of the
    cache (everything the window holds so far), which fits any sink.
    """

    window_tokens: int
    sink_tokens: int | None
    chunk_tokens: int
    history_tokens: int
    action_tokens: int = 0
    idiom: str = field(default="rolling-cache", init=False)

    @property
    def context(self) -> int:
        return self.window_tokens


def _unmasked(site: Site) -> str:
    if site.args["attn_mask"] is not None or site.args["is_causal"]:
        return "a sliding-window attention is non-causal and unmasked; this site has a mask or is_causal"
    return ""


def _sink_length(history: list[int]) -> int:
    """The leading run 0, 1, 2, ... of history positions: the resident sink."""
    sink = 0
    while sink < len(history) and history[sink] == sink:
        sink += 1
    return sink


def match_window(site: Site) -> Match | str:
    """The window idiom, or why this site is not one.

    Dense code: ``new_k = cat([cache[0], roped_k], 1)[:, -window:]`` (optionally with the first `sink`
    tokens kept), ``k = cat([new_k, k_action])``, non-causal attention, ``stack([new_k, new_v])``
    returned. Read structurally, its key columns are: a run of cache positions (``[0, sink)`` then
    ``[sink + chunk, window)``), then every new chunk token, then every register token. Which new tokens
    are the chunk is read from the graph (those concatenated with the cache history), not from
    which tensor they come from: vllm-omni ropes [video | registers] in one call and slices both out of it.
    The runtime's window/sink plan supplies exactly those history positions from the pool.
    """
    if site.writes.read_back:
        return "it reads its keys back from a cache written in place (the rolling-cache idiom)"
    if site.cache.ndim != 5:
        return "history does not come from a (2, B, L, H, D) cache stand-in"
    why = _unmasked(site)
    if why:
        return why
    if site.cache.key_half != 0 or site.cache.value_half != 1:
        return "keys must come from cache[0] and values from cache[1]"
    hist = site.keys.history
    window = site.cache.length
    chunk = site.keys.joining
    if chunk is None:
        return "its keys never join cache history with new keys in one concatenation (cat([cache, new])[:, -window:])"
    if len(hist) != window - chunk:
        return f"the window keeps {len(hist)} history tokens; expected window - chunk = {window - chunk}"
    sink = _sink_length(hist)
    if hist[sink:] != list(range(sink + chunk, window)):
        return "history positions are not a sink followed by the most recent window tokens"
    expect = WindowExpect(
        window_tokens=window, sink_tokens=sink, chunk_tokens=chunk, action_tokens=sum(site.keys.new_sizes) - chunk
    )
    return Match("window", expect, visibility="full")


def match_rolling(site: Site) -> Match | str:
    """A rolling in-place cache with static indices (Self-Forcing's `CausalWanSelfAttention` with its indices
    kept as a fill state, tests/upstream/self_forcing.py: FillStateSelfAttention): the new chunk is written into
    a preallocated (B, C, H, D) cache at constant slices, possibly after an in-place eviction shift, and attention
    reads the keys/values back from it, every slot from 0 to the end of the new chunk.

    Tag execution (passes/writes.py: plan_writes) says which cache slots, as they were before the forward, the
    attention reads: they must be a leading run (the sink, when a gap follows it) and one contiguous run after
    it, in order, followed by the new chunk. The frame then reads a constant number of history tokens; which
    tokens those slots hold is the dense driver's state, which the stand-in does not have: the owner's family
    checks at every call that the visible history has exactly that many tokens (`RollingExpect.history_tokens`).
    """
    if not site.writes.read_back:
        return "it does not read its keys back from a cache written in place at constant slices"
    why = _unmasked(site)
    if why:
        return why
    if len(site.keys.new_sizes) != 1:
        return "a rolling-cache frame attends over one new chunk after the cache history"
    C, chunk, hist = site.writes.length, site.keys.new_sizes[0], site.keys.history
    if site.cache.length and site.cache.length != C:
        return f"the cache it reads ({site.cache.length} slots) is not the cache it writes ({C} slots)"
    if site.cache.key_half not in (None, 0) or site.cache.value_half not in (None, 1):
        return "keys must come from cache[0] and values from cache[1]"
    if site.writes.read_slots != list(range(len(hist) + chunk)):
        slots = site.writes.read_slots
        return ("after its writes the attention must read the cache from slot 0 up to the end of the new chunk "
                f"(it reads slots {slots[:3]}...{slots[-2:]}): the runtime's window supplies "
                "everything the cache holds, the sink and the most recent tokens")
    sink = _sink_length(hist)
    rest = hist[sink:]
    if rest and rest != list(range(rest[0], rest[0] + len(rest))):
        return ("the cache slots it reads are not a sink followed by one contiguous run: the history it reads "
                "cannot be the runtime's window (sink + most recent tokens)")
    if len(hist) + chunk > C:
        return f"it reads {len(hist)} history tokens plus a {chunk}-token chunk from a {C}-slot cache"
    expect = RollingExpect(window_tokens=C, sink_tokens=sink if rest else None, chunk_tokens=chunk,
                           history_tokens=len(hist))
    return Match("rolling-cache", expect, visibility="full")


WINDOW = Idiom("window", match_window)
ROLLING_CACHE = Idiom("rolling-cache", match_rolling)
