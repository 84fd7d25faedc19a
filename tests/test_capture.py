"""Warm-up and capture: what CUDA-graph replay depends on, checked on CPU; capture itself on a GPU.

After warm-up a whole rollout compiles nothing (counted, and `fail_on_recompile` is on while
serving); every address a captured graph reads stays put; a forward outside the warmed-up buckets
fails clearly, or runs uncaptured when configured to.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import CountingBackend, compile_blocks, random_prompts

from paged_kv_compile.capture import CaptureError, CapturedBlocks, EmulatedGraphs, unique_graphs, warm_up
from paged_kv_compile.families.dreamzero import dreamzero_block_inputs, dreamzero_buckets, dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import hunyuan_buckets, hunyuan_layer_inputs, hunyuan_runtime_config
from paged_kv_compile.config import Bucket
from paged_kv_compile.driver import paged_run
from paged_kv_compile.errors import ConfigError, RequestError
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate
from paged_kv_compile.runtime import PagedKVRuntime

ATOL = 1e-5
DZ_CFG = DreamZeroConfig(sink_size=2)  # window 6 frames + 2-frame sink; slides after 3 commits, resets after 8 chunks
HY_CFG = HunyuanImage3Config()
CAPACITY = 12


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _dreamzero(device="cpu", inner="aot_eager", buckets=None):
    model = DreamZeroModel(DZ_CFG, seed=1).to(device)
    buckets = dreamzero_buckets(DZ_CFG) if buckets is None else buckets
    runtime = PagedKVRuntime(dreamzero_runtime_config(DZ_CFG, block_size=8, kernel="reference", buckets=buckets,
                                                      device=device))
    runtime.bind(model.blocks)
    backend = CountingBackend({"inner_compiler": inner})
    compile_blocks(model.blocks, backend)
    return model, runtime, backend


def _prompts(lengths, seed=0):
    return random_prompts(HY_CFG.vocab, lengths, seed)


def _hunyuan(buckets, runtime_buckets=None):
    model = HunyuanImage3Model(HY_CFG, seed=2)
    runtime = PagedKVRuntime(hunyuan_runtime_config(
        HY_CFG, max_prefix=CAPACITY, block_size=4, kernel="reference",
        buckets=buckets if runtime_buckets is None else runtime_buckets))
    runtime.bind(model.layers)
    backend = CountingBackend({"inner_compiler": "aot_eager"})
    compile_blocks(model.layers, backend)
    return model, runtime, backend


def _dense_hunyuan(prompts):
    return hunyuan_generate(HunyuanImage3Model(HY_CFG, seed=2), prompts, prefix_capacity=CAPACITY, num_steps=3, seed=5)


# ---- warm-up, then serving compiles nothing --------------------------------------------------------


def test_dreamzero_warmup_then_rollout_compiles_nothing_and_matches_dense(capfd):
    dense = dreamzero_rollout(DreamZeroModel(DZ_CFG, seed=1), num_chunks=10, num_inference_steps=2, seed=3)
    model, runtime, backend = _dreamzero()
    captured = warm_up(model, runtime)
    err = capfd.readouterr().err
    assert "compiling rows=2 tokens=37 context=96" in err  # the progress bar names the bucket
    assert "compile" in err and " s" in err
    report = captured.report
    assert [b.bucket for b in report.buckets] == list(dreamzero_buckets(DZ_CFG))
    assert report.buckets[0].graphs_compiled == 1 and report.buckets[0].compile_s > 0
    assert not report.captured and report.buckets[0].cuda_graphs == 0
    assert "rows=2 tokens=37 context=96: compile" in report.format()
    assert backend.frames == 1

    graphs = unique_graphs()
    with captured.serving():  # fail_on_recompile: a compile here raises
        paged = paged_run(model, runtime, num_chunks=10, num_inference_steps=2, seed=3)
    assert unique_graphs() == graphs and backend.frames == 1
    assert dense["resets"] == paged["resets"] and dense["resets"]
    for key in ("video", "actions"):
        assert (dense[key] - paged[key]).abs().max().item() <= ATOL
    calls = (10 * 2 + 10 - 1 - len(dense["resets"])) * DZ_CFG.num_layers
    assert captured.stats["direct_calls"] == calls and captured.stats["fallback_calls"] == 0
    # RoPE tables and modulation are copied once per forward, not once per block.
    assert captured.stats["copies_skipped"] > 0
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def test_hunyuan_warmup_covers_every_bucket_and_serving_compiles_nothing():
    buckets = hunyuan_buckets(HY_CFG, [CAPACITY])
    assert len(buckets) == 4
    model, runtime, backend = _hunyuan(buckets)
    captured = warm_up(model, runtime, progress=False)
    assert backend.frames == 4
    assert sorted(b.bucket for b in captured.report.buckets) == sorted(buckets)
    assert all(b.graphs_compiled == 1 for b in captured.report.buckets)
    requests = [_prompts([9]), _prompts([11, 4], seed=1)]
    graphs = unique_graphs()
    with captured.serving():
        got = [paged_run(model, runtime, prompts=p, owner_id=f"r{i}", num_steps=3, seed=5)
               for i, p in enumerate(requests)]
    assert unique_graphs() == graphs and backend.frames == 4
    for prompts, out in zip(requests, got):
        assert (_dense_hunyuan(prompts) - out).abs().max().item() <= ATOL
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def test_addresses_never_change():
    model, runtime, _ = _dreamzero()
    captured = warm_up(model, runtime, progress=False)
    before = captured.addresses()
    assert set(before) >= {"pool", "metadata rows=2 tokens=37 context=96", "inputs rows=2 tokens=37 context=96"}
    standin = runtime.standin(2, 2, DZ_CFG.max_attention_size, DZ_CFG.num_heads, DZ_CFG.head_dim)
    assert standin.data_ptr() in before["inputs rows=2 tokens=37 context=96"]
    with captured.serving():
        paged_run(model, runtime, num_chunks=4, num_inference_steps=2, seed=3)
        paged_run(model, runtime, num_chunks=2, num_inference_steps=1, seed=4, owner_id="second")
    assert captured.addresses() == before
    meta = runtime.metadata.buffers(dreamzero_buckets(DZ_CFG)[0])
    assert meta.addresses() == before["metadata rows=2 tokens=37 context=96"]
    assert captured.static_bytes() > 0


def test_warmup_forward_is_all_padding_and_leaves_the_scheduler_alone():
    model, runtime, _ = _dreamzero()
    state = runtime.state()
    bucket = dreamzero_buckets(DZ_CFG)[0]
    pool_before = runtime.pool.tensor.clone()
    warm_up(model, runtime, progress=False, install=False)
    assert runtime.state() == state and runtime.active is None
    assert torch.equal(runtime.pool.tensor, pool_before)  # nothing written
    meta = runtime.metadata.buffers(bucket)
    assert (meta.slot_mapping == -1).all() and (meta.seq_lens == 0).all() and (meta.kv_visible_end == 0).all()
    assert meta.last_key == ()  # the next real forward rebuilds its metadata
    with pytest.raises(RequestError, match="not configured"):
        with runtime.warmup_forward(Bucket(1, 37, 96)):
            pass
    with runtime.warmup_forward(bucket):
        with pytest.raises(RequestError, match="already active"):
            with runtime.warmup_forward(bucket):
                pass


def test_install_keeps_the_model_usable_and_uninstall_restores_it():
    model, runtime, _ = _dreamzero()
    keys = set(model.state_dict())
    originals = list(model.blocks)
    captured = warm_up(model, runtime, progress=False)
    assert all(type(b).__name__ == "_CapturedBlock" for b in model.blocks)
    assert model.blocks[0].self_attn is originals[0].self_attn  # attribute access reaches the block
    runtime.bind(model.blocks)  # same parameters: binding through the wrappers is unchanged
    captured.uninstall()
    assert list(model.blocks) == originals and set(model.state_dict()) == keys


# ---- forwards that fit no warmed-up bucket -----------------------------------------------------------


def test_forward_outside_the_configured_buckets_fails_clearly():
    one_row = hunyuan_buckets(HY_CFG, [CAPACITY], rows=(1,))
    model, runtime, backend = _hunyuan(one_row)
    captured = warm_up(model, runtime, progress=False)
    state = runtime.state()
    with captured.serving(), pytest.raises(RequestError) as info:
        paged_run(model, runtime, prompts=_prompts([11, 4]), owner_id="two-rows", num_steps=2,
                  prefix_capacity=CAPACITY)
    message = str(info.value)
    assert "rows=2, tokens=30, context=12" in message and "configured" in message
    assert "Bucket(rows=1, tokens=30, context=12)" in message
    assert backend.frames == 2
    assert runtime.scheduler.owned_blocks() == state["owners"]
    assert runtime.scheduler.allocator.num_free == state["num_free"]


def test_configured_but_not_warmed_bucket_fails_clearly():
    buckets = hunyuan_buckets(HY_CFG, [CAPACITY])
    model, runtime, backend = _hunyuan(buckets)
    warmed = hunyuan_buckets(HY_CFG, [CAPACITY], rows=(1,))
    captured = CapturedBlocks(model.layers, runtime, lambda b: hunyuan_layer_inputs(model, runtime, b), buckets=warmed)
    captured.warmup(progress=False)
    with captured.serving(), pytest.raises(RequestError, match=r"was not warmed up \(warmed up: \[Bucket"):
        paged_run(model, runtime, prompts=_prompts([11, 4]), owner_id="two-rows", num_steps=2)
    assert backend.frames == 2  # nothing compiled for the missing bucket
    assert runtime.scheduler.in_flight is None and "two-rows" not in runtime.scheduler.owners


def test_fallback_eager_runs_an_unbucketed_forward_uncaptured_and_says_so():
    one_row = hunyuan_buckets(HY_CFG, [CAPACITY], rows=(1,))
    model, runtime, backend = _hunyuan(one_row)
    blocks_inputs = lambda b: hunyuan_layer_inputs(model, runtime, b)  # noqa: E731
    captured = CapturedBlocks(model.layers, runtime, blocks_inputs, fallback="eager")
    captured.warmup(progress=False)
    prompts = _prompts([11, 4])
    with captured.serving(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = paged_run(model, runtime, prompts=prompts, owner_id="two-rows", num_steps=3, seed=5,
                        prefix_capacity=CAPACITY)
    assert (out - _dense_hunyuan(prompts)).abs().max().item() <= ATOL
    assert any("running it uncaptured" in str(w.message) for w in caught)
    assert captured.stats["fallback_calls"] == 3 * HY_CFG.num_layers
    assert captured.stats["fallback_compiles"] == 2  # prefill and step shapes, compiled loudly, once each
    assert Bucket(2, 30, 12) in captured.fallback_buckets and Bucket(2, 30, 12) in runtime.bucket_misses
    assert backend.frames == 4


def test_a_silent_recompile_while_serving_is_an_error():
    model, runtime, _ = _dreamzero()
    captured = warm_up(model, runtime, progress=False)
    bucket = dreamzero_buckets(DZ_CFG)[0]
    args, _ = dreamzero_block_inputs(model, runtime, bucket)
    with runtime.warmup_forward(bucket):
        with torch.no_grad():
            captured.call(0, *args)
        with torch.enable_grad(), pytest.raises(Exception, match="fail_on_recompile"):
            captured.call(0, *args)  # grad mode is guarded: this would recompile
        bad = (args[0].double(),) + args[1:]
        with torch.no_grad(), pytest.raises(RequestError, match="argument 0 is a tensor .*float64"):
            captured.call(0, *bad)


# ---- refusals at warm-up --------------------------------------------------------------------------


def test_uncompiled_blocks_are_refused():
    model = DreamZeroModel(DZ_CFG, seed=1)
    runtime = PagedKVRuntime(dreamzero_runtime_config(DZ_CFG, block_size=8, buckets=dreamzero_buckets(DZ_CFG)))
    runtime.bind(model.blocks)
    with pytest.raises(CaptureError, match="ran no paged attention site"):
        warm_up(model, runtime, progress=False)


def test_bad_buckets_and_options_are_config_errors():
    model, runtime, _ = _dreamzero()
    inputs = lambda b: dreamzero_block_inputs(model, runtime, b)  # noqa: E731
    with pytest.raises(ConfigError, match="not configured on the runtime"):
        CapturedBlocks(model.blocks, runtime, inputs, buckets=[Bucket(2, 40, 96)])
    with pytest.raises(ConfigError, match="unknown fallback"):
        CapturedBlocks(model.blocks, runtime, inputs, fallback="silent")
    with pytest.raises(ConfigError, match="CUDA"):
        CapturedBlocks(model.blocks, runtime, inputs, capture=True)
    with pytest.raises(ConfigError, match="multiple of frame_seqlen"):
        dreamzero_block_inputs(model, runtime, Bucket(2, 40, 96))
    with pytest.raises(ConfigError, match="not a HunyuanImage-3 forward"):
        hunyuan_layer_inputs(HunyuanImage3Model(HY_CFG), runtime, Bucket(1, 7, 12))
    # torch's own patch(): pytest >= 9.2's monkeypatch deletes config entries on undo.
    with torch._dynamo.config.patch(recompile_limit=0), pytest.raises(ConfigError, match="recompile_limit"):
        CapturedBlocks(model.blocks, runtime, inputs).warmup(progress=False)


# ---- capture bookkeeping, with graphs emulated on CPU ------------------------------------------------


def test_emulated_capture_replays_through_static_buffers_and_matches_dense():
    """Replay re-runs each captured region on the static buffers, as a CUDA graph would read them."""
    dense = dreamzero_rollout(DreamZeroModel(DZ_CFG, seed=1), num_chunks=10, num_inference_steps=2, seed=3)
    model, runtime, backend = _dreamzero()
    captured = CapturedBlocks(model.blocks, runtime, lambda b: dreamzero_block_inputs(model, runtime, b),
                              graphs=EmulatedGraphs())
    report = captured.warmup(progress=False)
    assert report.graphs == "emulated" and report.buckets[0].cuda_graphs == DZ_CFG.num_layers
    before = captured.addresses()
    outputs = before["outputs rows=2 tokens=37 context=96"]
    assert len(outputs) == 1  # the hidden states; the returned cache is a stand-in, passed through
    graphs = unique_graphs()
    with captured.serving():
        paged = paged_run(model, runtime, num_chunks=10, num_inference_steps=2, seed=3)
    assert unique_graphs() == graphs and backend.frames == 1
    assert captured.stats["replays"] > 0 and captured.stats["direct_calls"] == 0
    assert captured.addresses() == before
    for key in ("video", "actions"):
        assert (dense[key] - paged[key]).abs().max().item() <= ATOL


def test_emulated_capture_serves_every_hunyuan_bucket():
    model, runtime, backend = _hunyuan(hunyuan_buckets(HY_CFG, [CAPACITY]))
    captured = CapturedBlocks(model.layers, runtime, lambda b: hunyuan_layer_inputs(model, runtime, b),
                              graphs=EmulatedGraphs())
    captured.warmup(progress=False)
    requests = [_prompts([9]), _prompts([11, 4], seed=1)]
    with captured.serving():
        got = [paged_run(model, runtime, prompts=p, owner_id=f"r{i}", num_steps=3, seed=5)
               for i, p in enumerate(requests)]
    for prompts, out in zip(requests, got):
        assert (_dense_hunyuan(prompts) - out).abs().max().item() <= ATOL
    assert captured.stats["replays"] == 2 * 3 * HY_CFG.num_layers and backend.frames == 4


# ---- on a GPU: capture and replay ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture_and_replay_match_eager():
    dense = dreamzero_rollout(DreamZeroModel(DZ_CFG, seed=1).cuda(), num_chunks=10, num_inference_steps=2, seed=3)
    model, runtime, backend = _dreamzero(device="cuda")
    captured = warm_up(model, runtime, progress=False)
    assert captured.capture and captured.report.buckets[0].cuda_graphs == DZ_CFG.num_layers
    before = captured.addresses()
    graphs = unique_graphs()
    with captured.serving():
        paged = paged_run(model, runtime, num_chunks=10, num_inference_steps=2, seed=3)
    torch.cuda.synchronize()
    assert unique_graphs() == graphs and backend.frames == 1
    assert captured.stats["replays"] > 0 and captured.stats["direct_calls"] == 0
    assert captured.addresses() == before
    for key in ("video", "actions"):
        assert (dense[key] - paged[key]).abs().max().item() <= 1e-4
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer
