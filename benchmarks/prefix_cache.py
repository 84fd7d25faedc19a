"""HunyuanImage-3 requests sharing a 1,000-token system prompt (`paged_kv_compile/prefix_cache.py`): KV held, requests
admitted, and the prefill time of a request served from the cache.

Real geometry (HUNYUAN_IMAGE3: 32 layers, 8 KV heads x 128, bf16, block 16): N requests of two CFG rows, the
conditional row the shared system prompt plus the request's own user text, the unconditional row the system prompt
plus a negative text every request shares. The real scheduler admits them on a pool on the "meta" device (no memory;
bytes are blocks x bytes per block): without sharing each request holds its whole prompt; with sharing the first
request's prefill publishes its full prompt blocks and every later request holds only what it does not share.
Requests admitted in one budget: admitted until the scheduler refuses, each way.

CPU (HUNYUAN_IMAGE3_MID at a shorter system prompt, compiled with the paged_kv backend, aot_eager): the prefill forward
of one request computed in full vs the same request served from the cache (its suffix only, over the cached prefix),
interleaved, with admission and release in each sample; the ratio per repeat. The served request's result is also
compared with the full one's.

    python -m benchmarks.prefix_cache [--quick] [--json] [--requests 1 8 32 128] [--budget-gib 8]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks._common import bench_settings, interleaved, machine_info, markdown_table, summarize
from paged_kv_compile.allocator import BuiltinAllocator
from paged_kv_compile.config import PagedKVConfig
from paged_kv_compile.counting import CountingBackend
from paged_kv_compile.driver import PagedHooks
from paged_kv_compile.errors import CapacityError
from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config, hunyuan_spec
from paged_kv_compile.models.hooks import drive
from paged_kv_compile.models.hunyuan_image3 import (HUNYUAN_IMAGE3, HUNYUAN_IMAGE3_MID, HunyuanImage3Config,
                                                    HunyuanImage3Model, hunyuan_steps)
from paged_kv_compile.pool import KVPool
from paged_kv_compile.runtime import PagedKVRuntime
from paged_kv_compile.scheduler import Scheduler

GiB = 2**30
SYSTEM_TOKENS, USER_TOKENS, NEGATIVE_TOKENS = 1000, 64, 8
REAL_BLOCK = 16


def _prompts(vocab: int, system: torch.Tensor, negative: torch.Tensor, user: int, seed: int) -> list[torch.Tensor]:
    own = torch.randint(0, vocab, (user,), generator=torch.Generator().manual_seed(seed))
    return [torch.cat([system, own]), torch.cat([system, negative])]


def _meta_scheduler(cfg: HunyuanImage3Config, blocks_per_layer: int) -> Scheduler:
    pc = PagedKVConfig(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       block_size=REAL_BLOCK, blocks_per_layer=blocks_per_layer, max_rows=2,
                       scratch_tokens_per_row=cfg.target_len, dtype=torch.bfloat16, device="meta")
    pool = KVPool.from_config(pc)
    return Scheduler(pool, BuiltinAllocator(pool.blocks_per_layer), max_rows=2)


def _block_bytes(cfg: HunyuanImage3Config) -> int:
    """Bytes of one block in every layer (K and V, bf16)."""
    return cfg.num_layers * 2 * REAL_BLOCK * cfg.num_kv_heads * cfg.head_dim * 2


def _admit_all(sched: Scheduler, cfg: HunyuanImage3Config, requests: list[list[torch.Tensor]], shared: bool,
               limit: int | None = None) -> int:
    """Admit requests in order until refused (or `limit`); with sharing, the first is prefilled (its prompt blocks
    published) before the next is admitted. How many were admitted."""
    admitted = 0
    for i, prompts in enumerate(requests[:limit]):
        spec = hunyuan_spec(cfg, prompts)
        try:
            sched.admit(f"r{i}", spec, prompt_tokens=prompts if shared else None)
        except CapacityError:
            break
        admitted += 1
        if shared and i == 0:
            capacity = max(spec.prefix_lens)
            plan = sched.plan("r0", "prefill", prefix_capacity=capacity, attention_mask=spec.padded_mask(capacity))
            sched.finish_forward(plan)
    return admitted


def real_geometry(counts: list[int], budget_gib: float) -> dict:
    """KV bytes held by N requests with and without sharing, and requests admitted in `budget_gib`."""
    cfg = HUNYUAN_IMAGE3
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, cfg.vocab, (SYSTEM_TOKENS,), generator=g)
    negative = torch.randint(0, cfg.vocab, (NEGATIVE_TOKENS,), generator=g)
    most = max(counts)
    per_block = _block_bytes(cfg)
    budget_blocks = int(budget_gib * GiB) // per_block
    requests = [_prompts(cfg.vocab, system, negative, USER_TOKENS, seed=1 + i)
                for i in range(max(most, budget_blocks // 6 + 2))]
    rows = []
    for n in counts:
        held = {}
        for shared in (False, True):
            sched = _meta_scheduler(cfg, blocks_per_layer=n * 2 * 70)
            assert _admit_all(sched, cfg, requests, shared, limit=n) == n
            held[shared] = sched.held_blocks() * per_block
        rows.append({"N": n, "unshared_gib": round(held[False] / GiB, 3), "shared_gib": round(held[True] / GiB, 3),
                     "ratio": round(held[True] / held[False], 4)})
    admitted = {}
    for shared in (False, True):
        sched = _meta_scheduler(cfg, blocks_per_layer=budget_blocks)
        admitted[shared] = _admit_all(sched, cfg, requests, shared)
    return {"config": "HUNYUAN_IMAGE3", "block_size": REAL_BLOCK, "bytes_per_block_all_layers": per_block,
            "rows_per_request": 2, "system_tokens": SYSTEM_TOKENS, "user_tokens": USER_TOKENS,
            "negative_tokens": NEGATIVE_TOKENS, "held": rows, "budget_gib": budget_gib,
            "budget_blocks_per_layer": budget_blocks, "admitted_unshared": admitted[False],
            "admitted_shared": admitted[True]}


def cpu_prefill(quick: bool, repeats: int) -> dict:
    """Prefill forward of one request in full vs served from the cache, on the CPU, compiled (aot_eager)."""
    cfg = HunyuanImage3Config() if quick else HUNYUAN_IMAGE3_MID
    system_len, user, block = (16, 3, 4) if quick else (256, 16, 16)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, cfg.vocab, (system_len,), generator=g)
    negative = torch.randint(0, cfg.vocab, (4,), generator=g)
    capacity = system_len + max(user, len(negative))
    model = HunyuanImage3Model(cfg, seed=2)
    runtime = PagedKVRuntime(hunyuan_runtime_config(cfg, max_prefix=capacity, block_size=block, requests=3,
                                                    kernel="reference"))
    runtime.bind(model.layers)
    backend = CountingBackend({"inner_compiler": "aot_eager"})
    for layer in model.layers:
        layer.compile(backend=backend, fullgraph=True, dynamic=False)
    serial = iter(range(10**9))
    prompts = _prompts(cfg.vocab, system, negative, user, seed=7)

    def request(shared: bool) -> torch.Tensor:
        rid = f"{'cached' if shared else 'full'}-{next(serial)}"
        runtime.admit(rid, hunyuan_spec(cfg, prompts), prompt_tokens=prompts if shared else None,
                      cache_salt="bench" if shared else None)
        ready = runtime.owner(rid).prefix_ready
        hooks = PagedHooks(runtime, rid)
        out = drive(hunyuan_steps(model, prompts, prefix_capacity=capacity, num_steps=1, seed=5, hooks=hooks,
                                  suffix_from=ready[0] if ready else 0), hooks)
        runtime.release(rid)
        return out

    request(True)  # publishes the system prompt (and the shared negative row) under the salt "bench"
    full, cached = request(False), request(True)
    assert runtime.scheduler.prefix_cache.by_block, "the seeding request published nothing"
    times = interleaved({"full": lambda: request(False), "cached": lambda: request(True)}, repeats=repeats)
    ratios = [c / f for c, f in zip(times["cached"], times["full"])]
    suffix = capacity + cfg.target_len - (system_len // block) * block
    return {"config": "HunyuanImage3Config()" if quick else "HUNYUAN_IMAGE3_MID", "system_tokens": system_len,
            "user_tokens": user, "block_size": block, "prefill_tokens": capacity + cfg.target_len,
            "cached_suffix_tokens": suffix, "full_ms": round(statistics.median(times["full"]) * 1e3, 2),
            "cached_ms": round(statistics.median(times["cached"]) * 1e3, 2), "ratio": summarize(ratios),
            "max_abs_diff": float((full - cached).abs().max()), "graphs": backend.frames}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 1, 8; tiny model on the CPU, 3 repeats")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, nargs="+", default=None)
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: a shared machine)")
    args = parser.parse_args(argv)
    counts = args.requests or ([1, 8] if args.quick else [1, 8, 32, 128])
    real = real_geometry(counts, args.budget_gib)
    with bench_settings(threads=args.threads):
        cpu = cpu_prefill(args.quick, repeats=3 if args.quick else 7)
    result = {"machine": machine_info(threads=args.threads), "real": real, "cpu": cpu}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"HUNYUAN_IMAGE3 (bf16, block {REAL_BLOCK}): N requests, rows [system {SYSTEM_TOKENS} + own {USER_TOKENS}] "
          f"and [system + shared negative {NEGATIVE_TOKENS}]; KV held:")
    print(markdown_table(real["held"], [("N", "N"), ("unshared GiB", "unshared_gib"), ("shared GiB", "shared_gib"),
                                        ("shared / unshared", "ratio")]))
    print(f"\nrequests admitted in {args.budget_gib:g} GiB of KV ({real['budget_blocks_per_layer']} blocks per layer): "
          f"{real['admitted_unshared']} unshared, {real['admitted_shared']} shared")
    print(f"\nCPU prefill ({cpu['config']}, system {cpu['system_tokens']} + own {cpu['user_tokens']} tokens, "
          f"{cpu['prefill_tokens']} tokens per row; served from the cache: {cpu['cached_suffix_tokens']}): full "
          f"{cpu['full_ms']} ms, cached {cpu['cached_ms']} ms, cached / full median {cpu['ratio']['median']} "
          f"(IQR {cpu['ratio']['q1']}-{cpu['ratio']['q3']}, n={cpu['ratio']['n']}); max |cached - full| = "
          f"{cpu['max_abs_diff']:.2e}; {cpu['graphs']} graphs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
