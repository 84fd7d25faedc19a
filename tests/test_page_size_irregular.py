"""Chunks of irregular length and a sink that holds part of a row (TaoMate-H3's schedule, scaled down).

TaoMate-H3 commits chunks of 12/10/10/5 video latents plus a variable number of audio latents and keeps a sink of
video only; vllm-omni gave up its paged pool for it. Here a session built with `DreamZeroSpec.irregular` gives each
forward's chunk length (`runtime.forward(id, kind, tokens=n)`), its sink is the video tokens of the first chunk
(that chunk's audio lies in the row's `kv_gap` once the window slides), the window keeps the most recent tokens
that fit beside the sink and the chunk, at random block sizes. No TaoMate-H3 code is installed, so the oracles are
the dense cache's own window (which history tokens each forward sees, token by token) and dense eager attention
over the row's whole history with an explicit mask of what that window shows (fp32, <= 1e-5), the op driven with
each plan's metadata.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from helpers import CountingBackend, compile_blocks
from paged_kv_compile.capture import CapturedBlocks, CompiledOnlyGraphs
from paged_kv_compile.capture.calls import record_calls
from test_page_size import _dense_window, _HistoryMap

import paged_kv_compile  # noqa: F401  (registers torch.ops.paged_kv)
from paged_kv_compile import PagedKVConfig
from paged_kv_compile.errors import ConfigError, RequestError
from paged_kv_compile.driver import PagedHooks
from paged_kv_compile.families.dreamzero import (
    DreamZeroSpec,
    dreamzero_block_inputs,
    dreamzero_runtime_config,
    session_blocks_per_row,
)
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel
from paged_kv_compile.models.hooks import DenseHooks, Forward, drive
from paged_kv_compile.runtime import PagedKVRuntime

ATOL = 1e-5
VIDEO_UNITS = (12, 10, 10, 5)  # TaoMate-H3's video latents per chunk


def taomate_schedule(rng: random.Random, unit: int, audio_max: int, chunks: int) -> list[int]:
    """Chunk lengths in tokens: 12/10/10/5 video latents of `unit` tokens each, then 0..audio_max audio tokens."""
    return [VIDEO_UNITS[i % len(VIDEO_UNITS)] * unit + rng.randint(0, audio_max) for i in range(chunks)]


def taomate_spec(rng: random.Random) -> tuple[DreamZeroSpec, int, int, int]:
    """A random TaoMate-like session: (spec, block size, tokens per video latent, most audio tokens a chunk)."""
    unit, audio_max = rng.randint(1, 3), rng.randint(0, 7)
    sink = VIDEO_UNITS[0] * unit  # video-only: the first chunk's video tokens, not its audio
    longest = max(VIDEO_UNITS) * unit + audio_max
    spec = DreamZeroSpec.irregular(window_tokens=sink + longest + rng.randint(0, 40),
                                   shortest=min(VIDEO_UNITS) * unit, longest=longest, sink_tokens=sink,
                                   action_tokens=rng.randint(0, 3), commit_action_tokens=rng.choice([None, 0]))
    return spec, rng.choice([2, 3, 4, 5, 8, 16]), unit, audio_max


def runtime_for(spec: DreamZeroSpec, block_size: int, rows: int = 2, *, kv_heads: int = 1,
                head_dim: int = 2) -> PagedKVRuntime:
    """A pool of exactly what admission reserves for `rows` rows (so a run that never waits proves the bound)."""
    per_row = session_blocks_per_row(spec, block_size)
    cfg = PagedKVConfig(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                        blocks_per_layer=rows * per_row, max_rows=rows,
                        scratch_tokens_per_row=spec.tokens_per_forward + block_size,
                        kv_gaps=spec.has_gaps(block_size))
    return PagedKVRuntime(cfg)


@pytest.mark.parametrize("seed", range(6))
def test_irregular_window_is_the_dense_window_token_by_token(seed):
    """TaoMate-like schedules (12/10/10/5 video latents x 1-3 tokens plus 0-7 audio tokens a chunk, a video-only
    sink) at random block sizes, through fill, slide and a reset: every forward of two rows sees exactly the history
    tokens the dense cache holds, the first chunk's audio is hidden once the window slides while its video stays, a
    commit's tokens land in history order, a block is held only while a next chunk of the shortest length could see
    one of its tokens (or the next commit continues it), and a pool of exactly the reservation never runs short."""
    rng = random.Random(seed)
    for _ in range(6):
        spec, B, unit, audio_max = taomate_spec(rng)
        per_row = session_blocks_per_row(spec, B)
        rt = runtime_for(spec, B)
        rt.admit("s", spec)
        owner = rt.scheduler.owners["s"]
        peak, slid = 0, False
        for _window in range(2):  # the second after a reset
            maps, history = [_HistoryMap(B) for _ in range(2)], 0
            schedule = taomate_schedule(rng, unit, audio_max, rng.randint(8, 20))
            for n in schedule:
                # denoising steps of this chunk, and one of another length between them (same session version)
                for m in (n, rng.randint(spec.shortest_chunk, spec.chunk_tokens), n):
                    denoise = rt.scheduler.plan("s", "denoise", tokens=m)
                    for r, row in enumerate(denoise.rows):
                        assert len(row.positions) == denoise.tokens == m + spec.action_tokens
                        assert maps[r].seen(row, history) == _dense_window(history, spec, m)
                    rt.scheduler.finish_forward(denoise)
                commit = rt.scheduler.plan("s", "commit", tokens=n)
                for r, row in enumerate(commit.rows):
                    seen = maps[r].seen(row, history)
                    assert seen == _dense_window(history, spec, n), (spec, B, history, n)
                    if seen and seen[-1] >= schedule[0] + spec.window_tokens:  # the window has slid past chunk 0
                        slid = True
                        assert set(range(spec.sink_tokens)) <= set(seen)  # the video-only sink stays
                        assert not set(range(spec.sink_tokens, schedule[0])) & set(seen)  # chunk 0's audio is gone
                    maps[r].committed(row, history, n, commit.new_blocks[r])
                peak = max(peak, *(len(owner.rows[r]) + len(commit.new_blocks[r]) for r in range(2)))
                rt.scheduler.finish_forward(commit)
                history += n
                assert owner.state.history == [history, history]
                visible = set(_dense_window(history, spec, spec.shortest_chunk))
                for r in range(2):
                    maps[r].check_held(owner.rows[r], history, visible)
            rt.reset("s")
        assert slid
        assert peak <= per_row, (spec, B, peak, per_row)
        rt.release("s")
        assert rt.scheduler.allocator.num_free == rt.config.blocks_per_layer


def test_irregular_reservation_is_reached_by_the_worst_sequence():
    """The bound admission reserves (`irregular_blocks_per_row`) is what the worst sequence holds: chunks of the
    shortest length, then the longest, at the block alignment that needs one block more (searched here)."""
    spec = DreamZeroSpec.irregular(window_tokens=40, shortest=5, longest=13, sink_tokens=6)
    B = 4
    per_row = session_blocks_per_row(spec, B)
    best = 0
    for pre in range(B):
        rt = runtime_for(spec, B, rows=1)
        rt.admit("s", spec, rows=1)
        owner = rt.scheduler.owners["s"]
        for n in [5 + pre] + [5] * 8 + [13]:
            with rt.forward("s", "commit", tokens=n) as active:
                best = max(best, len(owner.rows[0]) + len(active.plan.new_blocks[0]))
        rt.release("s")
    assert best == per_row


def _dense_attention(q, hist_k, hist_v, visible, new_k, new_v, scale):
    """Dense eager attention of one row: its queries over its whole history then its new tokens, with an explicit
    mask showing the visible history tokens and every new token (the model's forward: all queries see all)."""
    k = torch.cat([hist_k, new_k]) if len(hist_k) else new_k
    v = torch.cat([hist_v, new_v]) if len(hist_v) else new_v
    mask = torch.zeros(k.shape[0], dtype=torch.bool)
    mask[list(visible)] = True
    mask[len(hist_k):] = True
    rep = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(rep, 1).transpose(0, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask.expand(q.shape[0], -1), scale=scale)
    return out.transpose(0, 1)


class OpRig:
    """Sessions of one spec on a runtime whose forwards are served by calling the op with each plan's metadata, and
    per session row the dense history (K/V of every committed token) to check them against."""

    def __init__(self, spec: DreamZeroSpec, block_size: int, rows: int, kernel: str, seed: int) -> None:
        self.spec, self.kernel = spec, kernel
        self.rt = runtime_for(spec, block_size, rows=rows, kv_heads=1, head_dim=4)
        self.gen = torch.Generator().manual_seed(seed)
        self.history: dict[str, list[list[torch.Tensor]]] = {}

    def admit(self, owner_id: str) -> None:
        self.rt.admit(owner_id, self.spec)
        self.history[owner_id] = [[torch.zeros(0, 1, 4), torch.zeros(0, 1, 4)] for _ in range(2)]

    def fork(self, parent: str, child: str) -> None:
        self.rt.fork(parent, child, commits=1)
        self.history[child] = [list(h) for h in self.history[parent]]

    def forward(self, owner_ids: list[str], kind: str, n: int, scale: float = 0.5) -> None:
        """One forward of `owner_ids` (batched when several) at chunk length n, checked row by row against dense
        eager attention over the row's whole history with an explicit mask of the dense window."""
        rows = [(o, r) for o in owner_ids for r in range(2)]
        forward = (self.rt.forward(owner_ids[0], kind, tokens=n) if len(owner_ids) == 1
                   else self.rt.forward_batch([(o, kind, {"tokens": n}) for o in owner_ids]))
        with forward as active:
            meta, T = active.meta, active.bucket.tokens
            q = torch.randn(len(rows), T, 2, 4, generator=self.gen)
            k, v = (torch.randn(len(rows), T, 1, 4, generator=self.gen) for _ in range(2))
            slots, table = meta.layers[0].tensors()
            out = torch.ops.paged_kv.write_attend(q, k, v, self.rt.pool.tensor, slots, table, meta.seq_lens,
                                                  meta.kv_visible_end, scale, self.kernel, kv_gap=meta.kv_gap)
            for i, (o, r) in enumerate(rows):
                hk, hv = self.history[o][r]
                want = _dense_attention(q[i], hk, hv, _dense_window(len(hk), self.spec, n), k[i], v[i], scale)
                torch.testing.assert_close(out[i], want, atol=ATOL, rtol=0)
        if kind == "commit":
            for i, (o, r) in enumerate(rows):
                hk, hv = self.history[o][r]
                self.history[o][r] = [torch.cat([hk, k[i, :n]]), torch.cat([hv, v[i, :n]])]


@pytest.mark.parametrize("kernel,seed,chunks", [("reference", 0, 16), ("reference", 1, 16), ("triton", 2, 6)])
def test_irregular_op_with_the_plans_metadata_equals_dense_eager_attention(kernel, seed, chunks):
    """The op (`paged_kv::write_attend`) driven with every forward's metadata (its layer's slots and table, seq_lens,
    kv_visible_end, kv_gap) over a TaoMate-like schedule: each denoising step and commit of two rows equals dense
    eager attention over the row's whole history with an explicit mask of the dense window (fp32, <= 1e-5); what a
    commit wrote is the history later forwards read; a fork at a partial block then commits its own chunk."""
    rng = random.Random(seed)
    spec, B, unit, audio_max = taomate_spec(rng)
    rig = OpRig(spec, B, rows=4, kernel=kernel, seed=seed)
    rig.admit("s")
    for n in taomate_schedule(rng, unit, audio_max, chunks):
        rig.forward(["s"], "denoise", n)
        rig.forward(["s"], "commit", n)
    while rig.rt.scheduler.owners["s"].state.history[0] % B == 0:  # fork at a partial last block
        rig.forward(["s"], "commit", spec.shortest_chunk)
    rig.fork("s", "child")
    rig.forward(["child"], "commit", spec.chunk_tokens)
    rig.forward(["s"], "commit", spec.shortest_chunk)
    rig.forward(["child"], "denoise", spec.shortest_chunk)
    rig.forward(["s"], "denoise", spec.chunk_tokens)


def test_irregular_batched_sessions_at_different_histories_equal_dense():
    """Two sessions whose histories differ (different chunk lengths so far) batched into one forward of one chunk
    length: each row reads its own window, and the commit becomes each one's history (checked by the next forwards)."""
    rng = random.Random(7)
    spec, B, unit, audio_max = taomate_spec(rng)
    rig = OpRig(spec, B, rows=4, kernel="reference", seed=7)
    rig.admit("a")
    rig.admit("b")
    for _ in range(10):
        rig.forward(["a"], "commit", rng.randint(spec.shortest_chunk, spec.chunk_tokens))
        rig.forward(["b"], "commit", rng.randint(spec.shortest_chunk, spec.chunk_tokens))
        n = rng.randint(spec.shortest_chunk, spec.chunk_tokens)
        rig.forward(["a", "b"], "denoise", n)
        rig.forward(["a", "b"], "commit", n)
    history = [rig.rt.scheduler.owners[o].state.history[0] for o in ("a", "b")]
    assert history[0] != history[1]


def test_irregular_chunk_length_out_of_range_is_refused_and_changes_nothing():
    """A chunk outside the spec's range, a missing or non-int `tokens=`, or `tokens=` for a session of fixed chunks:
    refused naming the fix, with the session and the pool as they were."""
    spec = DreamZeroSpec.irregular(window_tokens=40, shortest=5, longest=13, sink_tokens=6)
    rt = runtime_for(spec, 4)
    rt.admit("s", spec)
    with rt.forward("s", "commit", tokens=7):
        pass

    def state():
        owner = rt.scheduler.owners["s"]
        return [list(r) for r in owner.rows], list(owner.state.history), rt.scheduler.allocator.num_free

    before = state()
    for bad in (4, 14, None, 7.0, True):
        for kind in ("commit", "denoise"):
            with pytest.raises(RequestError, match=r"tokens=n with 5 <= n <= 13"):
                rt.forward("s", kind, tokens=bad)
            assert state() == before and rt.active is None
    fixed = DreamZeroSpec(frame_seqlen=4, chunk_frames=1, window_frames=4)
    rt2 = PagedKVRuntime(PagedKVConfig(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4, blocks_per_layer=16,
                                       max_rows=2, scratch_tokens_per_row=8))
    rt2.admit("f", fixed)
    with pytest.raises(RequestError, match=r"DreamZeroSpec.irregular"):
        rt2.forward("f", "commit", tokens=4)
    assert rt2.scheduler.allocator.num_free == 16


def test_irregular_spec_gaps_buckets_and_bad_specs():
    """has_gaps stays honest (chunks of any length put window bounds anywhere: every block of more than one token
    may hide keys), one bucket per chunk length and register count, and a malformed range is refused."""
    spec = DreamZeroSpec.irregular(window_tokens=40, shortest=5, longest=7, sink_tokens=6, action_tokens=2,
                                   commit_action_tokens=0)
    assert spec.has_gaps(4) and spec.has_gaps(5) and not spec.has_gaps(1)
    assert sorted(b.tokens for b in spec.buckets()) == [5, 6, 7, 7, 8, 9]
    assert spec.tokens_per_forward == 9 and spec.sink_tokens == 6 and spec.window_tokens == 40
    with pytest.raises(ConfigError, match="DreamZeroSpec.irregular"):
        DreamZeroSpec(frame_seqlen=1, chunk_frames=7, window_frames=40, chunk_tokens_range=(8, 7))
    with pytest.raises(ConfigError, match="DreamZeroSpec.irregular"):
        DreamZeroSpec(frame_seqlen=1, chunk_frames=9, window_frames=40, chunk_tokens_range=(5, 7))


# ---- a compiled model with chunks of irregular length against the dense eager model -----------------------------
def irregular_steps(model: DreamZeroModel, hooks, schedule: list[int], steps: int, seed: int = 3):
    """`models.dreamzero.dreamzero_steps` with a chunk length per chunk (the model at one token a frame: its window
    and sink are in tokens, a dense cat/slice cache): each chunk is denoised, then committed at the start of the
    next, every forward telling the runtime its length (`tokens=n`). Returns the denoised chunks."""
    cfg, p = model.cfg, next(model.parameters())
    gen = torch.Generator().manual_seed(seed)

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=p.device, dtype=p.dtype)

    context = noise(1, cfg.text_len, cfg.text_dim)
    image = noise(1, cfg.image_len, cfg.image_dim).expand(2, -1, -1) if cfg.image_len else None
    cross = hooks.write_once_kv(model, model.prepare_cross_kv(torch.cat([context, torch.zeros_like(context)]), image))
    caches = hooks.caches(model, 2)
    start, previous, out = 0, None, []
    for i, n in enumerate(schedule):
        if previous is not None:
            p_start, p_x, p_a, p_n = previous
            _, _, caches = yield Forward(
                "commit", i, lambda: model(p_x.expand(2, -1, -1), p_a.expand(2, -1, -1), torch.zeros(2), p_start,
                                           caches, cross, update_kv_cache=True),
                dict(start_frame=p_start, tokens=p_n))
        x, a = noise(1, n, cfg.in_channels), noise(1, cfg.action_register_length, cfg.action_dim)
        sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
        for s in range(steps):
            t = torch.full((2,), sigmas[s] * 1000.0)
            v_x, v_a, _ = yield Forward(
                "denoise", i, lambda: model(x.expand(2, -1, -1), a.expand(2, -1, -1), t, start, caches, cross,
                                            update_kv_cache=False),
                dict(start_frame=start, tokens=n, step=s))
            x = x + (sigmas[s + 1] - sigmas[s]) * (v_x[1:] + 5.0 * (v_x[:1] - v_x[1:]))
            a = a + (sigmas[s + 1] - sigmas[s]) * (v_a[1:] + 5.0 * (v_a[:1] - v_a[1:]))
        out.append(torch.cat([x[0], a[0]]))
        previous, start = (start, x, a, n), start + n
    return out


