"""Host cost of building one forward's metadata for every layer, at the real model geometries.

The pool lives on the "meta" device (no memory): only host work is timed. Per forward: the scheduler's plan
(+ finish), and the metadata build (wall time, and the CPU time of the building thread, which a busy
machine's preemption does not inflate) (`MetadataBuilder.build`: staging every row with numpy and the one copy
into the bucket's buffers; each layer's absolute ids are computed on the device inside the compiled graph, so
the build does no per-layer work). Copies are counted where they happen (`BucketMetadata.upload`): copies into
the metadata buffers per forward, and of those the host-to-device ones, which exist only when the metadata
lives on a device (`--device cuda`); on the CPU there are none. *torch ops/build* counts the torch operators a
build dispatches (`TorchDispatchMode`), in one extra untimed run, and *of which compute* those that are not
`aten.detach` (what a `Tensor.numpy()` view dispatches): with none, the build cannot wait on torch's intra-op
threads. The plans' rows are numpy arrays (`layout.RowLayout`), so a build dispatches no operator at all.
A fresh build is what a server interleaving owners pays: the forwards of two sessions (two requests) alternate,
so each build replaces the other owner's layout; a repeat is the same owner's next denoising step.

    python benchmarks/metadata_cost.py [--repeats N] [--json] [--device cpu|cuda] [--threads N] [--busy N]
    python benchmarks/metadata_cost.py --mask-only [--repeats N] [--threads N]   # see `mask_read`

`--busy N` keeps N other processes spinning (`python -c "while True: pass"`) while it measures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import statistics
import subprocess
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from paged_kv_compile.allocator import BuiltinAllocator
from paged_kv_compile.config import Bucket
from paged_kv_compile.metadata import MetadataBuilder
from paged_kv_compile.models.dreamzero import DREAMZERO_14B
from paged_kv_compile.models.hunyuan_image3 import HUNYUAN_IMAGE3
from paged_kv_compile.pool import KVPool
from paged_kv_compile.scheduler import Scheduler
from paged_kv_compile.families.dreamzero import DreamZeroSpec
from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec


def _setup(num_layers, kv_heads, head_dim, block_size, blocks_per_layer, scratch_tokens, device="cpu"):
    scratch_blocks = -(-scratch_tokens // block_size) + 1
    pool = KVPool(num_layers, blocks_per_layer, block_size, kv_heads, head_dim, scratch_rows=2,
                  scratch_blocks_per_row=scratch_blocks, dtype=torch.bfloat16, device="meta")
    scheduler = Scheduler(pool, BuiltinAllocator(blocks_per_layer), max_rows=2)
    return scheduler, MetadataBuilder(pool, device=device)


class OpCounter(TorchDispatchMode):
    """Records the torch operators dispatched while it is active; `compute` leaves out `aten.detach` (what
    `Tensor.numpy()` dispatches to make a view: it touches no data)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    @property
    def compute(self) -> list[str]:
        return [op for op in self.ops if op != "aten.detach.default"]


