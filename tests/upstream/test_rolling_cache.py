"""The CausVid / Self-Forcing rolling cache (transcribed in self_forcing.py): refused as written; paged once its
indices are kept as a fill state (in place, bounded frames) or once written as the window idiom; with the
original's dense output as the oracle.

Driven as Self-Forcing's pipeline/causal_inference.py drives it: per block of frames, denoising forwards at the
block's start (each overwrites the block's slots) and one clean forward whose K/V stays; the window rolls once
it is full.
"""

from __future__ import annotations

import difflib
import inspect

import pytest
import torch
from helpers import CountingBackend, raises_paged

from paged_kv_compile import PassError
from paged_kv_compile.errors import RequestError
from paged_kv_compile.config import PagedKVConfig
from paged_kv_compile.runtime import PagedKVRuntime
from paged_kv_compile.families.dreamzero import DreamZeroSpec

from .self_forcing import (FillStateSelfAttention, RollingSelfAttention, StaticIndexSelfAttention,
                           WindowSelfAttention)

FRAME, WINDOW_FRAMES, BLOCK_FRAMES, BLOCKS, STEPS = 8, 3, 1, 6, 2
#: the real model's RoPE reads `current_start` (Self-Forcing's causal_rope_apply): a value, not a shape
START_IS_A_VALUE = "L['current_start']"
#: fill states of a 1-frame-chunk, 3-frame window: (local_end, new_block) = (0, new), then (8|16|24, repeat|new)
FILL_STATE_FRAMES = 2 * WINDOW_FRAMES + 1


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = BLOCK_FRAMES * FRAME
    return [([torch.randn(1, n, 32, generator=g) for _ in range(STEPS)], torch.randn(1, n, 32, generator=g))
            for _ in range(BLOCKS)]


def _rolling_dense(module: RollingSelfAttention, blocks, forward=None) -> list[torch.Tensor]:
    cache, outs = module.new_cache(), []
    forward = module if forward is None else forward
    for b, (noisy, clean) in enumerate(blocks):
        start = b * BLOCK_FRAMES * FRAME
        if isinstance(module, FillStateSelfAttention):
            module.start_block(cache)
        outs += [forward(x, cache, start) for x in noisy]
        forward(clean, cache, start)
    return outs


def _session_runtime(module, sink_frames: int = 0) -> PagedKVRuntime:
    rt = PagedKVRuntime(PagedKVConfig(num_layers=1, num_kv_heads=2, head_dim=16, block_size=FRAME,
                                      blocks_per_layer=WINDOW_FRAMES + 1, max_rows=1,
                                      scratch_tokens_per_row=BLOCK_FRAMES * FRAME, kernel="reference"))
    rt.bind([module])
    rt.admit("s", DreamZeroSpec(frame_seqlen=FRAME, chunk_frames=BLOCK_FRAMES, window_frames=WINDOW_FRAMES,
                                sink_frames=sink_frames), rows=1)
    return rt


def _standin_cache(rt: PagedKVRuntime, module) -> dict:
    """The cache dict with its K and V as two views of one writable stacked stand-in (what paged mode hands in)."""
    cache = module.new_cache()
    kv = rt.standin(2, *cache["k"].shape, writable=True)
    cache["k"], cache["v"] = kv[0], kv[1]
    return cache


def _changed_lines(changed, original) -> list[str]:
    """Lines of `changed.forward` that are not in `original.forward` (comments and blank lines ignored)."""
    def code(cls):
        lines = inspect.getsource(cls.forward).splitlines()[1:]
        return [ln.split("  #")[0].rstrip() for ln in lines if ln.strip()]
    diff = difflib.ndiff(code(original), code(changed))
    return [ln[2:] for ln in diff if ln.startswith("+ ")]


def test_fill_state_form_changes_nine_lines_and_equals_the_original_with_bounded_frames():
    """The fill-state form: 9 changed lines; dense, compiled fullgraph, equal to the original eager bit for bit
    with a 1-frame sink over 10 blocks (the window rolls 7 times), and its frames stop growing once the window
    is full: one per fill state (no sink: the paged parity test below counts the same frames)."""
    assert len(_changed_lines(FillStateSelfAttention, RollingSelfAttention)) == 9
    blocks = _inputs() + _inputs(1)[:4]
    for sink in (1,):
        original = RollingSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME, sink_size=sink)
        module = FillStateSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME, sink_size=sink)
        frames = []

        def backend(gm, example_inputs):
            frames.append(gm)
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)
        with torch.no_grad(), torch.compiler.config.patch(dynamic_sources=START_IS_A_VALUE):
            expected = _rolling_dense(original, blocks)
            got = _rolling_dense(module, blocks[:5], compiled)
            after_five = len(frames)
            got += _rolling_dense(module, blocks, compiled)[5 * STEPS:]  # a fresh cache dict: the same frames
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected)), sink
        assert after_five == len(frames) == FILL_STATE_FRAMES, (sink, after_five, len(frames))


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
    rt.admit("s", DreamZeroSpec(frame_seqlen=FRAME, chunk_frames=BLOCK_FRAMES, window_frames=WINDOW_FRAMES),
             rows=1)
    backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)
    standin = rt.standin(2, 1, C, 2, 16)
    got = []
    with torch.no_grad():
        for noisy, clean in blocks:
            for x in noisy:
                with rt.forward("s", "denoise"):
                    got.append(compiled(x, standin)[0])
            with rt.forward("s", "commit"):
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


