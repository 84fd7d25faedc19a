"""What each rank builds in the multi-rank paged tests: vllm-omni's real layers at the rank's parallel size, with
the one-rank weights, on a `RankRuntime` sized by `ParallelConfig.rank_config`.

Each function runs inside a worker of multirank.py after `RankPool.setup(...)`; the parallel configuration comes
from vllm-omni's own parallel_state getters (`ParallelConfig.from_vllm_omni`), exactly as in a deployment.
"""

from __future__ import annotations

from typing import Any

import torch
from helpers import CountingBackend, compile_blocks, host_syncs

from paged_kv_compile import KVPool, PagedKVConfig, PagedKVRuntime
from paged_kv_compile.adapters import vllm_omni_hunyuan
from paged_kv_compile.distributed import ParallelConfig, RankRuntime
from paged_kv_compile.families.dreamzero import DreamZeroSpec

from . import vllm_omni_cpu as omni_cpu
from .dreamzero_pipeline import DenseKV, PagedKV, local_branches, run_session
from .hunyuan_pipeline import LAYERS, request_inputs, run_layers
from .multirank import load_full_weights, rank_info

START_FRAME_IS_A_VALUE = "L['current_start_frame']"  # as test_dreamzero_vllm_omni.py: one frame per bucket
HUNYUAN_ONE_RANK = PagedKVConfig(num_layers=LAYERS, num_kv_heads=2, head_dim=8, block_size=4, blocks_per_layer=8,
                                 max_rows=2, scratch_tokens_per_row=16, kernel="reference")


def rank_runtime(one_rank: PagedKVConfig, **kwargs: Any) -> RankRuntime:
    """This rank's runtime: the pool `one_rank` describes, as this rank holds it, agreeing with the group."""
    parallel = ParallelConfig.from_vllm_omni()
    return RankRuntime(PagedKVRuntime(parallel.rank_config(one_rank)), parallel, **kwargs)


def hygiene(backend: CountingBackend) -> dict:
    """What the compiled frames show: how many, what was rewritten, host syncs, collectives in the graphs."""
    collectives = sorted({str(n.target) for r in backend.results for n in r.graph_module.graph.nodes
                          if n.op == "call_function" and "c10d" in str(n.target)})
    return {
        "frames": backend.frames,
        "statuses": sorted(rep.status for r in backend.results for rep in r.reports),
        "patterns": sorted(rep.pattern for r in backend.results for rep in r.reports if rep.status == "rewritten"),
        "host_syncs": [s for r in backend.results for s in host_syncs(r.graph_module)],
        "collectives": collectives,
    }


# ---- HunyuanImage-3 ----------------------------------------------------------------------------------------


def hunyuan_layers(states: list[dict]) -> list[torch.nn.Module]:
    """This rank's decoder layers (its TP shard of the one-rank `states`); call inside model_context()."""
    layers = [omni_cpu.tiny_hunyuan_layer(layer_idx=i) for i in range(LAYERS)]
    for layer, state in zip(layers, states):
        load_full_weights(layer, state)
    return layers


class HunyuanRank:
    """This rank's paged HunyuanImage-3 layers: the shipped adapter on a RankRuntime, compiled (aot_eager)."""

    def __init__(self, states: list[dict], **runtime_kwargs: Any) -> None:
        torch._dynamo.reset()
        self.layers = hunyuan_layers(states)
        self.runtime = rank_runtime(HUNYUAN_ONE_RANK, **runtime_kwargs)
        self.adapter = vllm_omni_hunyuan.install(self.layers, self.runtime)
        self.backend = CountingBackend({"inner_compiler": "aot_eager", "check_mask": True})
        compile_blocks(torch.nn.ModuleList(self.layers), self.backend)

    def admit(self, rid: str, req: dict) -> None:
        self.runtime.admit(rid, self.adapter.spec(req["mask"], req["scatter"], req["step"]["position_ids"].shape[1]))

    def around(self, rid: str):
        return lambda phase, mask: self.adapter.forward(rid, phase=phase, attention_mask=mask)

    def report(self) -> dict:
        return {**hygiene(self.backend), **rank_info(), "bytes": self.runtime.pool.nbytes,
                "one_rank_bytes": KVPool.nbytes_for(HUNYUAN_ONE_RANK), "kv_heads": self.runtime.config.num_kv_heads,
                "votes": self.runtime.agreement.votes, "state": self.runtime.state()}


