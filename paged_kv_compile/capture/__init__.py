"""Warm-up over shape buckets, then CUDA-graph capture and replay of the compiled blocks.

    runtime = PagedKVRuntime(config)        # a family's runtime config with its buckets (families/<name>.py)
    runtime.bind(model.blocks)
    for block in model.blocks:
        block.compile(backend="paged_kv", fullgraph=True, dynamic=False)
    captured = warm_up(model, runtime)      # compiles every bucket; on CUDA also captures
    with captured.serving():                # from here on, any compile is an error
        paged_run(model, runtime, num_chunks=10)

`warm_up` wraps the model's blocks (`CapturedBlocks`). Per bucket it owns one set of static input
buffers, shared by all blocks (one buffer per argument position: hidden states, modulation, RoPE
tables, cross-attention K/V, masks...); cache stand-ins and the pool are already at fixed addresses
and pass through. A block call copies its tensor arguments into those buffers (skipped when the same
unmodified tensor was copied last, e.g. RoPE tables shared by all blocks) and then, on CUDA, replays
that block's graph and copies the outputs out; on a machine without a GPU it calls the compiled block
on the same static buffers, so the address logic is the same and tested.

Graph granularity: by default one CUDA graph per (bucket, block), all captured into ONE shared memory
pool. Per-block graphs keep every returned tensor real, keep the binding property that blocks may run in
any order or be skipped, and cost one graph launch per block (vLLM's piecewise graphs make the same trade);
static outputs live in per-bucket buffers that each graph writes last, so the graphs' intermediates are
reused across captures through the shared pool. `granularity="forward"` captures one graph per bucket over
every block in the model's order: one copy-in and one launch per forward, the blocks' order and chaining
checked at every call (`capture/forward_graph.py`). In both modes a replay runs no Python of the compiled
functions, so their per-call host checks, recorded at capture (`capture/calls.py`), run before each launch.

A forward whose bucket was not warmed up raises `RequestError` naming it and the warmed-up ones
(the runtime already refuses shapes outside its configured buckets). With `fallback="eager"` such a
forward instead runs uncaptured: the runtime lets the shape through as its own bucket, the block is
called directly (dynamo compiles that shape once, with a warning; counted in `stats`), never
replayed. Serving under `serving()` sets `torch.compiler.set_stance("fail_on_recompile")`, so a
silent recompile is an error; captured calls enforce that stance themselves as well.
"""

from ..errors import CaptureError
from .blocks import FALLBACKS, CapturedBlocks, ExampleInputs, model_blocks_and_inputs, warm_up
from .graphs import CompiledOnlyGraphs, CudaGraphs, EmulatedGraphs
from .report import BucketWarmup, WarmupReport, format_bucket, unique_graphs

__all__ = [
    "FALLBACKS",
    "BucketWarmup",
    "CaptureError",
    "CapturedBlocks",
    "CompiledOnlyGraphs",
    "CudaGraphs",
    "EmulatedGraphs",
    "ExampleInputs",
    "WarmupReport",
    "format_bucket",
    "model_blocks_and_inputs",
    "unique_graphs",
    "warm_up",
]
