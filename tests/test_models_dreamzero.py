"""DreamZero dense reference: window semantics, rollout loop, hooks, and compile hygiene."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from paged_kv_compile.models import DREAMZERO_14B, DenseHooks, DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.models.common import apply_rope_3d


@pytest.fixture(scope="module")
def model() -> DreamZeroModel:
    return DreamZeroModel(DreamZeroConfig(), seed=0).eval()


@pytest.fixture(scope="module")
def sink_model() -> DreamZeroModel:
    return DreamZeroModel(DreamZeroConfig(sink_size=1, image_len=4), seed=0).eval()


def block_inputs(model: DreamZeroModel, cache_len: int, start_frame: int = 4, seed: int = 0):
    """Inputs of one block forward at the tiny config, with a random cache of `cache_len` tokens."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    B, H, D = 2, cfg.num_heads, cfg.head_dim
    x = torch.randn(B, cfg.tokens_per_forward, cfg.dim, generator=g)
    e = torch.randn(B, 6, cfg.dim, generator=g) * 0.1
    cos, sin = model.rope_tables(start_frame, cfg.num_frame_per_block)
    kv_cache = torch.randn(2, B, cache_len, H, D, generator=g)
    cross_kv = torch.randn(2, B, cfg.cross_len, H, D, generator=g)
    return x, e, cos, sin, kv_cache, cross_kv


