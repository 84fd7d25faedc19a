"""The captured path is the checked path: every per-call host check runs before a replay.

A CUDA-graph replay runs none of the compiled function's Python, so the checks it promises per call (the session
against the compiled site, the rolling history, shared regions, Tencent's write positions, the dense mask, every
layer of a commit) run on the recorded arguments before the replay. These tests serve through
`CompiledOnlyGraphs`, whose replay calls only the inner compiled graphs: what a CUDA graph runs. Each refusal
is checked to leave `runtime.state()` exactly as before the forward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import CountingBackend, compile_blocks, random_prompts

from paged_kv_compile.capture import CapturedBlocks, CompiledOnlyGraphs
from paged_kv_compile.capture.calls import record_calls
from paged_kv_compile.driver import paged_run
from paged_kv_compile.errors import RequestError
from paged_kv_compile.families.dreamzero import (
    DreamZeroSpec,
    dreamzero_block_inputs,
    dreamzero_buckets,
    dreamzero_runtime_config,
)
from paged_kv_compile.families.hunyuan_image3 import hunyuan_buckets, hunyuan_layer_inputs, hunyuan_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate
from paged_kv_compile.runtime import PagedKVRuntime

DZ_CFG = DreamZeroConfig(sink_size=2)
HY_CFG = HunyuanImage3Config()
CAPACITY = 12

pytestmark = pytest.mark.usefixtures("fresh_dynamo")



def _refused(runtime, owner_id: str, kind: str, body, match: str, **args) -> None:
    """`body()` inside a forward is refused with `match`, and the runtime is left exactly as it was."""
    before = runtime.state()
    with pytest.raises(RequestError, match=match):
        with torch.no_grad(), runtime.forward(owner_id, kind, **args):
            body()
    assert runtime.state() == before


def _dreamzero(**config):
    model = DreamZeroModel(DZ_CFG, seed=1)
    runtime = PagedKVRuntime(dreamzero_runtime_config(DZ_CFG, block_size=8, kernel="reference",
                                                      buckets=dreamzero_buckets(DZ_CFG), sessions=2, **config))
    runtime.bind(model.blocks)
    backend = CountingBackend({"inner_compiler": "aot_eager"})
    compile_blocks(model.blocks, backend)
    return model, runtime, backend


def _capture(model, blocks, runtime, inputs, **kw) -> CapturedBlocks:
    captured = CapturedBlocks(blocks, runtime, lambda b: inputs(model, runtime, b), graphs=CompiledOnlyGraphs(), **kw)
    captured.warmup(progress=False)
    return captured


def _prompts(lengths, seed=0):
    return random_prompts(HY_CFG.vocab, lengths, seed)


def _hunyuan(check_mask: bool = False):
    model = HunyuanImage3Model(HY_CFG, seed=2)
    runtime = PagedKVRuntime(hunyuan_runtime_config(HY_CFG, max_prefix=CAPACITY, block_size=4, kernel="reference",
                                                    buckets=hunyuan_buckets(HY_CFG, [CAPACITY])))
    runtime.bind(model.layers)
    backend = CountingBackend({"inner_compiler": "aot_eager", "check_mask": check_mask})
    compile_blocks(model.layers, backend)
    return model, runtime, backend


# ---- the no-Python replay serves both families, exactly -------------------------------------------------------


def test_a_replay_that_runs_no_python_serves_a_dreamzero_rollout_exactly():
    dense = dreamzero_rollout(DreamZeroModel(DZ_CFG, seed=1), num_chunks=5, num_inference_steps=2, seed=3)
    model, runtime, backend = _dreamzero()
    captured = _capture(model, model.blocks, runtime, dreamzero_block_inputs)
    assert captured.report.graphs == "compiled-only"
    with captured.serving(), record_calls() as python_calls:
        paged = paged_run(model, runtime, num_chunks=5, num_inference_steps=2, seed=3)
    assert python_calls == []  # no compiled paged function ran: only the inner graphs did
    forwards = 5 * 2 + 5 - 1 - len(dense["resets"])
    assert captured.stats["replays"] == forwards * DZ_CFG.num_layers and captured.stats["direct_calls"] == 0
    assert captured.stats["checks"] == forwards * DZ_CFG.num_layers  # one recorded check per replayed block
    for key in ("video", "actions"):
        assert torch.equal(dense[key], paged[key])
    assert backend.frames == 1 and runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def test_a_replay_that_runs_no_python_serves_hunyuan_generations_exactly():
    model, runtime, backend = _hunyuan()
    captured = _capture(model, model.layers, runtime, hunyuan_layer_inputs)
    requests = [_prompts([9]), _prompts([11, 4], seed=1)]
    with captured.serving(), record_calls() as python_calls:
        got = [paged_run(model, runtime, prompts=p, owner_id=f"r{i}", num_steps=3, seed=5)
               for i, p in enumerate(requests)]
    assert python_calls == []
    for prompts, out in zip(requests, got):
        dense = hunyuan_generate(HunyuanImage3Model(HY_CFG, seed=2), prompts, prefix_capacity=CAPACITY, num_steps=3,
                                 seed=5)
        assert (dense - out).abs().max().item() <= 1e-5
    assert captured.stats["replays"] == 2 * 3 * HY_CFG.num_layers and backend.frames == 4


# ---- the defect's own scenario: a session that disagrees with the compiled site -------------------------------


def _dreamzero_forward_inputs(model, runtime, seed: int = 0):
    """What `DreamZeroModel.forward` takes for one chunk of a paged session (stand-in caches, dense cross K/V)."""
    cfg, g = model.cfg, torch.Generator().manual_seed(seed)
    latents = torch.randn(2, cfg.chunk_tokens, cfg.in_channels, generator=g)
    actions = torch.randn(2, cfg.action_register_length, cfg.action_dim, generator=g)
    context = torch.randn(2, cfg.text_len, cfg.text_dim, generator=g)
    caches = [runtime.standin(2, 2, cfg.max_attention_size, cfg.num_heads, cfg.head_dim)] * cfg.num_layers
    with torch.no_grad():
        cross = model.prepare_cross_kv(context)
    return latents, actions, torch.full((2,), 500.0), 0, caches, cross


def test_a_session_whose_sink_disagrees_with_the_compiled_site_is_refused_on_the_captured_path():
    """Refused uncaptured (check_expectation) and now also captured, before the replay; before the fix the replay ran
    every block of every forward to completion with 0 checks."""
    model, runtime, _ = _dreamzero()
    inputs = _dreamzero_forward_inputs(model, runtime)
    wrong = DreamZeroSpec.from_model_config(dataclasses.replace(DZ_CFG, sink_size=0))
    runtime.admit("right", DreamZeroSpec.from_model_config(DZ_CFG), rows=2)
    runtime.admit("wrong", wrong, rows=2)
    match = r"disagree on sink_tokens \(graph 32, session 0\)"
    _refused(runtime, "wrong", "denoise", lambda: model(*inputs, update_kv_cache=False), match)  # uncaptured
    captured = _capture(model, model.blocks, runtime, dreamzero_block_inputs)
    with captured.serving():
        with torch.no_grad(), runtime.forward("right", "denoise"):
            right = model(*inputs, update_kv_cache=False)
        replays = captured.stats["replays"]
        for kind in ("denoise", "commit"):
            _refused(runtime, "wrong", kind, lambda: model(*inputs, update_kv_cache=kind == "commit"), match)
        assert captured.stats["replays"] == replays  # refused before any replay
        with torch.no_grad(), runtime.forward("right", "denoise"):
            again = model(*inputs, update_kv_cache=False)
    assert all(torch.equal(a, b) for a, b in zip(right[:2], again[:2]))


def test_blocks_rebound_after_capture_are_refused_on_the_captured_path():
    """The captured graphs keep the layer bases they were captured with: weights bound to other layers since
    (or to another runtime) are refused instead of reading another layer's KV."""
    model, runtime, _ = _dreamzero()
    inputs = _dreamzero_forward_inputs(model, runtime)
    runtime.admit("s", DreamZeroSpec.from_model_config(DZ_CFG), rows=2)
    captured = _capture(model, model.blocks, runtime, dreamzero_block_inputs)
    blocks = list(captured.blocks)
    runtime.bind(blocks[::-1])  # every block now serves the mirrored layer
    with captured.serving():
        _refused(runtime, "s", "denoise", lambda: model(*inputs, update_kv_cache=False),
                 r"captured for layers \(0,\) of this runtime.*Warm up \(and capture\) again")


