"""Two ranks on the CPU: a paged DreamZero rollout with CFG-parallel, a HunyuanImage-3 request with tensor parallel,
and a DreamZero rollout with Ulysses sequence parallel.

Starts 2 processes (`torch.multiprocessing`, a gloo world). Each rank builds its part of a reference model
(`paged_kv_compile.distributed.reference`: CFG-parallel runs one branch per rank, tensor parallel keeps the rank's
heads and all-reduces the output projection, Ulysses splits the tokens and trades them for heads around each
self-attention), a pool sized by what the rank holds (`ParallelConfig.rank_config`),
and a `RankRuntime`, whose every decision both ranks agree on. Each result is compared with the one-rank dense
model (eager, fp32); prints max |paged - dense| and each rank's KV bytes, exits 1 on a mismatch.

    python examples/multirank.py
"""

from __future__ import annotations

import os
import queue
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ATOL = 1e-5
INNER_COMPILER = "aot_eager"
TIMEOUT_S = 900  # a rank that fails leaves the other waiting in a collective: never wait forever


def _compile(blocks) -> None:
    for block in blocks:
        block.compile(backend="paged_kv", fullgraph=True, dynamic=False, options={"inner_compiler": INNER_COMPILER})


def dreamzero_cfg_parallel(rank: int) -> dict:
    from paged_kv_compile import KVPool, PagedKVRuntime
    from paged_kv_compile.distributed import ParallelConfig, RankRuntime
    from paged_kv_compile.distributed.reference import CfgBranch, rank_run
    from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
    from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout

    cfg = DreamZeroConfig(num_layers=2, window_reset_frames=6)  # window 6 frames, chunks of 2, a reset after 3
    loop = dict(num_chunks=4, num_inference_steps=2, seed=0)
    dense = dreamzero_rollout(DreamZeroModel(cfg, seed=1), **loop)  # one rank, both branches, eager

    parallel = ParallelConfig(cfg_parallel=2, cfg_rank=rank)
    one_rank = dreamzero_runtime_config(cfg, block_size=8, kernel="reference")
    runtime = RankRuntime(PagedKVRuntime(parallel.rank_config(one_rank)), parallel, group=dist.group.WORLD)
    model = DreamZeroModel(cfg, seed=1)
    runtime.bind(model.blocks)
    _compile(model.blocks)
    paged = rank_run(CfgBranch(model, parallel, dist.group.WORLD), runtime, rows=1, **loop)
    err = max((dense[k] - paged[k]).abs().max().item() for k in ("video", "actions"))
    return {"err": err, "bytes": runtime.pool.nbytes, "one_rank_bytes": KVPool.nbytes_for(one_rank),
            "resets": paged["resets"]}


def hunyuan_tensor_parallel(rank: int) -> dict:
    from paged_kv_compile import KVPool, PagedKVRuntime
    from paged_kv_compile.distributed import ParallelConfig, RankRuntime
    from paged_kv_compile.distributed.reference import rank_run, shard_heads
    from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config
    from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate

    cfg = HunyuanImage3Config(num_layers=2, image_h=2, image_w=3)  # 4 query / 2 KV heads: 2 / 1 per rank
    prompts = [torch.arange(3, 12), torch.arange(5, 9)]  # two CFG rows, prompts of 9 and 4 tokens
    dense = hunyuan_generate(HunyuanImage3Model(cfg, seed=1), prompts, num_steps=3, seed=0)

    parallel = ParallelConfig(tensor_parallel=2, tp_rank=rank)
    one_rank = hunyuan_runtime_config(cfg, max_prefix=12, kernel="reference")
    runtime = RankRuntime(PagedKVRuntime(parallel.rank_config(one_rank)), parallel, group=dist.group.WORLD)
    model = shard_heads(HunyuanImage3Model(cfg, seed=1), parallel, dist.group.WORLD)
    runtime.bind(model.layers)
    _compile(model.layers)
    paged = rank_run(model, runtime, prompts=prompts, num_steps=3, seed=0)
    return {"err": (dense - paged).abs().max().item(), "bytes": runtime.pool.nbytes,
            "one_rank_bytes": KVPool.nbytes_for(one_rank)}


def dreamzero_ulysses(rank: int) -> dict:
    from paged_kv_compile import KVPool, PagedKVRuntime
    from paged_kv_compile.distributed import ParallelConfig, RankRuntime
    from paged_kv_compile.distributed.reference import rank_run, shard_sequence
    from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
    from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout

    cfg = DreamZeroConfig(num_layers=2, window_reset_frames=6, action_register_length=6)  # tokens split in 2 evenly
    loop = dict(num_chunks=4, num_inference_steps=2, seed=0)
    dense = dreamzero_rollout(DreamZeroModel(cfg, seed=1), **loop)

    parallel = ParallelConfig(ulysses=2, ulysses_rank=rank)
    one_rank = dreamzero_runtime_config(cfg, block_size=8, kernel="reference")
    runtime = RankRuntime(PagedKVRuntime(parallel.rank_config(one_rank)), parallel, group=dist.group.WORLD)
    model = shard_sequence(DreamZeroModel(cfg, seed=1), parallel, dist.group.WORLD)
    runtime.bind(model.blocks)
    _compile(model.blocks)
    paged = rank_run(model, runtime, **loop)
    err = max((dense[k] - paged[k]).abs().max().item() for k in ("video", "actions"))
    return {"err": err, "bytes": runtime.pool.nbytes, "one_rank_bytes": KVPool.nbytes_for(one_rank)}


MODES = {"dreamzero": ("DreamZero, CFG-parallel 2 (one branch per rank)", dreamzero_cfg_parallel),
         "hunyuan": ("HunyuanImage-3, tensor parallel 2 (half the heads per rank)", hunyuan_tensor_parallel),
         "ulysses": ("DreamZero, Ulysses 2 (half the tokens per rank, every token's K/V for half the heads)",
                     dreamzero_ulysses)}


def _rank(rank: int, world: int, init_file: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for what, (_, run) in MODES.items():
            results.put((rank, what, run(rank)))
    except BaseException:
        import traceback

        results.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    world, deadline = 2, time.monotonic() + TIMEOUT_S
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    got: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "store"), results)) for r in range(world)]
        for p in procs:
            p.start()
        while len(got) < len(MODES) * world and time.monotonic() < deadline:
            try:
                rank, what, out = results.get(timeout=1)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if what == "error":  # the other rank may now wait in a collective forever: stop both
                print(f"rank {rank} failed:\n{out}", file=sys.stderr)
                break
            got[(rank, what)] = out
        for p in procs:
            p.join(timeout=30 if len(got) == len(MODES) * world else 0)
            if p.is_alive():
                p.kill()
    if len(got) < len(MODES) * world:
        print(f"the ranks did not finish (got {sorted(got)}; limit {TIMEOUT_S} s)", file=sys.stderr)
        return 1
    ok = True
    for what, (title, _) in MODES.items():
        print(title)
        for rank in range(world):
            out = got[(rank, what)]
            ok &= out["err"] <= ATOL
            print(f"  rank {rank}: max |paged - dense| = {out['err']:.2e}; KV pool {out['bytes']:,} bytes "
                  f"(one rank: {out['one_rank_bytes']:,})")
    print("parity within 1e-5 on every rank" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
