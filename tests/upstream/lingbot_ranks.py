"""LingBot-World on a rank of a Ulysses group (vllm-omni's `_sp_plan` hooks applied, as its registry does)."""

from __future__ import annotations

import torch

from . import lingbot_world as lb
from . import vllm_omni_cpu

BLOCKS = 4


def _sequence_parallel(model) -> None:
    from vllm_omni.diffusion.distributed.parallel_state import get_ulysses_parallel_world_size
    from vllm_omni.diffusion.distributed.sp_plan import SequenceParallelConfig, get_sp_plan_from_model
    from vllm_omni.diffusion.forward_context import get_forward_context
    from vllm_omni.diffusion.hooks.sequence_parallel import apply_sequence_parallel

    apply_sequence_parallel(model, SequenceParallelConfig(ulysses_degree=get_ulysses_parallel_world_size()),
                            get_sp_plan_from_model(model))
    get_forward_context().sp_plan_hooks_applied = True


def dense_task() -> dict:
    """This rank's dense rollout (LingBot's own cache, its local heads)."""
    lb.install()
    geometry = lb.TinyLingBot()
    inputs = lb.block_inputs(geometry, BLOCKS)
    with vllm_omni_cpu.model_context(), torch.no_grad():
        model = lb.build(geometry)
        _sequence_parallel(model)
        dense = lb.Recorder(model)
        lb.rollout(dense, lb.dense_cache(model, geometry, inputs["prompt_embeds"]), geometry, inputs)
    return {"outputs": dense.outputs, "heads": model.blocks[0].self_attn.num_sp_heads}


def paged_task() -> dict:
    """This rank's paged rollout: its runtime holds every token's K/V for the rank's heads, agreeing with the group."""
    from helpers import CountingBackend

    from paged_kv_compile.distributed import ParallelConfig, RankRuntime
    from paged_kv_compile.runtime import PagedKVRuntime

    lb.install()
    torch._dynamo.reset()
    geometry = lb.TinyLingBot()
    inputs = lb.block_inputs(geometry, BLOCKS)
    with vllm_omni_cpu.model_context(), torch.no_grad():
        model = lb.build(geometry)
        _sequence_parallel(model)
        one_rank = lb.runtime_config(geometry, heads=geometry.num_heads)
        parallel = ParallelConfig.from_vllm_omni()
        rt = RankRuntime(PagedKVRuntime(parallel.rank_config(one_rank)), parallel)
        rt.bind(model.blocks)
        rt.admit("s", geometry.spec(model), rows=1)
        backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
        for block in model.blocks:
            block.compile(backend=backend, fullgraph=True, dynamic=False)
        paged = lb.Recorder(model, runtime=rt)
        cache = lb.standin_cache(rt, model, geometry, inputs["prompt_embeds"])
        with torch.compiler.config.patch(dynamic_sources=lb.DYNAMIC_SOURCES):
            lb.rollout(paged, cache, geometry, inputs)
    collectives = sorted({str(n.target) for r in backend.results for n in r.graph_module.graph.nodes
                          if "_c10d_functional" in str(n.target)})
    return {"outputs": paged.outputs, "heads": model.blocks[0].self_attn.num_sp_heads, "frames": backend.frames,
            "bytes": rt.pool.nbytes, "one_rank_bytes": PagedKVRuntime(one_rank).pool.nbytes,
            "patterns": sorted({rep.pattern for r in backend.results for rep in r.reports if rep.status == "rewritten"}),
            "collectives": collectives, "state": rt.state()}


def one_rank_dense() -> list[torch.Tensor]:
    """The one-rank dense rollout (no Ulysses), every forward's output."""
    geometry = lb.TinyLingBot()
    inputs = lb.block_inputs(geometry, BLOCKS)
    with vllm_omni_cpu.model_context(), torch.no_grad():
        model = lb.build(geometry)
        dense = lb.Recorder(model)
        lb.rollout(dense, lb.dense_cache(model, geometry, inputs["prompt_embeds"]), geometry, inputs)
    return dense.outputs


# ---- behind vllm-omni's AR-Diffusion runner ---------------------------------------------------------------------


def runner_plan() -> list:
    """The ticks every rank serves: session "a" through 4 ticks (the cache slides past its sink), then a reset and
    one more tick (fresh request objects: the runner seeds their generators in place)."""
    from . import lingbot_runner as lr

    inputs = lr.session_inputs(5, seed=1)
    return [*lr.requests("a", inputs[:4]), *lr.requests("a", inputs[4:], reset=True, seed=7)]


def runner_task(runner_cls: str, model_config: dict | None = None) -> dict:
    """This rank's runner (`runner_cls`) serving LingBot-World's tick path with vllm-omni's Ulysses hooks applied to
    the transformer (as its registry applies them at load), before the runner compiles and binds it."""
    from torch._dynamo.utils import counters

    from . import lingbot_runner as lr

    lr.install()
    torch._dynamo.reset()
    counters.clear()
    od = lr.diffusion_config(runner_cls=runner_cls, model_config=model_config)
    with vllm_omni_cpu.model_context(od), torch.no_grad():
        pipeline = lr.build_pipeline(od)
        _sequence_parallel(pipeline.transformer)
        runner = lr.dr.build_runner(pipeline, od, available_bytes=1 << 26)
        latents = lr.latents(lr.serve(runner, runner_plan()))
    out = {"latents": latents, "heads": pipeline.transformer.blocks[0].self_attn.num_sp_heads,
           "frames": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}
    runtime = getattr(runner.kv_cache, "runtime", None)
    if runtime is not None:
        out.update(pool_bytes=runtime.pool.nbytes, num_kv_heads=runtime.config.num_kv_heads,
                   owners=len(runtime.owner_ids()), free=runtime.scheduler.allocator.num_free, state=runtime.state(),
                   voted=getattr(runtime, "calls", None))
    return out
