"""Per-rank pool bytes at the real geometries, from the pool geometry itself (nothing is allocated).

`python -m paged_kv_compile.distributed.memory` prints the table docs/distributed.md quotes: HunyuanImage-3 (32 layers,
8 KV heads x 128, bf16) at TP 1/2/4/8/16, and DreamZero-14B (40 layers, 40 heads x 128, 21-frame window of 880-token
frames, bf16) at CFG-parallel 1/2 x TP 1/2/4. Each row is `rank_pool_bytes` of the family's one-rank pool config
(`families.<family>.<family>_runtime_config`) under that `ParallelConfig`.
"""

from __future__ import annotations

import argparse

import torch

from ..families.dreamzero import dreamzero_runtime_config
from ..families.hunyuan_image3 import hunyuan_runtime_config
from ..models.dreamzero import DREAMZERO_14B
from ..models.hunyuan_image3 import HUNYUAN_IMAGE3
from .parallel_config import ParallelConfig, rank_pool_bytes

GIB = 2**30
HUNYUAN_PROMPT = 1024  # prompt tokens per CFG row the HunyuanImage-3 pool is sized for (1024x1024 image: 4097 target)


def memory_table(*, hunyuan_requests: int = 4, dreamzero_sessions: int = 1) -> list[dict]:
    """One row per (model, parallel layout): the rank's KV heads, rows, blocks per layer and pool bytes."""
    rows = []
    hunyuan = hunyuan_runtime_config(HUNYUAN_IMAGE3, max_prefix=HUNYUAN_PROMPT, requests=hunyuan_requests,
                                     dtype=torch.bfloat16)
    for tp in (1, 2, 4, 8, 16):
        rows.append({"model": f"HunyuanImage-3, {hunyuan_requests} requests x 2 CFG rows x {HUNYUAN_PROMPT}-token prompt",
                     "layout": f"TP {tp}", **rank_pool_bytes(hunyuan, ParallelConfig(tensor_parallel=tp))})
    dreamzero = dreamzero_runtime_config(DREAMZERO_14B, sessions=dreamzero_sessions, dtype=torch.bfloat16)
    for cfg in (1, 2):
        for tp in (1, 2, 4):
            rows.append({"model": f"DreamZero-14B, {dreamzero_sessions} session x 2 CFG branches",
                         "layout": f"CFG {cfg} x TP {tp}",
                         **rank_pool_bytes(dreamzero, ParallelConfig(tensor_parallel=tp, cfg_parallel=cfg))})
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| model | layout | KV heads / rank | replication | rows / rank | blocks / layer | pool / rank | "
           "vs one rank |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['layout']} | {r['kv_heads']} | {r['kv_replication']:.0f}x | {r['rows']} | "
                   f"{r['blocks_per_layer']} | {r['bytes'] / GIB:.2f} GiB | {r['ratio']:.3f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hunyuan-requests", type=int, default=4)
    parser.add_argument("--dreamzero-sessions", type=int, default=1)
    args = parser.parse_args(argv)
    print(markdown(memory_table(hunyuan_requests=args.hunyuan_requests, dreamzero_sessions=args.dreamzero_sessions)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
