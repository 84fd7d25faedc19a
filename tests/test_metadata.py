"""Metadata: persistent per-bucket buffers, the op's padding conventions, one copy per forward."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from paged_kv_compile import PagedKVConfig, RequestError
from paged_kv_compile.config import Bucket
from paged_kv_compile.runtime import PagedKVRuntime
from paged_kv_compile.scheduler import DreamZeroSpec, HunyuanSpec

B = 4
SPEC = DreamZeroSpec(frame_seqlen=8, chunk_frames=1, window_frames=4, sink_frames=0, action_tokens=3)


def runtime(**kw) -> PagedKVRuntime:
    cfg = PagedKVConfig(num_layers=3, num_kv_heads=1, head_dim=4, block_size=B, blocks_per_layer=32, max_rows=2,
                        scratch_tokens_per_row=32, **kw)
    return PagedKVRuntime(cfg)


def test_buffers_keep_their_addresses_and_layers_differ_only_by_base():
    rt = runtime()
    rt.open_session("s", SPEC, rows=2)
    seen = set()
    for commit in (True, False, False, True, False):
        with rt.dreamzero_forward("s", commit=commit) as active:
            meta = active.meta
            seen.add(meta.addresses() + (rt.pool.tensor.data_ptr(),))
            per_layer = rt.pool.blocks_per_layer
            for layer in range(1, 3):
                managed = meta.slot_mapping[layer] >= per_layer * B * layer
                # a managed slot of layer l is layer 0's slot shifted by l whole layers; scratch is shared
                shift = torch.where(managed & (meta.slot_mapping[layer] < rt.pool.scratch_base * B),
                                    per_layer * B * layer, 0)
                assert torch.equal(meta.slot_mapping[layer], meta.slot_mapping[0] + shift)
    assert len(seen) == 1, "metadata buffers and the pool must never move"
    assert rt.metadata.h2d_copies == 4, "one copy per forward; the repeated denoise layout is not rebuilt"


def test_padding_follows_the_op_conventions():
    rt = runtime()
    rt.admit_request("r", HunyuanSpec((5,), 6, ((1, 5),)))
    with rt.forward(rt.scheduler.plan_hunyuan("r", phase="prefill", prefix_capacity=8)):
        pass
    bucket = Bucket(2, 14, 8)  # a 2-row bucket serving a 1-row request: row 1 is padding
    rt.scheduler.in_flight = None
    meta = rt.metadata.build(bucket, rt.scheduler.plan_hunyuan("r", phase="step", prefix_capacity=8).rows)
    assert torch.all(meta.slot_mapping[:, 1] == -1) and torch.all(meta.kv_visible_end[1] == 0)
    assert meta.seq_lens[1] == 0 and torch.all(meta.block_table[:, 1] == rt.pool.pad_block)
    assert torch.all(meta.slot_mapping[:, 0, 6:] == -1), "padded tokens are never written"
    assert torch.all(meta.kv_visible_end[0, 6:] == 0), "padded tokens see nothing"


def test_token_count_beyond_the_bucket_is_refused_without_change():
    rt = runtime(buckets=(Bucket(2, SPEC.tokens_per_forward, SPEC.window_tokens),))
    rt.open_session("s", SPEC, rows=2)
    before = rt.state()
    with pytest.raises(RequestError, match="beyond bucket"):
        rt.metadata.build(Bucket(2, 4, SPEC.window_tokens), rt.scheduler.plan_dreamzero("s", commit=False).rows)
    rt.scheduler.abort_forward(rt.scheduler.in_flight)
    assert rt.state() == before


def test_forward_outside_configured_buckets_fails_clearly():
    rt = runtime(buckets=(Bucket(2, 99, SPEC.window_tokens),))
    rt.open_session("s", SPEC, rows=2)
    before = rt.state()
    with pytest.raises(RequestError, match="no configured bucket"):
        with rt.dreamzero_forward("s", commit=True):
            pass
    assert rt.state() == before


def test_metadata_benchmark_runs(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import metadata_cost

    assert metadata_cost.main(["--repeats", "2", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"DreamZero-14B"' in out and '"h2d_copies_per_forward": 1.0' in out