# ---- the other per-call checks on the captured path ------------------------------------------------------------


def test_a_forward_without_the_shared_region_its_graph_reads_is_refused_on_the_captured_path():
    """The compiled cross-attention reads each row's shared region (it was handed a region stand-in): a session
    opened without cross K/V holds none, and is refused captured as uncaptured (`ForwardContext.check_regions`)."""
    model, runtime, _ = _dreamzero(cross_regions=2)
    latents, actions, t, start, caches, cross = _dreamzero_forward_inputs(model, runtime)
    standins = [runtime.region_standin(2, 2, DZ_CFG.cross_len, DZ_CFG.num_heads, DZ_CFG.head_dim)] * DZ_CFG.num_layers
    spec = DreamZeroSpec.from_model_config(DZ_CFG)
    runtime.admit("shared", spec, rows=2, cross_kv=cross)
    runtime.admit("bare", spec, rows=2)
    inputs = (latents, actions, t, start, caches, standins)
    match = r"reads a \d+-token shared region .* row 0 of this denoise forward \('bare'\) holds no shared region"
    _refused(runtime, "bare", "denoise", lambda: model(*inputs, update_kv_cache=False), match)  # uncaptured
    with torch.no_grad(), runtime.forward("shared", "denoise"):
        uncaptured = model(*inputs, update_kv_cache=False)
    captured = _capture(model, model.blocks, runtime, dreamzero_block_inputs)
    with captured.serving():
        _refused(runtime, "bare", "denoise", lambda: model(*inputs, update_kv_cache=False), match)
        with torch.no_grad(), runtime.forward("shared", "denoise"):
            replayed = model(*inputs, update_kv_cache=False)
    assert captured.stats["replays"] == DZ_CFG.num_layers
    assert all(torch.equal(a, b) for a, b in zip(uncaptured[:2], replayed[:2]))


