"""Host cost of building one forward's metadata for every layer, at the real model geometries.

The pool lives on the "meta" device (no memory): only the scheduler's plan and the vectorized
all-layer metadata build are timed. Copies are counted where they happen (`BucketMetadata.upload`):
copies into the metadata buffers per forward, and of those the host-to-device ones, which exist only
when the metadata lives on a device (`--device cuda`); on the CPU there are none.

    python benchmarks/metadata_cost.py [--repeats N] [--json] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from paged_kv_compile.allocator import BuiltinAllocator
from paged_kv_compile.config import Bucket
from paged_kv_compile.metadata import MetadataBuilder
from paged_kv_compile.models.dreamzero import DREAMZERO_14B
from paged_kv_compile.models.hunyuan_image3 import HUNYUAN_IMAGE3
from paged_kv_compile.pool import KVPool
from paged_kv_compile.scheduler import DreamZeroSpec, HunyuanSpec, Scheduler


def _setup(num_layers, kv_heads, head_dim, block_size, blocks_per_layer, scratch_tokens, device="cpu"):
    scratch_blocks = -(-scratch_tokens // block_size) + 1
    pool = KVPool(num_layers, blocks_per_layer, block_size, kv_heads, head_dim, scratch_rows=2,
                  scratch_blocks_per_row=scratch_blocks, dtype=torch.bfloat16, device="meta")
    scheduler = Scheduler(pool, BuiltinAllocator(blocks_per_layer), max_rows=2)
    return scheduler, MetadataBuilder(pool, device=device)


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _forward(scheduler, builder, plan_fn, fresh: bool):
    """One planned forward's metadata; `fresh` drops the layout cache first (a real rebuild)."""
    def run():
        plan = plan_fn()
        bucket = Bucket(len(plan.rows), plan.tokens, plan.context)
        if fresh:
            builder.buffers(bucket).last_key = ()
        builder.build(bucket, plan.rows, plan.key)
        scheduler.finish_forward(plan)
    return run


def _timed(name, layers, kind, builder, run, repeats) -> dict:
    """Time `run` and count the copies it really issued into the metadata buffers (per forward), after one
    untimed run that creates the bucket's buffers (whose padding state is a copy of its own)."""
    run()
    copies, h2d = builder.copies, builder.h2d_copies
    times = _time(run, repeats)
    return _row(name, layers, kind, times, (builder.copies - copies) / repeats, (builder.h2d_copies - h2d) / repeats)


def _measure(name, layers, kind, scheduler, builder, plan_fn, repeats) -> list[dict]:
    return [_timed(name, layers, f"{kind}: {label}", builder, _forward(scheduler, builder, plan_fn, fresh), repeats)
            for fresh, label in ((True, "build"), (False, "repeat"))]


def dreamzero(repeats: int, device: str = "cpu") -> list[dict]:
    cfg = DREAMZERO_14B
    spec = DreamZeroSpec.from_model_config(cfg)
    block = 16  # divides frame_seqlen = 880
    sched, builder = _setup(cfg.num_layers, cfg.num_heads, cfg.head_dim, block,
                            2 * spec.window_tokens // block, spec.tokens_per_forward, device)
    sched.open_session("s", spec, rows=2)
    for _ in range(spec.window_frames // spec.chunk_frames):  # fill the window
        _forward(sched, builder, lambda: sched.plan_dreamzero("s", commit=True), True)()
    commit = _forward(sched, builder, lambda: sched.plan_dreamzero("s", commit=True), True)
    rows = [_timed("DreamZero-14B", cfg.num_layers, "commit (new blocks)", builder, commit, repeats)]
    rows += _measure("DreamZero-14B", cfg.num_layers, "denoise", sched, builder,
                     lambda: sched.plan_dreamzero("s", commit=False), repeats)
    return rows


def hunyuan(repeats: int, device: str = "cpu") -> list[dict]:
    cfg = HUNYUAN_IMAGE3
    block, prefix = 16, 1024
    sched, builder = _setup(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block, 2 * prefix // block,
                            cfg.target_len, device)
    spec = HunyuanSpec((1000, 300), cfg.target_len, ((1, 1 + cfg.image_tokens),))
    sched.admit_request("r", spec)
    mask = spec.padded_mask(prefix)  # the prefill reads each row's layout from the model's mask (once per request)
    rows = _measure("HunyuanImage-3", cfg.num_layers, "prefill", sched, builder,
                    lambda: sched.plan_hunyuan("r", phase="prefill", prefix_capacity=prefix, attention_mask=mask),
                    repeats)
    rows += _measure("HunyuanImage-3", cfg.num_layers, "denoising step", sched, builder,
                     lambda: sched.plan_hunyuan("r", phase="step", prefix_capacity=prefix), repeats)
    return rows


def _row(model, layers, kind, times, copies, h2d):
    return {
        "model": model, "layers": layers, "forward": kind,
        "median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3),
        "max_ms": round(max(times), 3), "copies_per_forward": copies, "h2d_copies_per_forward": h2d,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="cpu", help="where the metadata buffers live (cpu: no H2D copies)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = dreamzero(args.repeats, args.device) + hunyuan(args.repeats, args.device)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'model':16} {'layers':>6} {'forward':32} {'median ms':>10} {'min':>8} {'max':>8} {'copies/fwd':>10} "
          f"{'H2D/fwd':>8}")
    for r in rows:
        print(f"{r['model']:16} {r['layers']:>6} {r['forward']:32} {r['median_ms']:>10} {r['min_ms']:>8} "
              f"{r['max_ms']:>8} {r['copies_per_forward']:>10} {r['h2d_copies_per_forward']:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
