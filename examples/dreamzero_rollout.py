"""A DreamZero rollout, dense and paged, side by side.

The model code is the dense reference (`paged_kv_compile.models.dreamzero`): its blocks are compiled
regionally with backend="paged_kv", which rewrites their windowed KV-cache attention into the paged op;
the runtime owns the one KV pool and plans every forward. The rollout slides its window, keeps a sink
and resets, and the paged run matches the dense one.

    python examples/dreamzero_rollout.py
"""

from __future__ import annotations

import sys
import time

import torch

from paged_kv_compile.driver import paged_run
from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
from paged_kv_compile.models import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.runtime import PagedKVRuntime

INNER_COMPILER = "aot_eager"  # "inductor" compiles slower and runs faster


def main(argv: list[str] | None = None) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = DreamZeroConfig(sink_size=2)  # window 6 frames, 2 of them a resident sink; chunks of 2 frames
    steps = dict(num_chunks=10, num_inference_steps=3, seed=0)

    start = time.perf_counter()
    dense = dreamzero_rollout(DreamZeroModel(cfg, seed=1).to(device), **steps)
    dense_s = time.perf_counter() - start

    model = DreamZeroModel(cfg, seed=1).to(device)
    runtime = PagedKVRuntime(dreamzero_runtime_config(cfg, block_size=8, device=device))
    runtime.bind(model.blocks)  # layer i of the pool is model.blocks[i], found from its weights
    for block in model.blocks:
        block.compile(backend="paged_kv", fullgraph=True, dynamic=False, options={"inner_compiler": INNER_COMPILER})
    start = time.perf_counter()
    paged = paged_run(model, runtime, **steps)
    paged_s = time.perf_counter() - start

    diff = max((dense[k] - paged[k]).abs().max().item() for k in ("video", "actions"))
    print(f"{steps['num_chunks']} chunks, window resets after chunks {paged['resets']}")
    print(f"max |dense - paged| = {diff:.2e}")
    print(f"KV pool: {runtime.pool.nbytes:,} bytes for all {cfg.num_layers} layers; "
          f"a full dense window: {cfg.kv_cache_bytes(batch=2, dtype=torch.float32):,} bytes")
    print(f"dense eager {dense_s:.2f} s, paged {paged_s:.2f} s (first forward compiles)")
    return 0 if diff <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
