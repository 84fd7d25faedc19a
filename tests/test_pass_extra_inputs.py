"""The op's extra graph inputs are described once (passes/extra_inputs.py), for the pass and the backend alike.

The rewrite makes its placeholders from `extra_inputs(...)` and keeps that list as `PassResult.inputs`; the
backend appends `extra_values(result.inputs, ...)`. So the two cannot disagree: reordering the descriptor changes
both sides together (a permuted rollout is bit-exact to the usual one), and every input, FP8 scales and region
table included, lands on the placeholder that names it.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, compile_blocks

from paged_kv_compile.config import Bucket
from paged_kv_compile.driver import paged_run
from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.passes import extra_inputs as ei
from paged_kv_compile.runtime import PagedKVRuntime

# as tests/test_shared_region_attend.py: a window site and a shared-region site per block
CFG = DreamZeroConfig(num_layers=2, sink_size=2, text_len=5, image_len=3)
ROLLOUT = dict(num_chunks=3, num_inference_steps=1, seed=3, shared_kv=True, cache_salt="t")

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_grad")


def _paged(fp8: bool):
    """A paged rollout with region sites (and an FP8 pool): (outputs, the graph's pass result, the runtime)."""
    torch._dynamo.reset()
    model = DreamZeroModel(CFG, seed=1)
    runtime = PagedKVRuntime(dreamzero_runtime_config(
        CFG, block_size=8, max_rows=2, cross_regions=2, kernel="reference", inner_compiler="aot_eager",
        kv_dtype=torch.float8_e4m3fn if fp8 else None))
    runtime.bind(model.blocks)
    backend = CountingBackend({"inner_compiler": "aot_eager"})
    compile_blocks(model.blocks, backend)
    out = paged_run(model, runtime, **ROLLOUT)
    assert backend.frames == 1
    return out, backend.results[0], runtime


def _added_placeholders(result) -> list[str]:
    names = [n.name for n in result.graph_module.graph.nodes if n.op == "placeholder"]
    return names[len(names) - len(result.inputs):]


@pytest.mark.parametrize("fp8", [False, True])
def test_the_graph_gets_exactly_the_described_inputs_and_the_backend_their_tensors(fp8):
    out, result, runtime = _paged(fp8)
    if not fp8:  # the usual order is right: dense parity (an FP8 pool is close to dense, not within 1e-5)
        dense = dreamzero_rollout(DreamZeroModel(CFG, seed=1), num_chunks=3, num_inference_steps=1, seed=3)
        assert max((dense[k] - out[k]).abs().max().item() for k in ("video", "actions")) <= 1e-5
    want = ei.extra_inputs(fp8=fp8, gaps=runtime.config.kv_gaps, regions=True, sites=len(result.sites))
    assert result.inputs == want
    assert (ei.KV_SCALES in want) == fp8 and ei.REGION_TABLE0 in want
    assert (ei.KV_GAP in want) == runtime.config.kv_gaps  # its blocks divide the frame: no row hides a key
    assert _added_placeholders(result) == [i.name for i in want]
    meta = runtime.metadata.buffers(Bucket(*result.shape))
    values = ei.extra_values(result.inputs, runtime.pool, meta, [0, 1])
    expected = {ei.POOL: runtime.pool.tensor, ei.KV_SCALES: runtime.pool.scales, ei.SEQ_LENS: meta.seq_lens,
                ei.REGION_VISIBLE_END: meta.region_visible_end, ei.block_base(1): meta.layers[1].block_base}
    for i, value in zip(result.inputs, values):
        if i in expected:
            assert value is expected[i], i.name


def test_a_reordered_descriptor_reorders_both_sides(monkeypatch):
    """With the shared inputs reversed, the pass adds them reversed and the backend supplies them reversed: the
    rollout is bit-exact to the usual order's. A backend with an order of its own would hand the pool where the
    graph reads a region table (checked: it fails)."""
    usual, usual_result, _ = _paged(fp8=True)
    monkeypatch.setattr(ei, "SHARED", tuple(reversed(ei.SHARED)))
    reordered, result, _ = _paged(fp8=True)
    assert _added_placeholders(result)[:2] == ["paged_kv_region_visible_end", "paged_kv_region_seq_lens"]
    assert _added_placeholders(result) != _added_placeholders(usual_result)
    for key in ("video", "actions"):
        assert torch.equal(usual[key], reordered[key]), key


def test_the_descriptor_refuses_an_inconsistent_input():
    with pytest.raises(ValueError, match="inconsistent extra input"):
        ei.ExtraInput("x", "layer", "block_base")  # a per-layer input without its site
    with pytest.raises(ValueError, match="inconsistent extra input"):
        ei.ExtraInput("x", "runtime", "pool")
