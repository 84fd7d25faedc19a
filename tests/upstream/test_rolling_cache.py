"""The CausVid / Self-Forcing rolling cache (transcribed in self_forcing.py): refused as written, paged once
written as the window idiom, with the original's dense output as the oracle.

Driven as Self-Forcing's pipeline/causal_inference.py drives it: per block of frames, denoising forwards at the
block's start (each overwrites the block's slots) and one clean forward whose K/V stays; the window rolls once
it is full.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, raises_paged

from paged_kv_compile import PassError
from paged_kv_compile.config import PagedKVConfig
from paged_kv_compile.runtime import PagedKVRuntime
from paged_kv_compile.families.dreamzero import DreamZeroSpec

from .self_forcing import RollingSelfAttention, StaticIndexSelfAttention, WindowSelfAttention

FRAME, WINDOW_FRAMES, BLOCK_FRAMES, BLOCKS, STEPS = 8, 3, 1, 6, 2


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = BLOCK_FRAMES * FRAME
    return [([torch.randn(1, n, 32, generator=g) for _ in range(STEPS)], torch.randn(1, n, 32, generator=g))
            for _ in range(BLOCKS)]


def _rolling_dense(module: RollingSelfAttention, blocks) -> list[torch.Tensor]:
    cache, outs = module.new_cache(), []
    for b, (noisy, clean) in enumerate(blocks):
        start = b * BLOCK_FRAMES * FRAME
        outs += [module(x, cache, start) for x in noisy]
        module(clean, cache, start)
    return outs


def test_window_rewrite_of_the_rolling_cache_pages_with_parity():
    """The user's change (window idiom) paged == the rolling original dense, through several evictions."""
    blocks = _inputs()
    with torch.no_grad():
        expected = _rolling_dense(RollingSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME), blocks)
    module = WindowSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME)  # same seed: same weights
    n, C = BLOCK_FRAMES * FRAME, module.max_attention_size
    rt = PagedKVRuntime(PagedKVConfig(num_layers=1, num_kv_heads=2, head_dim=16, block_size=FRAME,
                                      blocks_per_layer=WINDOW_FRAMES + 1, max_rows=1, scratch_tokens_per_row=n,
                                      kernel="reference"))
    rt.bind([module])
    rt.open_session("s", DreamZeroSpec(frame_seqlen=FRAME, chunk_frames=BLOCK_FRAMES, window_frames=WINDOW_FRAMES),
                    rows=1)
    backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)
    standin = rt.standin(2, 1, C, 2, 16)
    got = []
    with torch.no_grad():
        for noisy, clean in blocks:
            for x in noisy:
                with rt.dreamzero_forward("s", commit=False):
                    got.append(compiled(x, standin)[0])
            with rt.dreamzero_forward("s", commit=True):
                compiled(clean, standin)
    assert len(got) == len(expected) and BLOCKS * n > C, "the rollout must roll the window"
    err = max((a - b).abs().max().item() for a, b in zip(got, expected))
    print(f"[figure] window rewrite paged vs rolling original dense: max abs error {err:.2e}")
    assert err <= 1e-5, err
    assert backend.frames == 1


def test_rolling_cache_as_written_is_refused():
    """As written, indices come from .item() and the new keys are read back from the cache after an in-place
    write: fullgraph compile fails in dynamo (dense or paged alike), and without fullgraph the paged pass refuses
    the site instead of computing on a stand-in."""
    module = RollingSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME)
    rt = PagedKVRuntime(PagedKVConfig(num_layers=1, num_kv_heads=2, head_dim=16, block_size=FRAME,
                                      blocks_per_layer=WINDOW_FRAMES + 1, max_rows=1, kernel="reference"))
    rt.bind([module])
    cache = module.new_cache()
    cache["k"] = rt.standin(tuple(cache["k"].shape), writable=True)
    cache["v"] = cache["k"]
    x = torch.randn(1, BLOCK_FRAMES * FRAME, 32)
    full = torch.compile(module, backend=CountingBackend({"inner_compiler": "aot_eager"}), fullgraph=True)
    with pytest.raises(Exception, match="item|scalar|Unsupported"), torch.no_grad():
        full(x, cache, 0)
    torch._dynamo.reset()
    partial = torch.compile(module, backend=CountingBackend({"inner_compiler": "aot_eager", "strict": True}))
    with raises_paged(PassError, "read back from a cache stand-in after an in-place write"), torch.no_grad():
        partial(x, cache, 0)


def test_rolling_cache_with_static_indices_is_refused_never_wrong():
    """With its indices made static (Python ints in the cache dict) the rolling cache computes exactly what the
    original does densely, but the paged pass does not page it yet (its history depends on the fill state):
    compiled with paged_kv it is refused at the first forward, with the runtime unchanged, never computed on the
    stand-in."""
    blocks = _inputs()
    with torch.no_grad():
        expected = _rolling_dense(RollingSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME), blocks)
        static = _rolling_dense(StaticIndexSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME), blocks)
    assert all(torch.equal(a, b) for a, b in zip(static, expected)), "the static-index change alters the math"
    module = StaticIndexSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME)
    rt = PagedKVRuntime(PagedKVConfig(num_layers=1, num_kv_heads=2, head_dim=16, block_size=FRAME,
                                      blocks_per_layer=WINDOW_FRAMES + 1, max_rows=1,
                                      scratch_tokens_per_row=BLOCK_FRAMES * FRAME, kernel="reference"))
    rt.bind([module])
    rt.open_session("s", DreamZeroSpec(frame_seqlen=FRAME, chunk_frames=BLOCK_FRAMES, window_frames=WINDOW_FRAMES),
                    rows=1)
    cache = module.new_cache()
    kv = rt.standin(2, *cache["k"].shape, writable=True)  # K and V as two views of one stacked stand-in
    cache["k"], cache["v"] = kv[0], kv[1]
    compiled = torch.compile(module, backend=CountingBackend({"inner_compiler": "aot_eager", "strict": True}),
                             fullgraph=True, dynamic=False)
    before = rt.state()
    with raises_paged(PassError, "cannot be rewritten"), torch.no_grad():
        with rt.dreamzero_forward("s", commit=False):
            compiled(blocks[0][0][0], cache, 0)
    assert rt.state() == before
