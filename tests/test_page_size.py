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
    reserves never runs short, and the most a row holds is `session_blocks_per_row`."""
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
