"""One graph per forward (`CapturedBlocks(..., granularity="forward")`), served by a replay that runs no Python.

Parity with dense eager for both families' loops, the graph and launch counts of both modes, and what the
forward graph refuses: blocks skipped, reordered, fed modified hidden states or a per-layer tensor of their own;
every block's host checks run before the one launch; a refused call leaves the runtime as it was.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import CountingBackend, compile_blocks

from paged_kv_compile.capture import CapturedBlocks, CompiledOnlyGraphs
from paged_kv_compile.capture.calls import record_calls
from paged_kv_compile.driver import paged_run
from paged_kv_compile.errors import ConfigError, RequestError
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
BUCKET = dreamzero_buckets(DZ_CFG)[0]

pytestmark = pytest.mark.usefixtures("fresh_dynamo")



def _dreamzero(granularity: str, fallback: str = "error", sessions: int = 1):
    """Tiny DreamZero compiled (aot_eager) and captured; each session's cross-attention K/V in 2 shared regions."""
    model = DreamZeroModel(DZ_CFG, seed=1)
    runtime = PagedKVRuntime(dreamzero_runtime_config(DZ_CFG, block_size=8, kernel="reference", buckets=[BUCKET],
                                                      sessions=sessions, cross_regions=2 * sessions))
    runtime.bind(model.blocks)
    compile_blocks(model.blocks, CountingBackend({"inner_compiler": "aot_eager"}))
    captured = CapturedBlocks(model.blocks, runtime, lambda b: dreamzero_block_inputs(model, runtime, b),
                              graphs=CompiledOnlyGraphs(), granularity=granularity, fallback=fallback)
    captured.warmup(progress=False)
    return model, runtime, captured


@pytest.mark.parametrize("granularity", ["forward", "block"])
def test_dreamzero_rollout_through_one_graph_per_forward_equals_dense(granularity):
    """A rollout through the model's own loop: exact vs dense eager; 1 graph and 1 launch per forward in the
    forward mode, one per block in the block mode; no compiled paged function's Python ran."""
    dense = dreamzero_rollout(DreamZeroModel(DZ_CFG, seed=1), num_chunks=5, num_inference_steps=2, seed=3)
    model, runtime, captured = _dreamzero(granularity)
    assert captured.report.buckets[0].cuda_graphs == (1 if granularity == "forward" else DZ_CFG.num_layers)
    with captured.serving(), record_calls() as python_calls:
        paged = paged_run(model, runtime, num_chunks=5, num_inference_steps=2, seed=3, shared_kv=True)
    assert python_calls == []
    forwards = 5 * 2 + 5 - 1
    launches = forwards * (1 if granularity == "forward" else DZ_CFG.num_layers)
    assert captured.stats["replays"] == launches and captured.stats["checks"] == forwards * DZ_CFG.num_layers
    assert captured.stats["direct_calls"] == captured.stats["fallback_calls"] == 0
    if granularity == "forward":  # one copy-in per forward: hidden states, modulation, RoPE cos and sin
        assert captured.stats["forward_served"] == forwards * DZ_CFG.num_layers
        assert captured.stats["copies"] == 4 * forwards
    for key in ("video", "actions"):
        assert torch.equal(dense[key], paged[key])
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def test_hunyuan_generations_through_one_graph_per_forward_equal_dense():
    model = HunyuanImage3Model(HY_CFG, seed=2)
    runtime = PagedKVRuntime(hunyuan_runtime_config(HY_CFG, max_prefix=CAPACITY, block_size=4, kernel="reference",
                                                    buckets=hunyuan_buckets(HY_CFG, [CAPACITY])))
    runtime.bind(model.layers)
    compile_blocks(model.layers, CountingBackend({"inner_compiler": "aot_eager"}))
    captured = CapturedBlocks(model.layers, runtime, lambda b: hunyuan_layer_inputs(model, runtime, b),
                              graphs=CompiledOnlyGraphs(), granularity="forward")
    captured.warmup(progress=False)
    assert [b.cuda_graphs for b in captured.report.buckets] == [1, 1, 1, 1]
    g = torch.Generator().manual_seed(0)
    requests = [[torch.randint(0, HY_CFG.vocab, (n,), generator=g) for n in lens] for lens in ((9,), (11, 4))]
    with captured.serving(), record_calls() as python_calls:
        got = [paged_run(model, runtime, prompts=p, owner_id=f"r{i}", num_steps=3, seed=5)
               for i, p in enumerate(requests)]
    assert python_calls == [] and captured.stats["replays"] == 2 * 3  # a prefill and two steps each
    for prompts, out in zip(requests, got):
        dense = hunyuan_generate(HunyuanImage3Model(HY_CFG, seed=2), prompts, prefix_capacity=CAPACITY, num_steps=3,
                                 seed=5)
        assert (dense - out).abs().max().item() <= 1e-5


# ---- what a forward graph refuses ----------------------------------------------------------------------------


def _session(model, runtime, owner="s", spec=None):
    with torch.no_grad():
        cross = model.prepare_cross_kv(torch.randn(2, DZ_CFG.text_len, DZ_CFG.text_dim))
    runtime.admit(owner, spec or DreamZeroSpec.from_model_config(DZ_CFG), rows=2, cross_kv=cross)