class RecordingHooks(DenseHooks):
    """Dense hooks that log every call, and the current forward kind for block-level probes."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.kind: str | None = None

    def caches(self, model, batch, **geometry):
        self.events.append(("caches", batch))
        return super().caches(model, batch, **geometry)

    @contextlib.contextmanager
    def forward(self, kind, **info):
        self.events.append((kind, info))
        self.kind = kind
        try:
            yield
        finally:
            self.kind = None

    def reset_history(self):
        self.events.append(("window_reset",))


# ---- config ----------------------------------------------------------------------------------


def test_config_derived_sizes():
    cfg = DreamZeroConfig()
    assert cfg.max_attention_size == 6 * 16
    assert cfg.chunk_tokens == 32 and cfg.tokens_per_forward == 37
    assert cfg.grid_hw == (4, 4) and sum(cfg.rope_pairs) == cfg.head_dim // 2
    assert cfg.chunks_per_window == 8
    assert DREAMZERO_14B.max_attention_size == 21 * 880  # unbounded window = 21 frames
    assert DREAMZERO_14B.grid_hw == (22, 40) and DREAMZERO_14B.cross_len == 257 + 512
    assert DREAMZERO_14B.dim == DREAMZERO_14B.num_heads * DREAMZERO_14B.head_dim
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dim=60), "num_heads"),
        (dict(num_frame_per_block=7), "does not fit"),
        (dict(sink_size=5, num_frame_per_block=2), "does not fit"),
        (dict(sink_size=6), "sink_size"),
        (dict(window_reset_frames=15), "multiple"),
        (dict(action_register_length=0), "action_register_length"),
        (dict(frame_hw=(3, 5)), "frame_hw"),
        (dict(local_attn_size=0), "local_attn_size"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DreamZeroConfig(**kwargs)


def test_seeded_init_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    a, b = DreamZeroModel(seed=5), DreamZeroModel(seed=5)
    assert torch.equal(torch.rand(3), want)
    c = DreamZeroModel(seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.self_attn.qkv.weight"], sc["blocks.0.self_attn.qkv.weight"])


# ---- the window idiom --------------------------------------------------------------------------


@pytest.mark.parametrize("use_sink", [False, True])
@pytest.mark.parametrize("cache_len", [0, 32, 64, 96])
def test_block_window_keeps_last_tokens(model, sink_model, use_sink, cache_len):
    m = sink_model if use_sink else model
    cfg, block = m.cfg, m.blocks[1]
    sa = block.self_attn
    x, e, cos, sin, kv_cache, cross_kv = block_inputs(m, cache_len)
    seen = {}
    handle = sa.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0]))
    try:
        with torch.no_grad():
            _, new_cache = block(x, e, cos, sin, kv_cache, cross_kv)
    finally:
        handle.remove()
    with torch.no_grad():  # recompute the chunk's roped video K and V from the attention input
        b, s, _ = seen["x"].shape
        _, k, v = sa.qkv(seen["x"]).view(b, s, 3, cfg.num_heads, cfg.head_dim).unbind(2)
        A = cfg.action_register_length
        roped_k = apply_rope_3d(sa.norm_k(k)[:, :-A], cos, sin)
        v_video = v[:, :-A]
    M, sink = cfg.max_attention_size, cfg.sink_tokens
    if not use_sink:
        want_k = torch.cat([kv_cache[0], roped_k], 1)[:, -M:]
        want_v = torch.cat([kv_cache[1], v_video], 1)[:, -M:]
    else:
        want_k = torch.cat([kv_cache[0][:, :sink], torch.cat([kv_cache[0][:, sink:], roped_k], 1)[:, -(M - sink) :]], 1)
        want_v = torch.cat([kv_cache[1][:, :sink], torch.cat([kv_cache[1][:, sink:], v_video], 1)[:, -(M - sink) :]], 1)
        # the sink is resident: the cache's first tokens survive eviction
        n = min(sink, cache_len)
        assert torch.equal(new_cache[0, :, :n], kv_cache[0, :, :n])
    assert new_cache.shape == (2, 2, min(cache_len + cfg.chunk_tokens, M), cfg.num_heads, cfg.head_dim)
    assert torch.equal(new_cache[0], want_k)
    assert torch.equal(new_cache[1], want_v)


def test_update_flag_is_consumed_by_the_model(model):
    cfg = model.cfg
    caches = DenseHooks().caches(model, 2)
    cross = model.prepare_cross_kv(torch.randn(2, cfg.text_len, cfg.text_dim))
    lat = torch.randn(2, cfg.chunk_tokens, cfg.in_channels)
    act = torch.randn(2, cfg.action_register_length, cfg.action_dim)
    with torch.no_grad():
        *_, kept = model(lat, act, torch.zeros(2), 0, caches, cross, update_kv_cache=False)
        *_, grown = model(lat, act, torch.zeros(2), 0, caches, cross, update_kv_cache=True)
    assert kept is caches
    assert [c.shape[2] for c in grown] == [cfg.chunk_tokens] * cfg.num_layers


# ---- the rollout loop --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(model):
    """One 10-chunk rollout with recording hooks and a probe of the cache length fed to block 0."""
    hooks = RecordingHooks()
    seen = []  # (kind, cache length)
    probe = model.blocks[0].register_forward_pre_hook(lambda mod, args: seen.append((hooks.kind, args[4].shape[2])))
    try:
        out = dreamzero_rollout(model, num_chunks=10, seed=0, hooks=hooks)
    finally:
        probe.remove()
    return out, hooks, seen


def test_rollout_end_to_end_deterministic(model, recorded):
    a = recorded[0]
    b = dreamzero_rollout(model, num_chunks=10, seed=0)  # default DenseHooks: same numbers
    c = dreamzero_rollout(model, num_chunks=2, seed=1)
    cfg = model.cfg
    assert a["video"].shape == (10, cfg.chunk_tokens, cfg.in_channels)
    assert a["actions"].shape == (10, cfg.action_register_length, cfg.action_dim)
    assert torch.isfinite(a["video"]).all() and torch.isfinite(a["actions"]).all()
    assert torch.equal(a["video"], b["video"]) and torch.equal(a["actions"], b["actions"])
    assert not torch.equal(a["video"][:2], c["video"]) and not torch.equal(a["actions"][:2], c["actions"])
    assert a["start_frames"] == [0, 2, 4, 6, 8, 10, 12, 14, 0, 2]
    assert a["resets"] == [7]


def test_rollout_hooks_see_eviction_and_reset(model, recorded):
    cfg = model.cfg
    _, hooks, seen = recorded
    kinds = [ev[0] for ev in hooks.events]
    assert kinds.count("caches") == 2 and kinds.count("window_reset") == 1
    assert kinds.count("commit") == 8 and kinds.count("denoise") == 30
    # the reset follows chunk 7's denoising and is followed by fresh caches, then chunk 8 (no commit)
    r = kinds.index("window_reset")
    assert kinds[r - 1] == "denoise" and kinds[r + 1] == "caches" and kinds[r + 2] == "denoise"
    commits = [ev[1]["start_frame"] for ev in hooks.events if ev[0] == "commit"]
    assert commits == [0, 2, 4, 6, 8, 10, 12, 0]
    denoise = [ev[1]["start_frame"] for ev in hooks.events if ev[0] == "denoise"]
    assert denoise == [f for f in [0, 2, 4, 6, 8, 10, 12, 14, 0, 2] for _ in range(3)]
    assert [ev[1]["step"] for ev in hooks.events if ev[0] == "denoise"][:3] == [0, 1, 2]
    # the window fills to max_attention_size, then slides (commits at a full window evict), then resets
    M = cfg.max_attention_size
    assert [n for k, n in seen if k == "commit"] == [0, 32, 64, M, M, M, M, 0]
    assert [n for k, n in seen if k == "denoise"][::3] == [0, 32, 64, M, M, M, M, M, 0, 32]


def test_rollout_with_sink_and_image_tokens(sink_model):
    cfg = sink_model.cfg
    out = dreamzero_rollout(sink_model, num_chunks=10, num_inference_steps=2, seed=3)
    assert torch.isfinite(out["video"]).all() and out["resets"] == [7]
    ckv = sink_model.prepare_cross_kv(torch.randn(2, cfg.text_len, cfg.text_dim), torch.randn(2, 4, cfg.image_dim))
    assert ckv[0].shape == (2, 2, cfg.image_len + cfg.text_len, cfg.num_heads, cfg.head_dim)
    with pytest.raises(ValueError, match="image_context"):
        sink_model.prepare_cross_kv(torch.randn(2, cfg.text_len, cfg.text_dim))


# ---- compile ------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_sink", [False, True])
def test_block_compiles_fullgraph_aot_eager(model, sink_model, use_sink):
    m = sink_model if use_sink else model
    torch._dynamo.reset()
    block = m.blocks[0]
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    for cache_len in (64, 96):  # partly full and full (evicting) window
        args = block_inputs(m, cache_len)
        with torch.no_grad():
            want_x, want_c = block(*args)
            got_x, got_c = compiled(*args)
        torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_c, want_c, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # a cold Inductor C++ cache costs ~30 s
def test_block_compiles_fullgraph_inductor(model):
    torch._dynamo.reset()
    block = model.blocks[0]
    compiled = torch.compile(block, fullgraph=True)
    args = block_inputs(model, 96)
    with torch.no_grad():
        want_x, want_c = block(*args)
        got_x, got_c = compiled(*args)
    torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_c, want_c, rtol=1e-5, atol=1e-5)


def test_all_blocks_and_both_kinds_share_one_graph():
    """No layer index in the block: 4 blocks x (commit, denoise) at one shape compile one frame."""
    torch._dynamo.reset()
    m = DreamZeroModel(DreamZeroConfig(), seed=1).eval()
    cfg = m.cfg
    counter = torch._dynamo.testing.CompileCounter()
    for i, block in enumerate(m.blocks):
        m.blocks[i] = torch.compile(block, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 2, 64, cfg.num_heads, cfg.head_dim, generator=g) for _ in range(cfg.num_layers)]
    cross = m.prepare_cross_kv(torch.randn(2, cfg.text_len, cfg.text_dim, generator=g))
    lat = torch.randn(2, cfg.chunk_tokens, cfg.in_channels, generator=g)
    act = torch.randn(2, cfg.action_register_length, cfg.action_dim, generator=g)
    with torch.no_grad():
        m(lat, act, torch.zeros(2), 2, caches, cross, update_kv_cache=True)
        m(lat, act, torch.full((2,), 500.0), 4, caches, cross, update_kv_cache=False)
    assert counter.frame_count == 1