# TaoMate's 12/10/10/5 video latents plus 0 or 2 audio tokens, a video-only sink (the first chunk's 12 video tokens)
SCHEDULE = [12, 12, 10, 10, 5, 7, 12, 10, 12, 10, 5, 5]
LENGTHS = sorted(set(SCHEDULE))
MODEL_CFG = DreamZeroConfig(frame_seqlen=1, num_frame_per_block=max(SCHEDULE), local_attn_size=40, sink_size=12,
                            window_reset_frames=100 * max(SCHEDULE), num_layers=2)
MODEL_SPEC = DreamZeroSpec.irregular(window_tokens=40, shortest=min(SCHEDULE), longest=max(SCHEDULE),
                                     sink_tokens=12, action_tokens=MODEL_CFG.action_register_length)


def model_runtime(model: DreamZeroModel, block: int, cross_regions: int = 0) -> PagedKVRuntime:
    """A runtime for one session of MODEL_SPEC (exactly what admission reserves for its two rows, plus
    `cross_regions` shared regions) with one bucket per chunk length of SCHEDULE, bound to `model`."""
    spec, A = MODEL_SPEC, MODEL_CFG.action_register_length
    buckets = tuple(b for b in spec.buckets(2) if b.tokens - A in LENGTHS)
    config = dreamzero_runtime_config(MODEL_CFG, block_size=block, kernel="reference", buckets=buckets,
                                      cross_regions=cross_regions, spec=spec)
    assert config.kv_gaps and config.blocks_per_layer == (2 * session_blocks_per_row(spec, block)
                                                          + cross_regions * -(-MODEL_CFG.cross_len // block))
    runtime = PagedKVRuntime(config)
    runtime.bind(model.blocks)
    return runtime


def dense_rollout() -> list[torch.Tensor]:
    model = DreamZeroModel(MODEL_CFG, seed=1)
    return drive(irregular_steps(model, DenseHooks(), SCHEDULE, steps=2), DenseHooks())


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("block", [4, 5])
@torch.no_grad()
def test_irregular_rollout_compiled_equals_dense(block):
    """The reference model at one token a frame, compiled with aot_eager on the paged runtime, against the dense
    eager model over a TaoMate-like schedule that fills and slides the window (<= 1e-5 on every chunk), one compiled
    frame per distinct chunk length (commit and denoise share it), every block back in the pool at the end."""
    schedule, lengths, spec = SCHEDULE, LENGTHS, MODEL_SPEC
    assert sum(schedule) > spec.window_tokens + schedule[0]  # the window slides past the first chunk's audio
    dense = dense_rollout()
    model = DreamZeroModel(MODEL_CFG, seed=1)
    runtime = model_runtime(model, block)
    backend = CountingBackend({"inner_compiler": "aot_eager"})
    compile_blocks(model.blocks, backend)
    runtime.admit("s", spec)
    plans = []
    plan = runtime.scheduler.plan
    runtime.scheduler.plan = lambda *a, **k: plans.append(p := plan(*a, **k)) or p  # record each forward's plan
    hooks = PagedHooks(runtime, "s")
    with torch._dynamo.config.patch(recompile_limit=len(lengths) + 1):
        paged = drive(irregular_steps(model, hooks, schedule, steps=2), hooks)
    runtime.release("s")
    for d, q in zip(dense, paged):
        assert (d - q).abs().max().item() <= ATOL
    assert backend.frames == len(lengths)
    assert any(row.kv_gap != (0, 0) for p in plans for row in p.rows), "the rollout never hid a key"
    assert sorted({p.phase["chunk_tokens"] for p in plans}) == lengths
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


@pytest.mark.usefixtures("fresh_dynamo")
@torch.no_grad()
def test_irregular_captured_rollout_replays_no_python_and_equals_dense():
    """The same rollout in pages of 5 served by one captured graph per forward and chunk length, the cross-attention
    K/V in shared regions: the replays run no Python, and the result equals the dense eager model (<= 1e-5)."""
    dense = dense_rollout()
    model = DreamZeroModel(MODEL_CFG, seed=1)
    runtime = model_runtime(model, 5, cross_regions=2)
    with torch._dynamo.config.patch(recompile_limit=len(LENGTHS) + 1):
        compile_blocks(model.blocks, CountingBackend({"inner_compiler": "aot_eager"}))
        captured = CapturedBlocks(model.blocks, runtime, lambda b: dreamzero_block_inputs(model, runtime, b),
                                  graphs=CompiledOnlyGraphs(), granularity="forward")
        captured.warmup(progress=False)
        hooks = PagedHooks(runtime, "s")
        hooks.admit_with = {"spec": MODEL_SPEC, "cache_salt": None}
        with captured.serving(), record_calls() as python_calls:
            paged = drive(irregular_steps(model, hooks, SCHEDULE, steps=2), hooks)
    runtime.release("s")
    assert python_calls == []
    forwards = 2 * len(SCHEDULE) + len(SCHEDULE) - 1
    assert captured.stats["replays"] == forwards and captured.stats["direct_calls"] == 0
    for d, q in zip(dense, paged):
        assert (d - q).abs().max().item() <= ATOL
