"""Tag execution follows in-place writes into a cache (passes/writes.py: plan_writes; passes/provenance.py).

A preallocated cache that is shifted left in place (eviction), written at constant slices and read back is
read element by element: which key column is which cache slot before the forward, and which is a new token.
Also `index_copy_` at data positions: the new tokens are put last (the probe), the rest of the cache before.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from paged_kv_compile.passes.graph import SDPA_TARGETS
from paged_kv_compile.passes.provenance import provenance
from paged_kv_compile.passes.writes import STORE_METHODS, plan_writes

B, C, H, D, N = 1, 24, 2, 4, 8


def _key_columns(fn, *args) -> list[tuple[str, int]]:
    """Compile `fn` with a backend that reads its SDPA keys' provenance: (leaf name, position) per column."""
    got = []

    def backend(gm: fx.GraphModule, example_inputs):
        sdpa = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS)
        stores = [n for n in gm.graph.nodes
                  if (n.op == "call_method" and n.target in STORE_METHODS)
                  or (n.op == "call_function" and getattr(n.target, "__name__", "") == "setitem")]
        writes, why = plan_writes(sdpa.args[1], stores)
        assert writes is not None, why
        prov, why = provenance(sdpa.args[1], writes)
        assert prov is not None, why
        got.extend((leaf.name, pos) for leaf, pos in prov.columns)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    return got


def _rolling(q, k, cache):
    """Self-Forcing's full-window step with constant indices: evict N, shift left, write at the end, read all."""
    cache[:, 0:C - N] = cache[:, N:C].clone()
    cache[:, C - N:C] = k
    return F.scaled_dot_product_attention(q.transpose(1, 2), cache[:, 0:C].transpose(1, 2),
                                          cache[:, 0:C].transpose(1, 2))


def _filling(q, k, cache):
    """Before the window is full: write at [8, 16), read [0, 16)."""
    cache[:, 8:16] = k
    return F.scaled_dot_product_attention(q.transpose(1, 2), cache[:, 0:16].transpose(1, 2),
                                          cache[:, 0:16].transpose(1, 2))


def _static_cache(q, k, cache, positions):
    """Tencent's HunyuanStaticCache: index_copy_ at data positions, then the whole cache."""
    cache.index_copy_(2, positions, k)
    return F.scaled_dot_product_attention(q, cache, cache)


def _names(cols):
    return [("cache" if "cache" in name else "new", pos) for name, pos in cols]


def test_eviction_shift_and_write_are_followed():
    q, k, cache = torch.randn(B, N, H, D), torch.randn(B, N, H, D), torch.zeros(B, C, H, D)
    cols = _names(_key_columns(_rolling, q, k, cache))
    assert cols == [("cache", p) for p in range(N, C)] + [("new", p) for p in range(N)]


def test_write_before_the_window_is_full_is_followed():
    q, k, cache = torch.randn(B, N, H, D), torch.randn(B, N, H, D), torch.zeros(B, C, H, D)
    cols = _names(_key_columns(_filling, q, k, cache))
    assert cols == [("cache", p) for p in range(8)] + [("new", p) for p in range(N)]


def test_index_copy_at_data_positions_puts_the_new_tokens_last():
    q, k, cache = torch.randn(B, H, N, D), torch.randn(B, H, N, D), torch.zeros(B, H, C, D)
    cols = _names(_key_columns(_static_cache, q, k, cache, torch.arange(3, 3 + N)))
    assert cols == [("cache", p) for p in range(C - N)] + [("new", p) for p in range(N)]


def _rolling_match(fn, *args):
    """The rolling-cache idiom's reading of `fn`'s attention site, its `cache` argument a stand-in."""
    from paged_kv_compile.passes.idioms import ROLLING_CACHE
    from paged_kv_compile.passes.site import analyze
    from paged_kv_compile.passes.writes import store_nodes

    got = []

    def backend(gm: fx.GraphModule, example_inputs):
        standins = {n for n in gm.graph.nodes if n.op == "placeholder" and "cache" in n.name}
        sdpa = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS)
        site = analyze(sdpa, standins, store_nodes(gm.graph, standins), set())
        got.append(site if isinstance(site, str) else ROLLING_CACHE.match(site))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    return got[0]


def _recent_only(q, k, cache):
    """Writes the chunk after 16 history slots but attends over slots [8, 24): skips the oldest history."""
    cache[:, 16:24] = k
    return F.scaled_dot_product_attention(q.transpose(1, 2), cache[:, 8:24].transpose(1, 2),
                                          cache[:, 8:24].transpose(1, 2))


def test_rolling_frames_match_with_their_history_count_and_sink():
    """A frame of a rolling in-place cache reads a constant number of history slots (passes/idioms/window.py:
    match_rolling): the evicting step reads 16 (no sink read separately), the filling step a prefix of 8."""
    q, k, cache = torch.randn(B, N, H, D), torch.randn(B, N, H, D), torch.zeros(B, C, H, D)
    rolled = _rolling_match(_rolling, q, k, cache)
    assert rolled.pattern == "rolling-cache", rolled
    assert (rolled.expect.history_tokens, rolled.expect.sink_tokens, rolled.expect.chunk_tokens) == (16, 0, N)
    filling = _rolling_match(_filling, q, k, cache)
    assert (filling.expect.history_tokens, filling.expect.sink_tokens) == (8, None)


def test_rolling_frame_that_skips_cache_slots_is_refused():
    """Reading only part of what the cache holds is not the runtime's window (sink + most recent): refused,
    even though its history count (8) could agree with a session's."""
    q, k, cache = torch.randn(B, N, H, D), torch.randn(B, N, H, D), torch.zeros(B, C, H, D)
    why = _rolling_match(_recent_only, q, k, cache)
    assert isinstance(why, str) and "from slot 0 up to the end of the new chunk" in why, why