def test_a_commit_that_skips_a_block_is_refused_on_the_captured_path():
    """Every layer must write a commit's K/V: the captured calls record the layers they served, and a commit whose
    loop skipped the last block is rolled back."""
    model, runtime, _ = _dreamzero()
    runtime.admit("s", DreamZeroSpec.from_model_config(DZ_CFG), rows=2)
    captured = _capture(model, model.blocks, runtime, dreamzero_block_inputs)
    args, _ = dreamzero_block_inputs(model, runtime, dreamzero_buckets(DZ_CFG)[0])

    def blocks(count):
        for i in range(count):
            captured.call(i, *args)

    _refused(runtime, "s", "commit", lambda: blocks(DZ_CFG.num_layers - 1), r"commit forward skipped layers \[3\]")
    with torch.no_grad(), runtime.forward("s", "commit"):
        blocks(DZ_CFG.num_layers)
    assert captured.stats["replays"] == 2 * DZ_CFG.num_layers - 1


def test_an_input_changed_through_data_is_copied_in_again():
    """The copy into a static buffer is skipped only for the same tensor within one forward: `t.data.copy_()`
    does not bump `t._version`, so a tensor changed that way between forwards must be copied again (it was not:
    the replay read the previous forward's values)."""
    model, runtime, _ = _dreamzero()
    runtime.admit("s", DreamZeroSpec.from_model_config(DZ_CFG), rows=2)
    captured = _capture(model, model.blocks, runtime, dreamzero_block_inputs)
    args, _ = dreamzero_block_inputs(model, runtime, dreamzero_buckets(DZ_CFG)[0])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args[0].shape, generator=g)
    args = (x, torch.randn(args[1].shape, generator=g)) + tuple(args[2:5]) + (torch.randn(args[5].shape, generator=g),)
    with torch.no_grad():
        with runtime.forward("s", "denoise"):
            first = captured.call(0, *args)[0]
        x.data.copy_(torch.randn(x.shape, generator=g))  # invisible to x._version
        with runtime.forward("s", "denoise"):
            second = captured.call(0, *args)[0]
            direct = captured.blocks[0](*args)[0]
    assert not torch.equal(first, second) and torch.equal(second, direct)