@pytest.mark.parametrize("sink", [0, 1])
def test_fill_state_rolling_cache_pages_in_place_with_parity(sink):
    """The in-place rolling cache with its indices kept as a fill state, paged (aot_eager), equals the unchanged
    original dense eager bit for bit over 8 blocks (the window fills, then rolls 5 times; with a 1-frame sink):
    denoising forwards go to scratch, the clean forward commits; one frame per fill state."""
    blocks = _inputs() + _inputs(1)[:2]
    with torch.no_grad():
        expected = _rolling_dense(
            RollingSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME, sink_size=sink), blocks)
    module = FillStateSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME, sink_size=sink)
    rt = _session_runtime(module, sink)
    cache = _standin_cache(rt, module)
    backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)
    got = []
    with torch.no_grad(), torch.compiler.config.patch(dynamic_sources=START_IS_A_VALUE):
        for b, (noisy, clean) in enumerate(blocks):
            module.start_block(cache)
            for x in noisy:
                with rt.forward("s", "denoise"):
                    got.append(compiled(x, cache, b * FRAME))
            with rt.forward("s", "commit"):
                compiled(clean, cache, b * FRAME)
    err = max((a - b).abs().max().item() for a, b in zip(got, expected))
    print(f"[figure] fill-state rolling cache (sink {sink} frames) paged vs original dense: max abs error {err:.2e}")
    assert len(got) == len(expected) and err == 0.0, err
    assert backend.frames == FILL_STATE_FRAMES
    assert {r.pattern for res in backend.results for r in res.reports} == {"rolling-cache"}


def test_fill_state_out_of_step_with_the_session_is_refused():
    """The frame reads as many history tokens as its fill state says; the runtime checks at every call that the
    session shows exactly that many. A driver that forgets `start_block` (the frame reads 8, the session shows
    16) or hands in a fresh cache dict (0 vs 16) is refused with the runtime unchanged, never computed."""
    blocks = _inputs()
    module = FillStateSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME)
    rt = _session_runtime(module)
    cache = _standin_cache(rt, module)
    compiled = torch.compile(module, backend=CountingBackend({"inner_compiler": "aot_eager", "strict": True}),
                             fullgraph=True, dynamic=False)
    with torch.no_grad(), torch.compiler.config.patch(dynamic_sources=START_IS_A_VALUE):
        for b, (noisy, clean) in enumerate(blocks[:2]):
            module.start_block(cache)
            for i, x in enumerate(noisy + [clean]):
                with rt.forward("s", "commit" if i == len(noisy) else "denoise"):
                    compiled(x, cache, b * FRAME)
        before = rt.state()
        x = blocks[2][0][0]
        with pytest.raises(RequestError, match="reads 8 history tokens .* shows 16"):  # start_block forgotten
            with rt.forward("s", "denoise"):
                compiled(x, cache, 2 * FRAME)
        assert rt.state() == before
        with pytest.raises(RequestError, match="reads 0 history tokens .* shows 16"):  # a fresh cache dict
            with rt.forward("s", "denoise"):
                compiled(x, _standin_cache(rt, module), 2 * FRAME)
        assert rt.state() == before


def test_rolling_cache_with_absolute_static_indices_is_never_wrong():
    """Forms that still cannot page. Absolute indices kept as Python ints (StaticIndexSelfAttention, dense
    bit-exact with the original): every frame it compiles pages exactly, but dynamo specializes
    `global_end_index`, so every block compiles new frames and the 9th raises FailOnRecompileLimitHit (block 4),
    the runtime unchanged. With the ints in dynamic_sources the slice bounds become symbolic, which the pass
    refuses at the first frame that has them (the in-place write positions are computed in the graph). Never
    computed wrong."""
    blocks = _inputs()
    with torch.no_grad():
        expected = _rolling_dense(RollingSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME), blocks)
        static = _rolling_dense(StaticIndexSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME), blocks)
    assert all(torch.equal(a, b) for a, b in zip(static, expected)), "the static-index change alters the math"
    module = StaticIndexSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME)
    rt = _session_runtime(module)
    cache = _standin_cache(rt, module)
    compiled = torch.compile(module, backend=CountingBackend({"inner_compiler": "aot_eager", "strict": True}),
                             fullgraph=True, dynamic=False)
    got, failed_at = [], None
    with torch.no_grad():
        for b, (noisy, clean) in enumerate(blocks):
            before = rt.state()
            try:
                for i, x in enumerate(noisy + [clean]):
                    with rt.forward("s", "commit" if i == len(noisy) else "denoise"):
                        out = compiled(x, cache, b * FRAME)
                    if i < len(noisy):
                        got.append(out)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                failed_at = b
                assert rt.state() == before
                break
    assert failed_at == 4, failed_at
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and len(got) >= 4 * STEPS
    torch._dynamo.reset()
    module = StaticIndexSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME)
    rt = _session_runtime(module)
    cache = _standin_cache(rt, module)
    compiled = torch.compile(module, backend=CountingBackend({"inner_compiler": "aot_eager", "strict": True}),
                             fullgraph=True, dynamic=False)
    both = "L['current_start'],L['kv_cache']['global_end_index'],L['kv_cache']['local_end_index']"
    with torch.no_grad(), torch.compiler.config.patch(dynamic_sources=both):
        for b, (noisy, clean) in enumerate(blocks[:2]):  # block 0 specializes the zeros; block 1 is symbolic
            before = rt.state()
            try:
                for i, x in enumerate(noisy + [clean]):
                    with rt.forward("s", "commit" if i == len(noisy) else "denoise"):
                        compiled(x, cache, b * FRAME)
            except Exception as e:  # noqa: BLE001 - inspected below
                err = e if isinstance(e, PassError) else (getattr(e, "inner_exception", None) or e.__cause__)
                assert isinstance(err, PassError) and "positions computed in the graph" in str(err), e
                assert rt.state() == before
                break
        else:
            raise AssertionError("symbolic slice bounds were not refused")