# ---- DreamZero -----------------------------------------------------------------------------------------------


def dreamzero_one_rank_config(model) -> PagedKVConfig:
    """The pool one rank would use for a session of `model` with both CFG branches (test_dreamzero_vllm_omni.py)."""
    spec = DreamZeroSpec.from_vllm_omni(model)
    attn = model.blocks[0].self_attn
    return PagedKVConfig(
        num_layers=len(model.blocks), num_kv_heads=attn.num_heads, head_dim=attn.head_dim,
        block_size=spec.frame_seqlen, blocks_per_layer=2 * (spec.window_frames + spec.chunk_frames), max_rows=2,
        scratch_tokens_per_row=spec.tokens_per_forward, buckets=spec.buckets(rows=1), kernel="reference")


class DreamZeroRank:
    """This rank's paged vllm-omni DreamZero: `CausalWanModel` (its TP shard, or its CFG branch) on a RankRuntime,
    blocks compiled as the pipeline's `setup_compile` does; `paged` drives a session as pipeline_dreamzero does."""

    def __init__(self, state: dict, *, inner: str = "aot_eager", **runtime_kwargs: Any) -> None:
        torch._dynamo.reset()
        self.model = omni_cpu.tiny_dreamzero_model()
        load_full_weights(self.model, state)
        self.spec = DreamZeroSpec.from_vllm_omni(self.model)
        self.one_rank = dreamzero_one_rank_config(self.model)
        self.runtime = rank_runtime(self.one_rank, **runtime_kwargs)
        self.runtime.bind(self.model.blocks)
        self.branches = local_branches()
        self.backend = CountingBackend({"inner_compiler": inner, "strict": True})
        for block in self.model.blocks:
            block.forward = torch.compile(block.forward, backend=self.backend, fullgraph=True, dynamic=False)

    def forward(self, sid: str, kind: str, branch: int):
        """The runtime's forward for one CFG branch of session `sid` (a one-row session under CFG-parallel)."""
        row = self.branches.index(branch) if len(self.branches) > 1 else None
        return self.runtime.forward(sid, kind, branch=row)

    def kv(self, sid: str) -> PagedKV:
        return PagedKV(self.model, self.runtime, sid, lambda kind, branch: self.forward(sid, kind, branch))

    def admit(self, sid: str) -> None:
        self.runtime.admit(sid, self.spec, rows=len(self.branches))

    def report(self) -> dict:
        return {**hygiene(self.backend), **rank_info(), "bytes": self.runtime.pool.nbytes,
                "one_rank_bytes": KVPool.nbytes_for(self.one_rank), "kv_heads": self.runtime.config.num_kv_heads,
                "block_bytes": KVPool.bytes_per_block_all_layers(self.runtime.config),
                "rows": self.runtime.config.max_rows, "votes": self.runtime.agreement.votes,
                "forwards": self.runtime.forwards, "state": self.runtime.state()}


def start_frame_is_a_value() -> Any:
    """`torch.compiler.config.patch` marking DreamZero's start frame a value (one frame per bucket)."""
    return torch.compiler.config.patch(dynamic_sources=START_FRAME_IS_A_VALUE)


# ---- one-rank oracles (the test process) ----------------------------------------------------------------------

DZ_CALLS = 5  # three pipeline calls: commits (the first of one frame), denoising steps, a window reset after the second


def hunyuan_one_rank(omni) -> tuple[list[dict], list[torch.Tensor]]:
    """The one-rank HunyuanImage-3 layers' weights and their dense eager outputs on the request (fp32)."""
    layers = [omni.tiny_hunyuan_layer(seed=10 + i, layer_idx=i) for i in range(LAYERS)]
    with omni.hunyuan_fp32_rope():
        return [layer.state_dict() for layer in layers], run_layers(layers, request_inputs(), autocast=None)


def dreamzero_one_rank(omni) -> tuple[dict, dict]:
    """The one-rank DreamZero model's weights and its dense session outputs."""
    model = omni.tiny_dreamzero_model()
    with torch.no_grad():
        return model.state_dict(), run_session(model, DenseKV(model), calls=DZ_CALLS)