@contextlib.contextmanager
def busy_processes(n: int):
    """`n` other processes spinning on the CPU while the block runs (the machine under load)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.2 if n else 0)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _forward(scheduler, builder, plan_fn, fresh: bool, times: dict | None = None, counter: bool = False,
             finish: bool = True):
    """One planned forward's metadata; `fresh` drops the bucket's repeat key first (a real rebuild of the same plan). Appends the plan
    (+ finish) and build times in microseconds to `times`; with `counter`, returns the ops the build dispatched."""
    def run():
        t0 = time.perf_counter_ns()
        plan = plan_fn()
        bucket = Bucket(len(plan.rows), plan.tokens, plan.context)
        meta = builder.buffers(bucket)
        if fresh:
            meta.last_key = ()
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        with OpCounter() if counter else contextlib.nullcontext() as ops:
            builder.build(bucket, plan.rows, plan.key)
        t2, c2 = time.perf_counter_ns(), time.thread_time_ns()
        if finish:
            scheduler.finish_forward(plan)
        t3 = time.perf_counter_ns()
        if times is not None:
            times["build"].append((t2 - t1) / 1e3)
            times["build_cpu"].append((c2 - c1) / 1e3)
            times["plan"].append((t1 - t0 + t3 - t2) / 1e3)
        return ops if counter else None
    return run


def _timed(name, layers, kind, scheduler, builder, plan_fn, fresh, repeats, finish: bool = True) -> dict:
    """Time `repeats` forwards and count the copies they really issued into the metadata buffers (per forward),
    after one untimed run that creates the bucket's buffers (whose padding state is a copy of its own) and one
    that counts the torch ops a build dispatches."""
    _forward(scheduler, builder, plan_fn, fresh, finish=finish)()
    ops = _forward(scheduler, builder, plan_fn, fresh, counter=True, finish=finish)()
    copies, h2d = builder.copies, builder.h2d_copies
    times: dict = {"build": [], "build_cpu": [], "plan": []}
    run = _forward(scheduler, builder, plan_fn, fresh, times, finish=finish)
    for _ in range(repeats):
        run()
    return _row(name, layers, kind, times, (builder.copies - copies) / repeats, (builder.h2d_copies - h2d) / repeats,
                ops)


def _alternating(*plan_fns):
    """A plan function that cycles through `plan_fns`: forwards of different owners take turns, so every build
    is a fresh one (the bucket last held the other owner's layout), as on a server interleaving sessions."""
    turn = [0]

    def plan():
        fn = plan_fns[turn[0] % len(plan_fns)]
        turn[0] += 1
        return fn()
    return plan


def dreamzero(repeats: int, device: str = "cpu") -> list[dict]:
    """DreamZero-14B with the window full (its longest metadata): two sliding-window sessions (no reset), whose
    forwards alternate for the fresh builds; one session's denoising steps in a row for the repeats."""
    cfg = DREAMZERO_14B
    spec = dataclasses.replace(DreamZeroSpec.from_model_config(cfg), reset_frames=None)
    block = 16  # divides frame_seqlen = 880
    sched, builder = _setup(cfg.num_layers, cfg.num_heads, cfg.head_dim, block,
                            2 * 2 * spec.window_tokens // block, spec.tokens_per_forward, device)
    sessions = ("s", "u")
    for sid in sessions:
        sched.admit(sid, spec, rows=2)
        for _ in range(spec.window_frames // spec.chunk_frames):  # fill the window
            _forward(sched, builder, lambda: sched.plan(sid, "commit"), True)()
    commit = [functools.partial(sched.plan, sid, "commit") for sid in sessions]
    denoise = [functools.partial(sched.plan, sid, "denoise") for sid in sessions]
    return [
        _timed("DreamZero-14B", cfg.num_layers, "commit (new blocks)", sched, builder, _alternating(*commit), False,
               repeats),
        _timed("DreamZero-14B", cfg.num_layers, "denoise: build", sched, builder, _alternating(*denoise), False,
               repeats),
        _timed("DreamZero-14B", cfg.num_layers, "denoise: repeat", sched, builder, denoise[0], False, repeats),
    ]


def hunyuan(repeats: int, device: str = "cpu") -> list[dict]:
    """HunyuanImage-3: one prefill's metadata (rebuilt each repeat) and the denoising steps of two requests, which
    alternate for the fresh builds; one request's steps in a row for the repeats."""
    cfg = HUNYUAN_IMAGE3
    block, prefix = 16, 1024
    sched, builder = _setup(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block, 2 * 2 * prefix // block,
                            cfg.target_len, device)
    spec = HunyuanSpec((1000, 300), cfg.target_len, ((1, 1 + cfg.image_tokens),))
    mask = spec.padded_mask(prefix)  # the prefill reads each row's layout from the model's mask (once per request)
    # The prefill plan reads the (S, S) mask (once per request), so one prefill is planned and its metadata built
    # `repeats` times; its plan + finish time is that one plan's.
    rows, plan_us = [], []
    for rid in ("r", "q"):
        sched.admit(rid, spec)
        t0 = time.perf_counter_ns()
        prefill = sched.plan(rid, "prefill", prefix_capacity=prefix, attention_mask=mask)
        plan_us.append((time.perf_counter_ns() - t0) / 1e3)
        if not rows:  # a prefill has no repeat key (its layout comes from its mask): every one is a build
            rows = [_timed("HunyuanImage-3", cfg.num_layers, "prefill: build", sched, builder, lambda: prefill,
                           True, repeats, finish=False)]
        sched.finish_forward(prefill)
    for row in rows:
        row["plan_finish_median_us"] = round(statistics.median(plan_us), 1)
    step = [functools.partial(sched.plan, rid, "step", prefix_capacity=prefix) for rid in ("r", "q")]
    rows.append(_timed("HunyuanImage-3", cfg.num_layers, "denoising step: build", sched, builder, _alternating(*step),
                       False, repeats))
    rows.append(_timed("HunyuanImage-3", cfg.num_layers, "denoising step: repeat", sched, builder, step[0], False,
                       repeats))
    return rows


def _row(model, layers, kind, times, copies, h2d, ops):
    total = [a + b for a, b in zip(times["build"], times["plan"])]
    us = lambda xs, f: round(f(xs), 1)  # noqa: E731
    return {
        "model": model, "layers": layers, "forward": kind,
        "build_median_us": us(times["build"], statistics.median), "build_max_us": us(times["build"], max),
        "build_cpu_median_us": us(times["build_cpu"], statistics.median),
        "plan_finish_median_us": us(times["plan"], statistics.median),
        "median_ms": round(statistics.median(total) / 1e3, 3), "min_ms": round(min(total) / 1e3, 3),
        "max_ms": round(max(total) / 1e3, 3), "copies_per_forward": copies, "h2d_copies_per_forward": h2d,
        "torch_ops_per_build": len(ops.ops), "torch_compute_ops_per_build": len(ops.compute),
    }


COLUMNS = [("model", "model"), ("layers", "layers"), ("forward", "forward"), ("build median us", "build_median_us"),
           ("build max us", "build_max_us"), ("build CPU median us", "build_cpu_median_us"), ("plan+finish median us", "plan_finish_median_us"),
           ("total median ms", "median_ms"), ("copies/fwd", "copies_per_forward"),
           ("H2D/fwd", "h2d_copies_per_forward"), ("torch ops/build", "torch_ops_per_build"),
           ("of which compute", "torch_compute_ops_per_build")]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--mask-only" in argv:
        return mask_read(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="cpu", help="where the metadata buffers live (cpu: no H2D copies)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--busy", type=int, default=0, help="other processes spinning on the CPU meanwhile")
    args = parser.parse_args(argv)
    old_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with busy_processes(args.busy):
            rows = dreamzero(args.repeats, args.device) + hunyuan(args.repeats, args.device)
    finally:
        torch.set_num_threads(old_threads)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"torch threads {args.threads or old_threads}, {args.busy} busy processes, {args.repeats} repeats, "
          f"metadata on {args.device}")
    print(" | ".join(h for h, _ in COLUMNS))
    for r in rows:
        print(" | ".join(str(r[k]) for _, k in COLUMNS))
    return 0


def mask_read(argv: list[str] | None = None) -> int:
    """`--mask-only [--repeats N] [--threads N]`: the host time of the HunyuanImage-3 mask reads, once per
    request: one CFG row's layout read from its prefill mask (`layout.layout_from_prefill_mask`), and the first
    step's plan, which checks both rows' step masks against the layout (`layout.mask_disagreement`). The
    request of `hunyuan()` above (prompts 1000 and 300 padded to 1024, then the 4098-token target: S = 5122),
    its [prompt | pad | target] (2, 1, S, S) mask boolean and bf16 additive (0 / finfo.min); the step's mask is
    its target rows."""
    parser = argparse.ArgumentParser(description=mask_read.__doc__.splitlines()[0])
    parser.add_argument("--mask-only", action="store_true")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    old_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        _mask_read(args.repeats)
    finally:
        torch.set_num_threads(old_threads)
    return 0


def _mask_read(repeats: int) -> None:
    from paged_kv_compile.layout import layout_from_prefill_mask, mask_rows

    cfg, block, prefix = HUNYUAN_IMAGE3, 16, 1024
    spec = HunyuanSpec((1000, 300), cfg.target_len, ((1, 1 + cfg.image_tokens),))
    allowed = spec.padded_mask(prefix)
    additive = torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill(~allowed, torch.finfo(torch.bfloat16).min)
    print(f"S = {allowed.shape[-1]}, torch threads {torch.get_num_threads()}, {repeats} repeats; ms")
    summary = lambda xs: f"median {statistics.median(xs):.1f}, min {min(xs):.1f}, max {max(xs):.1f}"  # noqa: E731
    for name, mask in (("bool", allowed), ("bf16 additive", additive)):
        rows, steps = [], []
        for _ in range(repeats):
            for r, row in enumerate(mask_rows(mask, 2)):
                t0 = time.perf_counter_ns()
                layout_from_prefill_mask(row, r)
                rows.append((time.perf_counter_ns() - t0) / 1e6)
            sched, _ = _setup(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block, 2 * prefix // block,
                              cfg.target_len)
            sched.admit("r", spec)
            sched.finish_forward(sched.plan("r", "prefill", prefix_capacity=prefix,
                                            attention_mask=mask))
            t0 = time.perf_counter_ns()
            sched.plan("r", "step", prefix_capacity=prefix, attention_mask=mask[:, :, prefix:])
            steps.append((time.perf_counter_ns() - t0) / 1e6)
        print(f"{name}: prefill mask, per row: {summary(rows)}; first step plan (2 rows): {summary(steps)}")


if __name__ == "__main__":
    raise SystemExit(main())
