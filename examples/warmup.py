"""Startup warm-up: compile every shape bucket before serving, capture CUDA graphs on a GPU, then serve
with recompiles turned into errors.

`warm_up` compiles each configured bucket once (a tqdm bar names the bucket) and, on CUDA, captures one
graph per block and bucket in a shared memory pool. While serving, `captured.serving()` sets
torch.compiler.set_stance("fail_on_recompile"): nothing compiles any more, and every buffer a graph
reads keeps its address. Without a GPU the same path runs the compiled blocks on the static buffers.

    python examples/warmup.py
"""

from __future__ import annotations

import sys

import torch
from torch._dynamo.utils import counters

from paged_kv_compile.capture import warm_up
from paged_kv_compile.families.dreamzero import dreamzero_buckets, dreamzero_runtime_config
from paged_kv_compile.driver import paged_run
from paged_kv_compile.models import DreamZeroConfig, DreamZeroModel
from paged_kv_compile.runtime import PagedKVRuntime

INNER_COMPILER = "aot_eager"


def main(argv: list[str] | None = None) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = DreamZeroConfig(sink_size=2)
    model = DreamZeroModel(cfg, seed=1).to(device)
    runtime = PagedKVRuntime(dreamzero_runtime_config(cfg, block_size=8, buckets=dreamzero_buckets(cfg),
                                                      device=device))
    runtime.bind(model.blocks)
    for block in model.blocks:
        block.compile(backend="paged_kv", fullgraph=True, dynamic=False, options={"inner_compiler": INNER_COMPILER})

    captured = warm_up(model, runtime)  # compile (and on CUDA capture) every bucket
    print(captured.report.format())

    compiled = counters["stats"]["unique_graphs"]
    addresses = captured.addresses()
    with captured.serving():
        for session in ("robot-a", "robot-b"):
            out = paged_run(model, runtime, owner_id=session, num_chunks=6, num_inference_steps=2)
            print(f"{session}: {tuple(out['video'].shape)} video latents, {tuple(out['actions'].shape)} actions")
    new = counters["stats"]["unique_graphs"] - compiled
    stable = captured.addresses() == addresses
    print(f"compiled while serving: {new}; buffer addresses unchanged: {stable}; "
          f"graph replays: {captured.stats['replays']}, direct calls: {captured.stats['direct_calls']}")
    return 0 if new == 0 and stable else 1


if __name__ == "__main__":
    sys.exit(main())
