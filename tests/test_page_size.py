"""Pages sized for the kernel, not the frame: DreamZero at block sizes that divide neither a frame nor a chunk.

Frames of 11 or 13 tokens in blocks of 4, 8 or 16 (DreamZero-14B's 880-token and 832x480's 1560-token frames in
pages of 64/128/256, scaled down for the CPU): commits that do not fill a block, a window that slides by frames, a
sink that ends inside a block, blocks freed only when none of their tokens is visible, and the row's layout
`[sink blocks][recent blocks][new]` with `kv_gap` hiding what lies between. Oracles: the dense model's own window
(which history tokens each forward sees, token by token) and the dense eager model (fp32, <= 1e-5).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import CountingBackend, compile_blocks

from paged_kv_compile import PagedKVConfig, families
from paged_kv_compile.errors import RequestError
from paged_kv_compile.capture import CapturedBlocks, CompiledOnlyGraphs
from paged_kv_compile.capture.calls import record_calls
from paged_kv_compile.driver import paged_run
from paged_kv_compile.families.dreamzero import (
    DreamZeroSpec,
    dreamzero_block_inputs,
    dreamzero_buckets,
    dreamzero_runtime_config,
    session_blocks_per_row,
)
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.runtime import PagedKVRuntime

ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


# ---- the window, token by token, against the dense model's cat/slice ------------------------------------------
def _dense_window(history: int, spec: DreamZeroSpec, windowed: int) -> list[int]:
    """The history tokens the dense model's cache shows a forward of `windowed` new tokens:
    `cat([cache[:, :sink], cat([cache[:, sink:], new])[-(window - sink):]])`."""
    tokens = list(range(history))
    S, keep = spec.sink_tokens, spec.window_tokens - spec.sink_tokens - windowed
    return tokens[:S] + (tokens[S:][-keep:] if keep > 0 else [])


class _HistoryMap:
    """Which history block each managed block of one session row is (assigned as commits write them)."""

    def __init__(self, block_size: int) -> None:
        self.B = block_size
        self.index: dict[int, int] = {}

    def seen(self, row, history: int) -> list[int]:
        """The history tokens a planned row sees: every logical key before its first query, less its kv_gap."""
        table, managed, positions, _ = row.arrays
        start = int(positions[0])
        g0, g1 = row.kv_gap
        out = []
        for p in range(start):
            if g0 <= p < g1:
                continue
            block = int(table[p // self.B])
            assert managed[p // self.B], f"history key {p} lies in a scratch block"
            out.append(self.index[block] * self.B + p % self.B)
        assert all(t < history for t in out)
        return out

    def check_held(self, blocks: list[int], history: int, visible: set[int]) -> None:
        """A row holds a history block only while one of its tokens is visible, or while the next commit
        continues it (the partial last block)."""
        B = self.B
        for block in blocks:
            h = self.index[block]
            tokens = range(h * B, min((h + 1) * B, history))
            assert visible.intersection(tokens) or (history % B and h == history // B), (B, h)

    def committed(self, row, history: int, tokens: int, new: list[int]) -> None:
        """A commit's chunk (history tokens [history, history + tokens)) lands where history order says: in the
        row's partial last block, then in the `new` blocks it took (a block id freed earlier may come back)."""
        for block in new:
            self.index.pop(block, None)
        table, managed, positions, _ = row.arrays
        for j in range(tokens):
            p, h = int(positions[j]), history + j
            assert managed[p // self.B] and p % self.B == h % self.B
            block = int(table[p // self.B])
            assert self.index.setdefault(block, h // self.B) == h // self.B


def _random_spec(rng: random.Random) -> tuple[DreamZeroSpec, int]:
    F = rng.randint(2, 17)
    chunk = rng.randint(1, 3)
    sink = rng.choice([0, 0, 1, 2])
    window = sink + chunk + rng.randint(0, 4)
    reset = rng.choice([None, (sink + window + 2) * chunk])
    spec = DreamZeroSpec(frame_seqlen=F, chunk_frames=chunk, window_frames=window, sink_frames=sink,
                         action_tokens=rng.randint(0, 4), first_commit_frames=rng.choice([None, 1]),
                         commit_action_tokens=rng.choice([None, 0]), reset_frames=reset)
    return spec, rng.choice([2, 3, 4, 5, 8, 16])


@pytest.mark.parametrize("seed", range(6))
def test_page_size_window_is_the_dense_window_token_by_token(seed):
    """Random geometries (frames of 2-17 tokens, blocks of 2-16, chunks, sinks, a 1-frame first commit, resets):
    every forward of two rows sees exactly the history tokens the dense cache holds (through fill, slide and
    reset), a commit's tokens land in history order (continuing a partial block), a pool of exactly what admission
    reserves never runs short, a block is held only while one of its tokens is visible (or the next commit continues
    it), and the most a row holds is `session_blocks_per_row`."""
    rng = random.Random(seed)
    for _ in range(12):
        spec, B = _random_spec(rng)
        per_row = session_blocks_per_row(spec, B)
        cfg = PagedKVConfig(num_layers=1, num_kv_heads=1, head_dim=2, block_size=B, blocks_per_layer=2 * per_row,
                            max_rows=2, scratch_tokens_per_row=spec.tokens_per_forward + B)
        rt = PagedKVRuntime(cfg)
        rt.admit("s", spec)
        owner = rt.scheduler.owners["s"]
        maps = [_HistoryMap(B) for _ in range(2)]
        history = frame = peak = 0
        for window in range(2):  # the second after a reset
            commits = 0
            while True:
                first = commits == 0
                n = spec.phase("commit", first=first)[0]
                if (spec.reset_frames is not None and frame + n // spec.frame_seqlen >= spec.reset_frames) or (
                        spec.reset_frames is None and commits > spec.window_frames + 2 * B):
                    break
                denoise = rt.scheduler.plan("s", "denoise")
                for r, row in enumerate(denoise.rows):
                    assert maps[r].seen(row, history) == _dense_window(history, spec, spec.chunk_tokens)
                rt.scheduler.finish_forward(denoise)
                commit = rt.scheduler.plan("s", "commit")
                for r, row in enumerate(commit.rows):
                    assert maps[r].seen(row, history) == _dense_window(history, spec, n), (spec, B, history)
                    maps[r].committed(row, history, n, commit.new_blocks[r])
                peak = max(peak, *(len(owner.rows[r]) + len(commit.new_blocks[r]) for r in range(2)))
                rt.scheduler.finish_forward(commit)
                history, frame, commits = history + n, frame + n // spec.frame_seqlen, commits + 1
                visible = set(_dense_window(history, spec, spec.chunk_tokens))
                for r in range(2):
                    maps[r].check_held(owner.rows[r], history, visible)
            rt.reset("s")
            maps, history, frame = [_HistoryMap(B) for _ in range(2)], 0, 0
        assert peak == per_row, (spec, B)
        rt.release("s")
        assert rt.scheduler.allocator.num_free == cfg.blocks_per_layer


def test_page_size_gap_hides_the_tail_of_the_sink_block_and_the_head_of_the_window():
    """Frames of 11 tokens, a 1-frame sink, blocks of 4: once the window slides, the row holds sink blocks 0-2
    (tokens 0-11: the sink is 0-10) then the recent blocks, whose first one starts before the window does."""
    spec = DreamZeroSpec(frame_seqlen=11, chunk_frames=1, window_frames=3, sink_frames=1)
    rt = PagedKVRuntime(dreamzero_runtime_config(DreamZeroConfig(frame_seqlen=11, num_frame_per_block=1,
                                                                 local_attn_size=3, sink_size=1), block_size=4))
    rt.admit("s", spec, rows=1)
    for _ in range(4):
        with rt.forward("s", "commit"):
            pass
    plan = rt.scheduler.plan("s", "denoise")  # history 44 tokens: sees 0-10 and 33-43 (window 33 = 11 + 22)
    row = plan.rows[0]
    # sink blocks 0-2 (logical 0-11), then history blocks 8-10 (tokens 32-43) at logical 12-23: 32 is hidden
    assert row.kv_gap == (11, 13) and int(row.positions[0]) == 24
    assert len(rt.scheduler.owners["s"].rows[0]) == 6
    rt.scheduler.finish_forward(plan)



@pytest.mark.parametrize("block,gaps", [(11, False), (4, True)], ids=["page=frame", "page4"])
def test_page_size_kv_gap_input_only_where_the_geometry_can_hide_keys(block, gaps):
    """A block that divides the frame never hides a key (every window bound is a frame bound), so its config leaves
    the op's kv_gap out of the compiled graph (flash-attn then serves a row in one call, not split); a block that
    does not takes it. The rollout matches dense eager either way."""
    cfg = DreamZeroConfig(frame_seqlen=11, sink_size=1, num_layers=2)
    config = dreamzero_runtime_config(cfg, block_size=block, kernel="reference")
    assert config.kv_gaps is gaps
    dense = dreamzero_rollout(DreamZeroModel(cfg, seed=1), num_chunks=5, num_inference_steps=1, seed=3)
    model = DreamZeroModel(cfg, seed=1)
    runtime = PagedKVRuntime(config)
    runtime.bind(model.blocks)
    backend = CountingBackend({"inner_compiler": "aot_eager"})
    compile_blocks(model.blocks, backend)
    paged = paged_run(model, runtime, num_chunks=5, num_inference_steps=1, seed=3)
    assert (dense["video"] - paged["video"]).abs().max().item() <= ATOL
    names = {i.name for r in backend.results for i in r.inputs}
    assert ("paged_kv_kv_gap" in names) is gaps and "paged_kv_seq_lens" in names


def test_page_size_a_gap_under_kv_gaps_false_is_refused_and_changes_nothing():
    """A hand-built config that says no row hides keys (kv_gaps=False) at a geometry that does: the forward whose row
    has a gap is refused before anything is staged, naming the fix, and the session is as it was."""
    spec = DreamZeroSpec(frame_seqlen=11, chunk_frames=1, window_frames=3, sink_frames=1)
    model_cfg = DreamZeroConfig(frame_seqlen=11, num_frame_per_block=1, local_attn_size=3, sink_size=1)
    rt = PagedKVRuntime(dreamzero_runtime_config(model_cfg, block_size=4, kv_gaps=False))
    rt.admit("s", spec, rows=1)

    def state():
        return [list(r) for r in rt.scheduler.owners["s"].rows], rt.scheduler.allocator.num_free, rt.state()

    for commits in range(6):
        before = state()
        try:
            with rt.forward("s", "commit"):
                pass
        except RequestError as e:
            assert "kv_gaps=False" in str(e) and "kv_gaps=True" in str(e)
            break
    else:
        raise AssertionError("no forward of this geometry hid a key")
    assert commits >= 1 and state() == before and rt.active is None

# ---- compiled rollouts against the dense model ------------------------------------------------------------------
GEOMETRIES = [(11, 4, 0), (13, 8, 2), (11, 16, 1), (13, 4, 1)]  # (frame tokens, block size, sink frames)


@pytest.mark.parametrize("frame,block,sink", GEOMETRIES, ids=[f"frame{f}-page{b}-sink{s}" for f, b, s in GEOMETRIES])
def test_page_size_rollout_compiled_equals_dense(frame, block, sink):
    """Ten chunks (fill, slide, a reset after chunk 7) compiled with aot_eager: <= 1e-5 against the dense eager
    model, one compiled frame for every layer, commit and denoise, every block back in the pool at the end."""
    cfg = DreamZeroConfig(frame_seqlen=frame, sink_size=sink)
    dense = dreamzero_rollout(DreamZeroModel(cfg, seed=1), num_chunks=10, num_inference_steps=2, seed=3)
    model = DreamZeroModel(cfg, seed=1)
    runtime = PagedKVRuntime(dreamzero_runtime_config(cfg, block_size=block, kernel="reference"))
    runtime.bind(model.blocks)
    backend = CountingBackend({"inner_compiler": "aot_eager"})
    compile_blocks(model.blocks, backend)
    gaps = []
    plan = runtime.scheduler.plan
    runtime.scheduler.plan = lambda *a, **k: gaps.append(p := plan(*a, **k)) or p  # record each forward's plan
    paged = paged_run(model, runtime, num_chunks=10, num_inference_steps=2, seed=3)
    assert dense["resets"] == paged["resets"] and dense["resets"]
    for key in ("video", "actions"):
        assert (dense[key] - paged[key]).abs().max().item() <= ATOL
    assert backend.frames == 1
    assert any(row.kv_gap != (0, 0) for p in gaps for row in p.rows), "the rollout never hid a key"
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def test_page_size_rollout_triton_kernel_equals_dense():
    """The Triton kernel (the interpreter on the CPU) on the same layouts: frames of 11 tokens in blocks of 4 with a
    1-frame sink, through fill, slide and the gap: <= 1e-5 against the dense eager model."""
    cfg = DreamZeroConfig(frame_seqlen=11, sink_size=1, num_layers=2)
    dense = dreamzero_rollout(DreamZeroModel(cfg, seed=1), num_chunks=5, num_inference_steps=1, seed=3)
    model = DreamZeroModel(cfg, seed=1)
    runtime = PagedKVRuntime(dreamzero_runtime_config(cfg, block_size=4, kernel="triton"))
    runtime.bind(model.blocks)
    backend = CountingBackend({"inner_compiler": "aot_eager"})
    compile_blocks(model.blocks, backend)
    paged = paged_run(model, runtime, num_chunks=5, num_inference_steps=1, seed=3)
    for key in ("video", "actions"):
        assert (dense[key] - paged[key]).abs().max().item() <= ATOL
    assert backend.frames == 1


def test_page_size_captured_rollout_replays_no_python_and_equals_dense():
    """Frames of 11 tokens, blocks of 4, a 1-frame sink: served by one captured graph per forward whose replay runs
    no Python (the kv_gap buffer is static like the others), bit-exact to the compiled path's dense parity."""
    cfg = DreamZeroConfig(frame_seqlen=11, sink_size=1)
    dense = dreamzero_rollout(DreamZeroModel(cfg, seed=1), num_chunks=5, num_inference_steps=2, seed=3)
    model = DreamZeroModel(cfg, seed=1)
    runtime = PagedKVRuntime(dreamzero_runtime_config(cfg, block_size=4, kernel="reference",
                                                      buckets=[dreamzero_buckets(cfg)[0]], cross_regions=2))
    runtime.bind(model.blocks)
    compile_blocks(model.blocks, CountingBackend({"inner_compiler": "aot_eager"}))
    captured = CapturedBlocks(model.blocks, runtime, lambda b: dreamzero_block_inputs(model, runtime, b),
                              graphs=CompiledOnlyGraphs(), granularity="forward")
    captured.warmup(progress=False)
    with captured.serving(), record_calls() as python_calls:
        paged = paged_run(model, runtime, num_chunks=5, num_inference_steps=2, seed=3, shared_kv=True)
    assert python_calls == []
    forwards = 5 * 2 + 5 - 1
    assert captured.stats["replays"] == forwards and captured.stats["direct_calls"] == 0
    for key in ("video", "actions"):
        assert (dense[key] - paged[key]).abs().max().item() <= ATOL
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


# ---- forks of a partly filled block, batched, FP8 ---------------------------------------------------------------
# Frames of 5 tokens in blocks of 4, chunk 1 frame, window 3 frames with a 1-frame sink: after 3 commits the row
# holds 15 tokens, its last block partly filled; the sink ends inside block 1.
FORK_CFG = DreamZeroConfig(num_layers=2, frame_seqlen=5, num_frame_per_block=1, local_attn_size=3, sink_size=1,
                           window_reset_frames=64, action_register_length=2, num_inference_steps=2)
FORK_SPEC = DreamZeroSpec.from_model_config(FORK_CFG)


def _fork_rig(max_rows: int, sessions: int, **kw):
    model, dense = DreamZeroModel(FORK_CFG, seed=1), DreamZeroModel(FORK_CFG, seed=1)
    rt = PagedKVRuntime(dreamzero_runtime_config(FORK_CFG, block_size=4, sessions=sessions, kernel="reference",
                                                 inner_compiler="aot_eager", max_rows=max_rows, **kw))
    rt.bind(model.blocks)
    compile_blocks(model.blocks, CountingBackend())
    return model, dense, rt


def _inputs(seed: int, rows: int = 2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, FORK_CFG.chunk_tokens, FORK_CFG.in_channels, generator=g).expand(rows, -1, -1)
    a = torch.randn(1, FORK_CFG.action_register_length, FORK_CFG.action_dim, generator=g).expand(rows, -1, -1)
    return x, a


def _cross(model, rows: int = 2):
    ctx = torch.randn(1, FORK_CFG.text_len, FORK_CFG.text_dim, generator=torch.Generator().manual_seed(7))
    return model.prepare_cross_kv(torch.cat([ctx, torch.zeros_like(ctx)]).repeat(rows // 2, 1, 1))


def _paged(rt, model, sids, inputs, start, commit, t=0.0):
    """One forward over the rows of `sids` (2 CFG rows each, batched when several); per session (video, actions)."""
    x, a = torch.cat([i[0] for i in inputs]), torch.cat([i[1] for i in inputs])
    rows = x.shape[0]
    caches = families.for_model(model).standin_caches(rt, model, rows)
    with rt.forward_batch([(sid, "commit" if commit else "denoise") for sid in sids]):
        video, act, _ = model(x, a, torch.full((rows,), t), start, caches, _cross(model, rows), update_kv_cache=commit)
    return [(video[2 * k: 2 * k + 2], act[2 * k: 2 * k + 2]) for k in range(len(sids))]


@pytest.mark.usefixtures("no_grad")
def test_page_size_forks_of_a_partly_filled_block_copy_it_and_equal_dense():
    """Three forks of a session whose last block is partly filled: each child gets its own copy of that block at
    the fork (same K/V, nobody else holds it) and shares every full block; the children's candidate commits and a
    denoising step run as the rows of ONE batched forward and equal the dense model continued from the parent's
    caches; the parent, whose own next commit continues its original block, is undisturbed."""
    K = 3
    model, dense, rt = _fork_rig(max_rows=2 * K, sessions=K + 1)
    rt.admit("p", FORK_SPEC)
    caches = dense.dense_caches(2)
    for chunk in range(3):
        _paged(rt, model, ["p"], [_inputs(chunk)], chunk, commit=True)
        _, _, caches = dense(*_inputs(chunk), torch.zeros(2), chunk, caches, _cross(dense), update_kv_cache=True)
    parent = [list(r) for r in rt.scheduler.owners["p"].rows]
    for k in range(K):
        rt.fork("p", f"c{k}")
    alloc, pool = rt.scheduler.allocator, rt.pool
    for k in range(K):
        child = rt.scheduler.owners[f"c{k}"].rows
        for mine, theirs in zip(child, parent):
            assert mine[:-1] == theirs[:-1] and mine[-1] != theirs[-1]  # the partial last block: a copy
            assert alloc.refcount(mine[-1]) == 1 and alloc.refcount(mine[0]) == K + 1
            bases = pool.layer_bases.tolist()
            assert all(torch.equal(pool.tensor[:, b + mine[-1]], pool.tensor[:, b + theirs[-1]]) for b in bases)
    worst, at_fork = 0.0, caches
    children = [f"c{k}" for k in range(K)]
    got = _paged(rt, model, children, [_inputs(100 + k) for k in range(K)], 3, commit=True)
    wants = [dense(*_inputs(100 + k), torch.zeros(2), 3, at_fork, _cross(dense), update_kv_cache=True)
             for k in range(K)]
    worst = max(max((g - w).abs().max().item() for g, w in zip(got[k], wants[k][:2])) for k in range(K))
    got = _paged(rt, model, children, [_inputs(200)] * K, 4, commit=False, t=500.0)
    for k in range(K):
        want = dense(*_inputs(200), torch.full((2,), 500.0), 4, wants[k][2], _cross(dense), update_kv_cache=False)
        worst = max(worst, *((g - w).abs().max().item() for g, w in zip(got[k], want[:2])))
    (got,) = _paged(rt, model, ["p"], [_inputs(300)], 3, commit=True)  # writes the tail of its original block
    want = dense(*_inputs(300), torch.zeros(2), 3, at_fork, _cross(dense), update_kv_cache=True)
    worst = max(worst, *((g - w).abs().max().item() for g, w in zip(got, want[:2])))
    assert worst <= ATOL, worst
    for sid in ["p", *children]:
        rt.release(sid)
    assert alloc.num_free == alloc.num_blocks


def test_page_size_fork_budget_counts_the_copied_block():
    """Forks with a budget of one commit reserve that commit's blocks plus their private copies. The parent holds 8
    blocks (4 per row, then shared) and may take its whole reservation (12) on its own; each child copies 2 blocks
    and may take 4: two children need 8 + 12 + 2 * 6 = 32. A pool of 32 admits both and every commit after; with 31
    the second fork is refused and changes nothing (not counting the copies, 28 would have looked enough)."""
    from paged_kv_compile import CapacityError

    per_row = session_blocks_per_row(FORK_SPEC, 4)
    assert per_row == 6
    for blocks in (32, 31):
        rt = PagedKVRuntime(PagedKVConfig(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4, max_rows=2,
                                          blocks_per_layer=blocks, scratch_tokens_per_row=16))
        rt.admit("p", FORK_SPEC)
        for _ in range(3):
            with rt.forward("p", "commit"):
                pass
        rt.fork("p", "c0", commits=1)
        before = rt.state()
        if blocks == 31:
            with pytest.raises(CapacityError, match="reserves 6 blocks"):
                rt.fork("p", "c1", commits=1)
            assert rt.state() == before
            continue
        rt.fork("p", "c1", commits=1)
        for sid in ("c0", "c1", *["p"] * 6):  # the parent slides its window on its own
            with rt.forward(sid, "commit"):
                pass


@pytest.mark.parametrize("block", [4, 11])
def test_page_size_fp8_pool_rollout_matches_page_equal_frame(block):
    """An FP8 (e4m3) pool with pages of 4 tokens and with pages of one 11-token frame: the same stored values,
    read in another order. Both stay near dense; their difference is measured against dense's."""
    cfg = DreamZeroConfig(frame_seqlen=11, sink_size=1)
    dense = dreamzero_rollout(DreamZeroModel(cfg, seed=1), num_chunks=6, num_inference_steps=1, seed=3)
    model = DreamZeroModel(cfg, seed=1)
    runtime = PagedKVRuntime(dreamzero_runtime_config(cfg, block_size=block, kernel="reference",
                                                      kv_dtype=torch.float8_e4m3fn))
    runtime.bind(model.blocks)
    compile_blocks(model.blocks, CountingBackend({"inner_compiler": "aot_eager"}))
    paged = paged_run(model, runtime, num_chunks=6, num_inference_steps=1, seed=3)
    err = max((dense[k] - paged[k]).abs().max().item() for k in ("video", "actions"))
    _FP8_ERRORS[block] = err, paged
    assert 0 < err < 1.0  # the pool quantizes; a lost or doubled scale moves outputs by O(1)
    if len(_FP8_ERRORS) == 2:
        (e4, p4), (e11, p11) = _FP8_ERRORS[4], _FP8_ERRORS[11]
        apart = max((p4[k] - p11[k]).abs().max().item() for k in ("video", "actions"))
        assert apart <= max(e4, e11), (apart, e4, e11)


_FP8_ERRORS: dict = {}


def test_page_size_pool_waste_arithmetic_at_the_real_geometries():
    """`python -m benchmarks.page_size`'s arithmetic: at page = frame nothing is reserved beyond the loop's need;
    at 64/128/256 (which divide neither 880 nor 1560) the partial blocks cost under one page per boundary."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.page_size import pool_waste

    rows = pool_waste()
    assert {(r["geometry"], r["page"]) for r in rows} == {(g, p) for g, f in (("DreamZero-14B", 880), ("832x480", 1560))
                                                         for p in (f, 64, 128, 256)}
    for r in rows:
        assert r["tokens_per_row"] >= r["needed_tokens_per_row"]
        if r["page_is_frame"]:
            assert r["wasted_tokens_per_row"] == 0
        else:
            assert 0 <= r["wasted_tokens_per_row"] < 3 * r["page"]


@pytest.mark.parametrize("geometry", [(5, 2, 3), (4, 2, 5)], ids=["frame5-chunk2-page3", "frame4-chunk2-page5"])
def test_page_size_fuzz_short_run_finds_nothing(geometry):
    """The single-rank differential fuzzer (both serving paths, compiled and captured) at a block size that divides
    neither the frame nor the chunk: every forward equals its dense twin, every refusal and fault changes nothing
    (but the unused tail of a partly filled last block), no recompile while serving."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from fuzz.differential import ATOL, BATCH_INVARIANCE, Fuzzer

    fuzzer = Fuzzer("dreamzero", seed=1, geometry=geometry)
    graphs = fuzzer.h.backend.frames
    stats = fuzzer.run(40)  # raises FuzzFailure naming the operation if anything is wrong
    assert stats.steps == 40 and stats.compared >= stats.forwards >= 10, stats
    assert stats.worst <= ATOL + BATCH_INVARIANCE
    assert fuzzer.h.backend.frames - graphs <= len(fuzzer.signatures)
