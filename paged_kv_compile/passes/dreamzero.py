"""DreamZero's sliding-window idiom.

Dense code: ``new_k = cat([cache[0], roped_k], 1)[:, -window:]`` (optionally with the first `sink`
tokens kept), ``k = cat([new_k, k_action])``, non-causal attention, ``stack([new_k, new_v])``
returned. Read structurally, its key columns are: a run of cache positions (``[0, sink)`` then
``[sink + chunk, window)``), then every new chunk token, then every action token. Which new tokens
are the chunk is read from the graph (those concatenated with the cache history), not from
which tensor they come from: vllm-omni ropes [video | registers] in one call and slices both out of it.
The runtime's window/sink plan supplies exactly those history positions from the pool.
"""

from __future__ import annotations

from ..families.dreamzero import DreamZeroExpect
from .site import Match, Site


def match(site: Site) -> Match | str:
    """A `Match` for the window idiom, or why this site is not one."""
    if site.standin_ndim != 5:
        return "history does not come from a (2, B, L, H, D) cache stand-in"
    if site.args["attn_mask"] is not None or site.args["is_causal"]:
        return "DreamZero's window attention is non-causal and unmasked; this site has a mask or is_causal"
    if site.k_kv_index != 0 or site.v_kv_index != 1:
        return "keys must come from cache[0] and values from cache[1]"
    hist = site.history_positions
    window = site.standin_seq_len
    chunk = site.window_new_tokens
    if chunk is None:
        return "its keys never join cache history with new keys in one concatenation (cat([cache, new])[:, -window:])"
    if len(hist) != window - chunk:
        return f"the window keeps {len(hist)} history tokens; expected window - chunk = {window - chunk}"
    sink = 0
    while sink < len(hist) and hist[sink] == sink:
        sink += 1
    if hist[sink:] != list(range(sink + chunk, window)):
        return "history positions are not a sink followed by the most recent window tokens"
    expect = DreamZeroExpect(
        window_tokens=window, sink_tokens=sink, chunk_tokens=chunk, action_tokens=sum(site.new_sizes) - chunk
    )
    return Match("dreamzero-window", expect, visibility="full")
