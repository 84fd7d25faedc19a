"""HunyuanImage-3 requests on a paged runtime: a prompt prefix kept in the pool, an image span rewritten.

Step 0 ("prefill") writes each row's prompt K/V into the pool (padding is neither written nor read);
steps 1.. feed only the target span and attend over the cached prefix. Two requests, one of 1 row and
one of 2 rows (CFG) with different prompt lengths, share one pool and four compiled shapes.

    python examples/hunyuan_image3_request.py
"""

from __future__ import annotations

import sys

import torch

from paged_kv_compile.families.hunyuan_image3 import hunyuan_buckets, hunyuan_runtime_config
from paged_kv_compile.driver import paged_run
from paged_kv_compile.models import HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate
from paged_kv_compile.runtime import PagedKVRuntime

INNER_COMPILER = "aot_eager"


def main(argv: list[str] | None = None) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = HunyuanImage3Config()
    capacity = 16  # prompts are padded to this prefix length in the dense layout
    gen = torch.Generator().manual_seed(0)
    requests = {
        "one-row": [torch.randint(0, cfg.vocab, (9,), generator=gen)],
        "cfg": [torch.randint(0, cfg.vocab, (13,), generator=gen), torch.randint(0, cfg.vocab, (4,), generator=gen)],
    }

    model = HunyuanImage3Model(cfg, seed=2).to(device)
    buckets = hunyuan_buckets(cfg, [capacity])  # prefill and step shapes, for 1 and 2 rows
    runtime = PagedKVRuntime(hunyuan_runtime_config(cfg, max_prefix=capacity, block_size=4, buckets=buckets,
                                                    device=device))
    runtime.bind(model.layers)
    for layer in model.layers:
        layer.compile(backend="paged_kv", fullgraph=True, dynamic=False, options={"inner_compiler": INNER_COMPILER})

    dense_model = HunyuanImage3Model(cfg, seed=2).to(device)
    worst = 0.0
    for request_id, prompts in requests.items():
        latents = paged_run(model, runtime, prompts=prompts, owner_id=request_id, num_steps=4, seed=5)
        dense = hunyuan_generate(dense_model, prompts, prefix_capacity=capacity, num_steps=4, seed=5)
        diff = (latents - dense).abs().max().item()
        worst = max(worst, diff)
        print(f"{request_id}: prompts {[len(p) for p in prompts]} -> latents {tuple(latents.shape)}, "
              f"max |dense - paged| = {diff:.2e}")
    print(f"shape buckets used: {len(runtime.metadata.buckets)}; blocks free again: "
          f"{runtime.scheduler.allocator.num_free} of {runtime.pool.blocks_per_layer}")
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
