"""The capacity-window idiom: a fixed-capacity (B, C, H, D) cache filled from slot 0, whose keys are the cache's
first C - chunk slots concatenated with the new chunk, copied back whole into the cache when the forward keeps it.

LingBot-World (vllm-omni 0.30.0, `lingbot_world/transformer.py`: `LingBotSelfAttention._update_cache`) writes it:
``next_key = cat((cache.key[:, :end - chunk], key), 1)`` for a chunk that repeats the latest start (its DMD
probes and clean commit of one block), then ``cache.key[:, :end].copy_(next_key)`` when `update_cache`; the
attention runs over `next_key`. The paged runtime hands the model its cache as stand-ins whose cursor presents a
full cache at the current chunk (`end = C`, `last_start = current_start`): every chunk, the first included (its
history is empty), is then this one graph per phase; what the cache holds (the sink frames and the most recent
ones, C tokens with the chunk) is the session's window, the same rule as LingBot's (`_update_cache`'s new-chunk
branch keeps `sink` tokens and the most recent `C - sink - chunk`).

What the graph shows is "the cache's first C - chunk slots, then the chunk" (and, on a commit, the attended keys
copied back into those slots in order: `writes.writes_back_attended`); which tokens the slots hold, and so the sink,
is the driver's cursor, not the graph's. The runtime supplies its window, so the session's spec must carry the
model's sink (`DreamZeroSpec.from_lingbot_world`; `adapters/vllm_omni_ar_lingbot.check_lingbot_sink` refuses another
before any forward: with another sink the numbers differ once the window slides).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..site import Site
from .base import Idiom, Match
from .window import _unmasked


@dataclass(frozen=True)
class CapacityWindowExpect:
    """What a compiled capacity-window site assumes: the cache capacity C (the window, chunk included), the chunk,
    and whether the forward keeps its K/V (the graph copies the attended keys back: a commit)."""

    window_tokens: int
    chunk_tokens: int
    keeps: bool
    action_tokens: int = 0
    idiom: str = field(default="capacity-window", init=False)

    @property
    def context(self) -> int:
        return self.window_tokens


def match_capacity_window(site: Site) -> Match | str:
    """The capacity-window idiom, or why this site is not one (read structurally on tags, `passes/site.py`)."""
    if site.writes.read_back:
        return "it reads its keys back from the cache after writing it (the rolling-cache idiom)"
    why = _unmasked(site)
    if why:
        return why
    if site.cache.ndim != 4:
        return "its history does not come from a (B, C, H, D) cache stand-in"
    if site.cache.key_half not in (None, 0) or site.cache.value_half not in (None, 1):
        return "keys must come from the key cache and values from the value cache"
    if len(site.keys.new_sizes) != 1:
        return "a capacity-window site attends over one new chunk after the cache history"
    C, chunk = site.cache.length, site.keys.new_sizes[0]
    if site.keys.joining != chunk:
        return "its new chunk does not join the cache history in one concatenation (cat([cache[:, :C - chunk], new]))"
    if site.keys.history != list(range(C - chunk)):
        return (f"it must read the cache's first C - chunk = {C - chunk} slots in order before the new chunk (the cache "
                "as a full window at the current chunk); it reads another set of slots")
    if site.writes.stores and not site.writes.written_back:
        return "it writes the cache with something else than the keys/values it attends over"
    expect = CapacityWindowExpect(window_tokens=C, chunk_tokens=chunk, keeps=bool(site.writes.stores))
    return Match("capacity-window", expect, visibility="full")


CAPACITY_WINDOW = Idiom("capacity-window", match_capacity_window)
