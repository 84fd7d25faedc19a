"""A tensor-parallel block's in-place write survives the paged passes (one process; the 2-rank tests run the real one).

Dynamo traces vLLM's `RowParallelLinear` all-reduce (`dist.all_reduce(x)`, in place) as
`x.copy_(wait_tensor(all_reduce(x)))`, whose result nobody uses. FX's dead-code elimination treats in-place methods
as pure, so the rewrite's clean-up dropped the copy and every paged graph of a TP model lost its reductions
(vllm-omni's HunyuanImage-3 layers at TP 2: paged vs dense 11.1). On one rank an all-reduce is the identity, so the
same shape of code is reproduced here with an in-place scale whose result is unused.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, compile_blocks

from paged_kv_compile.driver import paged_run
from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.runtime import PagedKVRuntime

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
CFG = DreamZeroConfig(num_layers=2)


class InPlaceReduced(torch.nn.Module):
    """The output projection, then an in-place write into its result that returns nothing used (an all-reduce's
    shape: `out.copy_(reduced)`)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        out.mul_(0.5)  # result unused: only the write matters
        return out


def _model() -> DreamZeroModel:
    model = DreamZeroModel(CFG, seed=1)
    for block in model.blocks:
        block.self_attn.o = InPlaceReduced(block.self_attn.o)
    return model


def test_tensor_parallel_in_place_write_with_unused_result_survives_the_rewrite():
    dense = dreamzero_rollout(_model(), num_chunks=2, num_inference_steps=2, seed=3)
    model = _model()
    runtime = PagedKVRuntime(dreamzero_runtime_config(CFG, block_size=8, kernel="reference"))
    runtime.bind(model.blocks)
    backend = CountingBackend({"inner_compiler": "aot_eager"})
    compile_blocks(model.blocks, backend)
    paged = paged_run(model, runtime, num_chunks=2, num_inference_steps=2, seed=3)
    assert all(r.status == "rewritten" for res in backend.results for r in res.reports if r.status != "dense")
    kept = [n for res in backend.results for n in res.graph_module.graph.nodes if n.target == "mul_"]
    assert kept, "the in-place write is still in the rewritten graph"
    for key in ("video", "actions"):
        assert (dense[key] - paged[key]).abs().max().item() <= 1e-5
