"""Metadata: persistent per-bucket buffers, the op's padding conventions, one copy per forward."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from paged_kv_compile import PagedKVConfig, RequestError
from paged_kv_compile.config import Bucket
from paged_kv_compile.layout import RowLayout
from paged_kv_compile.runtime import PagedKVRuntime
from paged_kv_compile.families.dreamzero import DreamZeroSpec
from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec

B = 4
SPEC = DreamZeroSpec(frame_seqlen=8, chunk_frames=1, window_frames=4, sink_frames=0, action_tokens=3)


def runtime(**kw) -> PagedKVRuntime:
    cfg = PagedKVConfig(num_layers=3, num_kv_heads=1, head_dim=4, block_size=B, blocks_per_layer=32, max_rows=2,
                        scratch_tokens_per_row=32, **kw)
    return PagedKVRuntime(cfg)


def expected_layer_metadata(pool, rows, layer: int, tokens: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s slot mapping and block table, token by token from the plan's row layouts and the
    pool's own addressing (``KVPool.block_id``), independent of the builder's vectorized expansion."""
    B = pool.block_size
    slots = torch.full((len(rows), tokens), -1, dtype=torch.int64)
    table = torch.full((len(rows), width), pool.pad_block, dtype=torch.int32)

    def absolute(row, i):
        local = int(row.table[i])
        return int(pool.block_id(layer, local)) if bool(row.managed[i]) else local

    for r, row in enumerate(rows):
        for i in range(row.num_blocks):
            table[r, i] = absolute(row, i)
        for t, p in enumerate(row.positions.tolist()):
            if p >= 0:
                slots[r, t] = absolute(row, p // B) * B + p % B
    return slots, table


def test_buffers_keep_their_addresses_and_every_layer_gets_its_own_slots():
    rt = runtime()
    rt.admit("s", SPEC, rows=2)
    seen = set()
    for commit in (True, False, False, True, False):
        with rt.forward("s", "commit" if commit else "denoise") as active:
            meta, rows = active.meta, active.plan.rows
            seen.add(meta.addresses() + (rt.pool.tensor.data_ptr(),))
            for layer in range(rt.pool.num_layers):
                slots, table = expected_layer_metadata(rt.pool, rows, layer, active.bucket.tokens, meta.width)
                assert torch.equal(meta.slot_mapping[layer], slots), f"layer {layer}'s slots"
                assert torch.equal(meta.block_table[layer], table), f"layer {layer}'s block table"
                assert torch.equal(meta.layers[layer].slot_mapping, slots)
                assert torch.equal(meta.layers[layer].block_table, table)
            managed_tokens = sum(int(r.managed[r.positions.clamp(min=0) // B][r.positions >= 0].sum()) for r in rows)
            if managed_tokens:  # the check above can tell layers apart only where tokens land in managed blocks
                assert not torch.equal(meta.slot_mapping[1], meta.slot_mapping[0])
    assert len(seen) == 1, "metadata buffers and the pool must never move"
    assert rt.metadata.builds == 4, "the repeated denoise layout is not rebuilt"
    assert rt.metadata.copies == 1 + 4, "the bucket's padding state, then one copy per build"
    assert rt.metadata.h2d_copies == 0, "CPU metadata: nothing crosses to a device"


def test_padding_follows_the_op_conventions():
    rt = runtime()
    spec = HunyuanSpec((5,), 6, ((1, 5),))
    rt.admit("r", spec)
    with rt.forward_plan(rt.scheduler.plan("r", "prefill", prefix_capacity=8,
                                           attention_mask=spec.padded_mask(8))):
        pass
    bucket = Bucket(2, 14, 8)  # a 2-row bucket serving a 1-row request: row 1 is padding
    rt.scheduler.in_flight = None
    meta = rt.metadata.build(bucket, rt.scheduler.plan("r", "step", prefix_capacity=8).rows)
    assert torch.all(meta.slot_mapping[:, 1] == -1) and torch.all(meta.kv_visible_end[1] == 0)
    assert meta.seq_lens[1] == 0 and torch.all(meta.block_table[:, 1] == rt.pool.pad_block)
    assert torch.all(meta.slot_mapping[:, 0, 6:] == -1), "padded tokens are never written"
    assert torch.all(meta.kv_visible_end[0, 6:] == 0), "padded tokens see nothing"


def test_token_count_beyond_the_bucket_is_refused_without_change():
    rt = runtime(buckets=(Bucket(2, SPEC.tokens_per_forward, SPEC.window_tokens),))
    rt.admit("s", SPEC, rows=2)
    before = rt.state()
    with pytest.raises(RequestError, match="beyond bucket"):
        rt.metadata.build(Bucket(2, 4, SPEC.window_tokens), rt.scheduler.plan("s", "denoise").rows)
    rt.scheduler.abort_forward(rt.scheduler.in_flight)
    assert rt.state() == before


def test_forward_outside_configured_buckets_fails_clearly():
    rt = runtime(buckets=(Bucket(2, 99, SPEC.window_tokens),))
    rt.admit("s", SPEC, rows=2)
    before = rt.state()
    with pytest.raises(RequestError, match="no configured bucket"):
        with rt.forward("s", "commit"):
            pass
    assert rt.state() == before


def test_metadata_benchmark_runs(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import metadata_cost

    assert metadata_cost.main(["--repeats", "2", "--json"]) == 0
    rows = {(r["model"], r["forward"]): r for r in json.loads(capsys.readouterr().out)}
    copies = {k: r["copies_per_forward"] for k, r in rows.items()}
    assert copies == {  # counted where the copies happen, not assumed
        ("DreamZero-14B", "commit (new blocks)"): 1.0, ("DreamZero-14B", "denoise: build"): 1.0,
        ("DreamZero-14B", "denoise: repeat"): 0.0, ("HunyuanImage-3", "prefill: build"): 1.0,
        ("HunyuanImage-3", "denoising step: build"): 1.0,
        ("HunyuanImage-3", "denoising step: repeat"): 0.0,
    }
    assert all(r["h2d_copies_per_forward"] == 0 for r in rows.values()), "CPU metadata: no host-to-device copy"
    assert all(r["torch_ops_per_build"] == 0 for r in rows.values()), "the host build is numpy only"


def test_a_build_dispatches_no_torch_compute_op_and_a_repeat_nothing():
    """The host build copies the plan's numpy rows into the staging buffer and copies that once: no torch
    operator at all (not even the `aten.detach` a `Tensor.numpy()` view dispatches), so nothing in it can wait
    on torch's intra-op thread pool; a repeated layout dispatches nothing and copies nothing."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from metadata_cost import OpCounter

    rt = runtime()
    rt.admit("s", SPEC, rows=2)
    for commit in (True, False):
        plan = rt.scheduler.plan("s", "commit" if commit else "denoise")
        bucket = rt.bucket_for(len(plan.rows), plan.tokens, plan.context)
        rt.metadata.buffers(bucket)  # its padding state is built outside the count
        with OpCounter() as fresh:
            rt.metadata.build(bucket, plan.rows, plan.key)
        assert fresh.ops == [], f"a {'commit' if commit else 'denoise'} build dispatched {fresh.ops}"
        rt.scheduler.finish_forward(plan)
    copies = rt.metadata.copies
    plan = rt.scheduler.plan("s", "denoise")
    with OpCounter() as repeat:
        rt.metadata.build(bucket, plan.rows, plan.key)
    assert repeat.ops == [] and rt.metadata.copies == copies, "a repeated denoise layout: no op, no copy"


def test_what_the_host_stages_does_not_grow_with_the_layer_count():
    """Per-layer ids are computed in the compiled graph from one base per layer (metadata.layer_metadata), so
    the buffers the host writes and copies are the same size for 3 layers and for 40."""
    sizes = {}
    for layers in (3, 40):
        cfg = PagedKVConfig(num_layers=layers, num_kv_heads=1, head_dim=4, block_size=B, blocks_per_layer=32,
                            max_rows=2, scratch_tokens_per_row=32)
        rt = PagedKVRuntime(cfg)
        meta = rt.metadata.buffers(Bucket(2, SPEC.tokens_per_forward, SPEC.window_tokens))
        sizes[layers] = (meta.host_buffer.numel(), meta.device_buffer.numel())
        assert len(meta.layers) == layers and meta.block_bases.shape == (layers,)
    assert sizes[3] == sizes[40]


class FakeStream:
    """A device stream the host runs ahead of: enqueued work runs only when an event after it is waited on
    (or at drain), reading the pinned staging buffer at THAT time, as an asynchronous copy does."""

    def __init__(self) -> None:
        self.pending: list = []
        self.log: list[str] = []

    def event(self) -> "FakeEvent":
        return FakeEvent(self)

    def run_until(self, n: int) -> None:
        while self.pending and self.pending[0][0] < n:
            _, name, work = self.pending.pop(0)
            self.log.append(f"run {name}")
            work()

    def drain(self) -> None:
        self.run_until(10**9)


class FakeEvent:
    counter = 0

    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.mark = stream, None

    def record(self) -> None:
        self.mark = FakeEvent.counter

    def synchronize(self) -> None:
        self.stream.log.append("wait")
        self.stream.run_until(self.mark + 1)


def test_staging_buffer_is_never_written_while_a_copy_out_of_it_is_pending():
    """Host runs ahead (no sync between forwards). Each copy, when it finally runs, must deliver the plan
    that was staged for it -- not the next plan's values written into the same pinned buffer meanwhile."""
    rt = runtime()
    rt.admit("s", SPEC, rows=2)
    plans, bucket = [], None
    for commit in (True, True, False, True, True):  # layouts differ forward to forward
        plan = rt.scheduler.plan("s", "commit" if commit else "denoise")
        bucket = Bucket(len(plan.rows), plan.tokens, plan.context)
        plans.append(plan)
        rt.scheduler.finish_forward(plan)
    # What each forward's metadata must be: built synchronously, one at a time.
    from paged_kv_compile.metadata import MetadataBuilder

    want = []
    sync = MetadataBuilder(rt.pool)
    for plan in plans:
        m = sync.build(bucket, plan.rows)
        want.append([t.clone() for t in (m.slot_mapping, m.block_table, m.seq_lens, m.kv_visible_end)])

    stream = FakeStream()
    builder = MetadataBuilder(rt.pool)
    meta = builder.buffers(bucket)
    meta.new_event = stream.event
    delivered = []
    run_copy = meta.copy_in

    def deferred(host):
        FakeEvent.counter += 1
        n = FakeEvent.counter

        def work():
            run_copy(host)
            delivered.append([t.clone() for t in (meta.slot_mapping, meta.block_table, meta.seq_lens,
                                                  meta.kv_visible_end)])
        stream.pending.append((n, f"copy {n}", work))
        stream.log.append(f"enqueue copy {n}")

    meta.copy_in = deferred
    for plan in plans:  # the host builds every forward's metadata without waiting for the device
        builder.build(bucket, plan.rows)
    stream.drain()
    assert len(delivered) == len(plans)
    for i, (got, exp) in enumerate(zip(delivered, want)):
        for g, e in zip(got, exp):
            assert torch.equal(g, e), f"forward {i}'s copy delivered another forward's metadata: {stream.log}"
    assert "wait" in stream.log, "with five forwards in flight the host must have waited for a buffer"


def _random_row(rng, pool, max_tokens: int, width: int) -> RowLayout:
    m = int(rng.integers(1, width + 1))
    managed = int(rng.integers(0, m + 1))
    t = int(rng.integers(0, max_tokens + 1))
    positions = rng.integers(-1, m * pool.block_size, size=t)
    ends = np.where(positions >= 0, rng.integers(1, m * pool.block_size + 1, size=t), 0)
    local = rng.integers(0, pool.blocks_per_layer, size=managed).tolist()
    scratch = (pool.scratch_base + rng.integers(0, 4, size=m - managed)).tolist()
    return RowLayout.build(local, scratch, positions, ends, int(rng.integers(0, m * pool.block_size + 1)))


def test_each_build_leaves_exactly_its_own_layout_whatever_the_buffers_held_before():
    """The builder resets only what a staging buffer's last build wrote (its extent) and pads missing rows in
    one slice: after any sequence of layouts (rows of different lengths, fewer rows than the bucket, longer
    and shorter than before), every layer's metadata equals a build into fresh buffers and the oracle."""
    from paged_kv_compile.metadata import MetadataBuilder

    rt = runtime()
    pool, bucket = rt.pool, Bucket(2, 12, 32)
    builder = MetadataBuilder(pool)
    width = builder.buffers(bucket).width
    rng = np.random.default_rng(0)
    for step in range(24):
        rows = [_random_row(rng, pool, bucket.tokens, width) for _ in range(int(rng.integers(0, 3)))]
        meta = builder.build(bucket, rows)
        fresh = MetadataBuilder(pool).build(bucket, rows)
        for name in ("positions", "table0", "table_managed", "seq_lens", "kv_visible_end"):
            assert torch.equal(getattr(meta, name), getattr(fresh, name)), f"step {step}: {name}"
        for layer in (0, pool.num_layers - 1):
            slots, table = expected_layer_metadata(pool, rows, layer, bucket.tokens, width)
            padded = slots.new_full((bucket.rows, bucket.tokens), -1)
            padded[: len(rows)] = slots
            assert torch.equal(meta.slot_mapping[layer], padded), f"step {step}: layer {layer}'s slots"
            assert torch.equal(meta.block_table[layer, : len(rows)], table), f"step {step}: layer {layer}'s table"
            assert torch.all(meta.block_table[layer, len(rows):] == pool.pad_block)
        for r, row in enumerate(rows):
            assert torch.equal(meta.kv_visible_end[r, : row.num_tokens], row.visible_end.to(torch.int32))
            assert torch.all(meta.kv_visible_end[r, row.num_tokens:] == 0) and meta.seq_lens[r] == row.seq_len
        assert torch.all(meta.kv_visible_end[len(rows):] == 0) and torch.all(meta.seq_lens[len(rows):] == 0)


def test_a_layout_whose_positions_pass_its_table_is_refused_and_nothing_changes():
    """The position check uses the layout's own `max_position` (no reduction per build); a row writing past
    its table is refused before anything is staged: same buffer bytes, no copy."""
    from paged_kv_compile.metadata import MetadataBuilder

    rt = runtime()
    builder = MetadataBuilder(rt.pool)
    bucket = Bucket(2, 8, 16)
    good = RowLayout.build([0, 1], [], np.arange(4), np.full(4, 4), 4)
    meta = builder.build(bucket, [good])
    before, copies = meta.device_buffer.clone(), builder.copies
    bad = RowLayout.build([0], [], np.array([0, 2 * B]), np.array([1, 2]), 2)  # position 8 in a 1-block table
    assert bad.max_position == 2 * B
    with pytest.raises(RequestError, match="inconsistent"):
        builder.build(bucket, [good, bad])
    assert torch.equal(meta.device_buffer, before) and builder.copies == copies


def test_a_build_without_regions_clears_the_regions_an_earlier_upload_left_on_the_device():
    """An upload copies only the window part while neither the staging buffer nor the device buffer holds a
    region; the first build after a forward that read regions must still clear them on the device (through
    either staging buffer), and later builds without regions keep the device's region table padded."""
    from types import SimpleNamespace

    from paged_kv_compile.metadata import MetadataBuilder

    rt = runtime()
    builder = MetadataBuilder(rt.pool, region_tokens=2 * B)
    bucket = Bucket(2, 8, 16)
    row = RowLayout.build([0, 1], [], np.arange(4), np.full(4, 4), 4)
    region = SimpleNamespace(blocks=[3, 4], tokens=2 * B - 1)
    meta = builder.build(bucket, [row, row], regions=[region, None])
    assert meta.region_seq_lens.tolist() == [2 * B - 1, 0] and meta.region_table0[0].tolist() == [3, 4]
    for step in range(3):
        shifted = RowLayout.build([0, 1], [], np.arange(step, step + 4), np.full(4, step + 4), step + 4)
        meta = builder.build(bucket, [shifted])
        assert meta.region_seq_lens.tolist() == [0, 0], f"build {step} left a region on the device"
        assert torch.all(meta.region_table0 == rt.pool.pad_block) and torch.all(meta.region_visible_end == 0)
        assert not meta.region_managed.any()
        assert meta.positions[0, :4].tolist() == list(range(step, step + 4)), f"build {step}: window part"