def _block_args(model, runtime, seed=0):
    args, _ = dreamzero_block_inputs(model, runtime, BUCKET)
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(args[0].shape, generator=g), torch.randn(args[1].shape, generator=g) * 0.1, *args[2:])


def _chain(blocks, args, order, change=None):
    """Call blocks in `order` (captured.call, or blocks[i] directly), each on the previous output;
    `change(i, args)` may alter block i's arguments."""
    call = blocks.call if isinstance(blocks, CapturedBlocks) else (lambda i, *a: blocks[i](*a))
    x = args[0]
    for i in order:
        block_args = (x, *args[1:]) if change is None else change(i, (x, *args[1:]))
        x = call(i, *block_args)[0]
    return x


MISUSES = {  # block order, and a change to block i's arguments (i, args) -> args
    "skip": ([0, 2, 3], None),
    "reorder": ([0, 2, 1, 3], None),
    "modified": ([0, 1, 2, 3], lambda i, a: (a[0] + 0, *a[1:]) if i == 2 else a),
    "modified in place": ([0, 1, 2, 3], lambda i, a: (a[0].mul_(1.0), *a[1:]) if i == 2 else a),
    "per-layer": ([0, 1, 2, 3], lambda i, a: (a[0], a[1].clone(), *a[2:]) if i == 3 else a),  # its own modulation
}


@pytest.mark.parametrize("misuse, why", [
    ("skip", r"block 2's call .*block 1 comes next in the captured order"),
    ("reorder", r"block 2's call .*block 1 comes next"),
    ("modified", r"block 2's call .*its first argument is not block 1's output as the graph computed it"),
    ("modified in place", r"block 2's call .*its first argument is not block 1's output as the graph computed it"),
    ("per-layer", r"block 3's call .*argument 1 is not the tensor block 0 received"),
])
def test_a_forward_graph_refuses_calls_it_did_not_run(misuse, why):
    """Blocks run in the model's order on each other's outputs, or the call is refused (fallback="error"), the
    forward rolled back and the runtime left as it was."""
    model, runtime, captured = _dreamzero("forward")
    _session(model, runtime)
    args = _block_args(model, runtime)
    order, change = MISUSES[misuse]
    before = runtime.state()
    with pytest.raises(RequestError, match=why), torch.no_grad(), runtime.forward("s", "denoise"):
        _chain(captured, args, order, change)
    assert runtime.state() == before


def test_with_fallback_eager_the_rest_of_a_forward_that_leaves_the_graph_runs_uncaptured_and_exactly():
    model, runtime, captured = _dreamzero("forward", fallback="eager")
    _session(model, runtime)
    args = _block_args(model, runtime)
    skip = [0, 1, 3]
    with torch.no_grad():
        with runtime.forward("s", "denoise"):
            expected = _chain(dict(enumerate(captured.blocks)), args, skip)  # the compiled blocks, uncaptured
        with runtime.forward("s", "denoise"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _chain(captured, args, skip)
    assert torch.equal(got, expected)
    assert any("block 3's call" in str(w.message) and "running it uncaptured" in str(w.message) for w in caught)
    assert captured.stats["replays"] == 1 and captured.stats["fallback_calls"] == 1


def test_every_blocks_host_checks_run_before_the_one_launch():
    """A session that disagrees with the compiled site is refused at block 0, before the graph launches."""
    model, runtime, captured = _dreamzero("forward", sessions=2)
    _session(model, runtime, "right")
    _session(model, runtime, "wrong", DreamZeroSpec.from_model_config(DreamZeroConfig(sink_size=0)))
    args = _block_args(model, runtime)
    before = runtime.state()
    with pytest.raises(RequestError, match=r"disagree on sink_tokens"), torch.no_grad(), \
            runtime.forward("wrong", "denoise"):
        _chain(captured, args, range(DZ_CFG.num_layers))
    assert runtime.state() == before and captured.stats["replays"] == 0
    with torch.no_grad(), runtime.forward("right", "commit"):
        _chain(captured, args, range(DZ_CFG.num_layers))
    assert captured.stats["replays"] == 1 and captured.stats["checks"] == DZ_CFG.num_layers  # the refused one: 0


def test_a_commit_that_stops_before_the_last_block_is_refused():
    """The launch ran every block, but layers count as served only when their block's call comes: a commit whose
    loop stopped early is rolled back by the runtime's every-layer check."""
    model, runtime, captured = _dreamzero("forward")
    _session(model, runtime)
    args = _block_args(model, runtime)
    before = runtime.state()
    with pytest.raises(RequestError, match=r"commit forward skipped layers \[3\]"), torch.no_grad(), \
            runtime.forward("s", "commit"):
        _chain(captured, args, range(DZ_CFG.num_layers - 1))
    assert runtime.state() == before


def test_unknown_granularity_is_a_config_error():
    model, runtime, _ = _dreamzero("block")
    with pytest.raises(ConfigError, match="unknown granularity 'layer'"):
        CapturedBlocks(model.blocks, runtime, lambda b: dreamzero_block_inputs(model, runtime, b),
                       granularity="layer")
