"""KV memory, paged vs dense: measured on the tiny models, and at the real sizes.

Measured (tiny models, CPU): N DreamZero sessions and M HunyuanImage-3 requests served interleaved
(round-robin, one chunk / one forward each per round), compiled regionally, once dense and once paged.
  * dense KV held: bytes of the distinct storages behind every live cache tensor, sampled after every
    forward (the dense caches are allocated on demand, so this is also what dense reserves);
  * paged KV reserved: the pool tensor (+ the writable cache stand-ins and the metadata buffers), all
    allocated before the run; paged KV held: the blocks the allocator has handed out, sampled inside every
    forward (after the plan took its blocks) and after it;
  * peak allocation: the peak of torch's CPU allocations during the run net of its frees, from the
    profiler's memory events (compiled code included; the CPU stand-in for torch.cuda.max_memory_allocated,
    not RSS). It includes activations, equal on both paths apart from attention's temporaries.
Real sizes (DREAMZERO_14B, HUNYUAN_IMAGE3, bf16): dense = the caches the reference models allocate over
their loop (DreamZero: per CFG row, growing to the longest history of a window-reset cycle; the block
also returns a fresh stacked cache every forward, so a forward briefly holds old + new); paged = blocks
the real scheduler hands out (driven on a pool on the "meta" device: no memory) + scratch + pad block.
Sessions that fit a budget: paged is measured by admitting sessions into a budget-sized pool until the
scheduler refuses; dense is the arithmetic above.

    python -m benchmarks.memory [--quick] [--json] [--sessions N] [--requests M] [--budget-gib 40]
    python -m benchmarks.memory --fp8-capacity 80    # DreamZero-14B sessions per 80 GiB, bf16 vs FP8
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time


import torch

from benchmarks._common import (
    AllocationTracker,
    OwnerRun,
    bench_settings,
    format_table,
    machine_info,
    storage_bytes,
    tensors_in,
)
from benchmarks._models import DZ_TINY, HY_TINY, dreamzero_loop, dreamzero_setup, hunyuan_loop, hunyuan_setup
from paged_kv_compile import families
from paged_kv_compile.allocator import BuiltinAllocator
from paged_kv_compile.config import PagedKVConfig
from paged_kv_compile.driver import PagedHooks
from paged_kv_compile.errors import CapacityError, ConfigError
from paged_kv_compile.models.hooks import DenseHooks
from paged_kv_compile.families.dreamzero import DreamZeroSpec, session_blocks_per_row
from paged_kv_compile.models.dreamzero import DREAMZERO_14B
from paged_kv_compile.models.hunyuan_image3 import HUNYUAN_IMAGE3
from paged_kv_compile.pool import KVPool
from paged_kv_compile.scheduler import Scheduler
from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec

GiB = 2**30
#: Prompt lengths (cond, uncond) of the tiny requests; capacity 32, paged block size 4.
TINY_HY_PROMPTS = [(20, 7), (28, 5), (12, 12), (30, 9), (17, 3), (25, 11)]
TINY_HY_CAPACITY, TINY_HY_BLOCK = 32, 4
#: Real HunyuanImage-3 request layouts: (cond, uncond) prompt lengths, padded to capacity 1024.
REAL_HY_PROMPTS = {"cond 1000 / uncond 300": (1000, 300), "cond 1000 / uncond 1000": (1000, 1000)}
REAL_HY_CAPACITY = 1024
REAL_BLOCK = 16
BUDGETS_GIB = list(range(8, 161, 8))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# ---- dense arithmetic (what the reference models allocate) -----------------------------------------


def dreamzero_dense_cycle(cfg) -> dict:
    """Dense KV tokens per CFG row of one session over a window-reset cycle of the reference loop.

    The cache grows by concatenation (capped at the window) only on commits; every forward's block also
    returns `stack([new_k, new_v])`, a new cache of min(cache + chunk, window) tokens, alive next to the
    old one until the forward ends (all layers: the model keeps the list).
    """
    C, W = cfg.chunk_tokens, cfg.max_attention_size
    cycle = max(cfg.window_reset_frames // cfg.num_frame_per_block, 1)
    cache = held = peak = 0
    for c in range(cycle):
        if c:  # commit of the previous chunk
            new = min(cache + C, W)
            peak, cache = max(peak, cache + new), new
        peak = max(peak, cache + min(cache + C, W))  # denoising forwards (their new cache is dropped)
        held = max(held, cache)
    return {"held_tokens_per_row": held, "peak_tokens_per_row": peak}


def token_bytes(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def dreamzero_dense_bytes(cfg, dtype: torch.dtype, rows: int = 2) -> dict:
    tb = token_bytes(cfg.num_layers, cfg.num_heads, cfg.head_dim, dtype)
    cyc = dreamzero_dense_cycle(cfg)
    return {"held": rows * cyc["held_tokens_per_row"] * tb, "peak": rows * cyc["peak_tokens_per_row"] * tb,
            **cyc}


def hunyuan_dense_bytes(cfg, rows: int, capacity: int, dtype: torch.dtype) -> dict:
    """Per request: the prefix caches (padded to capacity); per step: one layer's cat + repeat_kv temporaries."""
    item = torch.empty((), dtype=dtype).element_size()
    S = capacity + cfg.target_len
    held = cfg.kv_cache_bytes(rows, capacity, dtype)
    temp = 2 * rows * S * cfg.head_dim * item * (cfg.num_kv_heads + cfg.num_heads)
    return {"held": held, "step_transient": temp}


def dense_fit(budget: int, held: int, peak: int | None = None) -> int:
    """Sessions whose dense caches fit: all held, plus (with `peak`) one of them mid-forward."""
    if peak is None:
        return budget // held
    return 0 if budget < peak else (budget - peak) // held + 1


# ---- paged, measured on the real scheduler ---------------------------------------------------------


def _meta_scheduler(num_layers, kv_heads, head_dim, block, scratch_tokens, dtype, *, budget_bytes=None,
                    blocks_per_layer=None, kv_dtype=None):
    cfg = PagedKVConfig(num_layers=num_layers, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block,
                        budget_bytes=budget_bytes, blocks_per_layer=blocks_per_layer, max_rows=2,
                        scratch_tokens_per_row=scratch_tokens, dtype=dtype, kv_dtype=kv_dtype, device="meta")
    pool = KVPool.from_config(cfg)
    return pool, Scheduler(pool, BuiltinAllocator(pool.blocks_per_layer), max_rows=2)


def _pool_bytes(pool: KVPool) -> int:
    return pool.nbytes  # FP8 scales included


def paged_dreamzero_probe(cfg, dtype, block: int = REAL_BLOCK, *, budget_bytes=None, blocks_per_layer=None,
                          max_sessions: int | None = None, kv_dtype=None) -> dict:
    """Admit sessions one by one and drive each through a whole window-reset cycle of the loop.

    Counts the sessions that complete while all earlier ones keep their history (the worst case: every
    session at its longest history). Also records the blocks one session holds after and during forwards.
    """
    try:
        pool, sched = _meta_scheduler(cfg.num_layers, cfg.num_heads, cfg.head_dim, block, cfg.tokens_per_forward,
                                      dtype, budget_bytes=budget_bytes, blocks_per_layer=blocks_per_layer,
                                      kv_dtype=kv_dtype)
    except ConfigError:
        return {"sessions": 0, "pool_bytes": 0}
    spec = DreamZeroSpec.from_model_config(cfg)
    commits = max(cfg.window_reset_frames // cfg.num_frame_per_block, 1) - 1
    total = pool.blocks_per_layer
    admitted = held = inflight = 0
    while max_sessions is None or admitted < max_sessions:
        sid = f"s{admitted}"
        before = total - sched.allocator.num_free
        try:
            sched.admit(sid, spec, rows=2)
            for _ in range(commits):
                plan = sched.plan(sid, "commit")
                inflight = max(inflight, total - sched.allocator.num_free - before)
                sched.finish_forward(plan)
                held = max(held, total - sched.allocator.num_free - before)
                sched.finish_forward(sched.plan(sid, "denoise"))  # a denoising forward
        except CapacityError:
            break
        admitted += 1
    per_block = KVPool.bytes_per_block_all_layers(PagedKVConfig(
        num_layers=cfg.num_layers, num_kv_heads=cfg.num_heads, head_dim=cfg.head_dim, block_size=block,
        blocks_per_layer=1, dtype=dtype, kv_dtype=kv_dtype))
    fixed_blocks = pool.num_blocks_total - pool.scratch_base  # scratch + pad, one layer's size each
    return {"sessions": admitted, "pool_bytes": _pool_bytes(pool), "blocks_per_layer": total,
            "session_held_bytes": held * per_block, "session_inflight_bytes": inflight * per_block,
            "scratch_pad_bytes": fixed_blocks * per_block // cfg.num_layers}


def paged_hunyuan_probe(cfg, prompts: tuple[int, ...], dtype, block: int = REAL_BLOCK, *, budget_bytes=None,
                        blocks_per_layer=None, max_requests: int | None = None) -> dict:
    """Admit requests until the scheduler refuses one; the first is prefilled and stepped.

    Capacity is decided at admission (a request's prompt blocks are reserved then; its forwards use per-row
    scratch), so one request's forwards show the geometry runs. Planning every identical request would only
    repeat the prefill's read of the (S, S) mask, about a second per request at the released size.
    """
    try:
        pool, sched = _meta_scheduler(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block, cfg.target_len, dtype,
                                      budget_bytes=budget_bytes, blocks_per_layer=blocks_per_layer)
    except ConfigError:
        return {"requests": 0, "pool_bytes": 0}
    spec = HunyuanSpec(tuple(prompts), cfg.target_len, ((1, 1 + cfg.image_tokens),))
    capacity = max(REAL_HY_CAPACITY, max(prompts))
    admitted = 0
    while max_requests is None or admitted < max_requests:
        rid = f"r{admitted}"
        try:
            sched.admit(rid, spec)
        except CapacityError:
            break
        if admitted == 0:
            for phase in ("prefill", "step"):
                mask = spec.padded_mask(capacity) if phase == "prefill" else None
                plan = sched.plan(rid, phase, prefix_capacity=capacity, attention_mask=mask)
                sched.finish_forward(plan)
        admitted += 1
    per_block = 2 * block * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    request_blocks = sum(_ceil(p, block) for p in prompts)
    return {"requests": admitted, "pool_bytes": _pool_bytes(pool), "blocks_per_layer": pool.blocks_per_layer,
            "request_bytes": request_blocks * per_block * cfg.num_layers,
            "scratch_pad_bytes": (pool.num_blocks_total - pool.scratch_base) * per_block}


def real_sizes(budget_gib: float, sessions=(1, 2, 4, 8), requests=(1, 8, 32, 128),
               budgets_gib=BUDGETS_GIB) -> dict:
    dtype = torch.bfloat16
    dz = DREAMZERO_14B
    dz_dense = dreamzero_dense_bytes(dz, dtype)
    spec = DreamZeroSpec.from_model_config(dz)
    one = paged_dreamzero_probe(dz, dtype, blocks_per_layer=4 * _ceil(dz.max_attention_size, REAL_BLOCK),
                                max_sessions=1)
    held, inflight, fixed = one["session_held_bytes"], one["session_inflight_bytes"], one["scratch_pad_bytes"]
    dz_rows = []
    for n in sessions:
        # A pool just big enough: admission reserves every session's own peak (both rows, a commit in flight),
        # as a batched commit may carry them all (with nothing reserved, sessions could deadlock).
        blocks = n * 2 * session_blocks_per_row(spec, REAL_BLOCK)
        probe = paged_dreamzero_probe(dz, dtype, blocks_per_layer=max(blocks, 1), max_sessions=n)
        dz_rows.append({"sessions": n, "dense_held_gib": n * dz_dense["held"] / GiB,
                        "dense_peak_gib": ((n - 1) * dz_dense["held"] + dz_dense["peak"]) / GiB,
                        "paged_pool_gib": probe["pool_bytes"] / GiB, "paged_runs_all": probe["sessions"] == n})
    hy_rows, hy_info = [], {}
    for label, prompts in REAL_HY_PROMPTS.items():
        dense = hunyuan_dense_bytes(HUNYUAN_IMAGE3, len(prompts), REAL_HY_CAPACITY, dtype)
        single = paged_hunyuan_probe(HUNYUAN_IMAGE3, prompts, dtype, blocks_per_layer=1024, max_requests=1)
        hy_info[label] = {"dense_request_bytes": dense["held"], "dense_step_transient_bytes": dense["step_transient"],
                          "paged_request_bytes": single["request_bytes"], "paged_scratch_pad_bytes": single[
                              "scratch_pad_bytes"]}
        for m in requests:
            blocks = m * sum(_ceil(p, REAL_BLOCK) for p in prompts)
            probe = paged_hunyuan_probe(HUNYUAN_IMAGE3, prompts, dtype, blocks_per_layer=blocks, max_requests=m)
            hy_rows.append({"prompts": label, "requests": m, "dense_held_gib": m * dense["held"] / GiB,
                            "dense_peak_gib": (m * dense["held"] + dense["step_transient"]) / GiB,
                            "paged_pool_gib": probe["pool_bytes"] / GiB, "paged_runs_all": probe["requests"] == m})
    budget = int(budget_gib * GiB)
    main_prompts = next(iter(REAL_HY_PROMPTS.values()))
    hy_main = hy_info[next(iter(REAL_HY_PROMPTS))]

    def fits(b: int) -> dict:
        return {
            "dreamzero_dense_held": dense_fit(b, dz_dense["held"]),
            "dreamzero_dense_peak": dense_fit(b, dz_dense["held"], dz_dense["peak"]),
            "dreamzero_paged": paged_dreamzero_probe(dz, dtype, budget_bytes=b)["sessions"],
            "hunyuan_dense": dense_fit(b - hy_main["dense_step_transient_bytes"], hy_main["dense_request_bytes"]),
            "hunyuan_paged": paged_hunyuan_probe(HUNYUAN_IMAGE3, main_prompts, dtype, budget_bytes=b)["requests"],
        }

    sweep = {"budget_gib": list(budgets_gib)}
    for b in budgets_gib:
        for k, v in fits(int(b * GiB)).items():
            sweep.setdefault(k, []).append(v)
    return {
        "dtype": "bfloat16", "block_size": REAL_BLOCK,
        "dreamzero": {
            "config": "DREAMZERO_14B: 40 layers, 40 heads x 128, 880 tokens/frame, chunk 2 frames, window 21 frames, "
                      "window reset at frame 20, 2 CFG rows",
            "dense_session_held_bytes": dz_dense["held"], "dense_session_peak_bytes": dz_dense["peak"],
            "dense_held_frames_per_row": dz_dense["held_tokens_per_row"] // dz.frame_seqlen,
            "dense_peak_frames_per_row": dz_dense["peak_tokens_per_row"] // dz.frame_seqlen,
            "paged_session_held_bytes": held, "paged_session_inflight_bytes": inflight,
            "paged_scratch_pad_bytes": fixed, "rows": dz_rows,
            "one_session_pool_over_held": dz_rows[0]["paged_pool_gib"] * GiB / held if sessions[0] == 1 else None,
        },
        "hunyuan": {
            "config": f"HUNYUAN_IMAGE3: 32 layers, 32/8 heads x 128, target 4098 tokens, prefix capacity "
                      f"{REAL_HY_CAPACITY}, 2 CFG rows",
            "layouts": hy_info, "rows": hy_rows,
        },
        "budget_gib": budget_gib, "fit": fits(budget),
        "sweep": sweep,
    }


FP8_COLUMNS = [("pool", "pool"), ("bytes / block (all layers)", "bytes_per_block_all_layers"),
               ("session held GiB", "session_held_gib"), ("sessions", "sessions"), ("pool GiB", "pool_gib")]


def fp8_capacity(budget_gib: float = 80.0) -> dict:
    """DreamZero-14B sessions that fit `budget_gib` of pool, bf16 vs FP8 (scales included), on the real scheduler.

    Same probe as the real-size table: sessions admitted into a budget-sized pool on the "meta" device,
    each driven through a whole window cycle while the earlier ones keep their history.
    """
    dz, budget = DREAMZERO_14B, int(budget_gib * GiB)
    rows = []
    for label, kv_dtype in (("bf16", None), ("fp8 e4m3 (+ scales)", torch.float8_e4m3fn)):
        probe = paged_dreamzero_probe(dz, torch.bfloat16, budget_bytes=budget, kv_dtype=kv_dtype)
        one = paged_dreamzero_probe(dz, torch.bfloat16, blocks_per_layer=4 * _ceil(dz.max_attention_size, REAL_BLOCK),
                                    max_sessions=1, kv_dtype=kv_dtype)
        per_block = KVPool.bytes_per_block_all_layers(PagedKVConfig(
            num_layers=dz.num_layers, num_kv_heads=dz.num_heads, head_dim=dz.head_dim, block_size=REAL_BLOCK,
            blocks_per_layer=1, dtype=torch.bfloat16, kv_dtype=kv_dtype))
        rows.append({"pool": label, "bytes_per_block_all_layers": per_block,
                     "session_held_gib": one["session_held_bytes"] / GiB, "sessions": probe["sessions"],
                     "pool_gib": probe["pool_bytes"] / GiB})
    return {"budget_gib": budget_gib, "block_size": REAL_BLOCK, "rows": rows}


# ---- measured on the tiny models ---------------------------------------------------------------------


class _ObservedHooks(PagedHooks):
    """PagedHooks that sample the allocator inside every forward (after the plan took its blocks) and after it."""

    def __init__(self, runtime, owner_id, observe) -> None:
        super().__init__(runtime, owner_id)
        self._observe = observe

    @contextlib.contextmanager
    def forward(self, kind, **info):
        with super().forward(kind, **info) as active:
            self._observe()
            yield active

    def after(self, forward, result) -> None:
        self._observe()


class _HeldDense(DenseHooks):
    """Dense hooks that keep the caches their loop holds, for the KV-held figure: those handed out, then what a
    forward hands back in their place (`Family.dense_caches_after`); sampled after every forward."""

    def __init__(self, observe) -> None:
        self._observe = observe
        self.held: list = []

    def caches(self, model, batch, **geometry):
        self._family = families.for_model(model)
        self.held = super().caches(model, batch, **geometry)
        return self.held

    def after(self, forward, result) -> None:
        self.held = self._family.dense_caches_after(self.held, forward.kind, result)
        self._observe()


def _schedule(dz, hy, tag: str, n: int, m: int, chunks: int, dz_steps: int, hy_steps: int, observe,
              runs: list) -> int:
    """N sessions and M requests, round-robin: per round each runs one index of its loop (a chunk of a session, a
    step of a request), `observe()` after every forward; appended to `runs`. Returns the number of forwards."""

    def start(setup, owner_id: str, loop: dict) -> OwnerRun:
        hooks = _ObservedHooks(setup.runtime, owner_id, observe) if setup.runtime else _HeldDense(observe)
        return OwnerRun(setup, owner_id, hooks=hooks, **loop)

    scheduled = [start(dz, f"{tag}-dz{i}", dreamzero_loop(num_chunks=chunks, steps=dz_steps, seed=i))
                 for i in range(n)]
    scheduled += [start(hy, f"{tag}-hy{j}", hunyuan_loop(hy.model.cfg, TINY_HY_PROMPTS[j % len(TINY_HY_PROMPTS)],
                                                          TINY_HY_CAPACITY, hy_steps, seed=j)) for j in range(m)]
    runs += scheduled
    observe()
    while not all(run.loop.done for run in scheduled):
        for run in scheduled:
            run.loop.run_index(run.hooks.after)
    for run in scheduled:
        run.close()
        if isinstance(run.hooks, _HeldDense):
            run.hooks.held = []  # a closed run holds no cache
    return sum(run.loop.forwards for run in scheduled)


def measured(n: int, m: int, inner: str, chunks: int | None = None, dz_steps: int = 2, hy_steps: int = 3) -> dict:
    dz_cfg, hy_cfg = DZ_TINY, HY_TINY
    C, W, F = dz_cfg.chunk_tokens, dz_cfg.max_attention_size, dz_cfg.frame_seqlen
    chunks = chunks or W // C + 2  # past the point where the window is full
    tb_dz = token_bytes(dz_cfg.num_layers, dz_cfg.num_heads, dz_cfg.head_dim, torch.float32)
    # A pool sized to what admission reserves: each session's peak (its history plus a chunk in flight, both
    # rows; every session's, as a batched commit may carry them all); the requests' prompt blocks.
    dz_blocks = n * 2 * session_blocks_per_row(DreamZeroSpec.from_model_config(dz_cfg), F)
    hy_blocks = sum(_ceil(p, TINY_HY_BLOCK) for j in range(m) for p in TINY_HY_PROMPTS[j % len(TINY_HY_PROMPTS)])
    out = {}
    for path in ("dense", "paged"):
        torch._dynamo.reset()
        dz = dreamzero_setup(dz_cfg, path, inner, blocks_per_layer=dz_blocks)
        hy = hunyuan_setup(hy_cfg, path, inner, max_prefix=TINY_HY_CAPACITY, blocks_per_layer=max(hy_blocks, 1),
                           block_size=TINY_HY_BLOCK)
        live: dict[str, list] = {"held": [0]}
        runs: list = []
        rts = [dz.runtime, hy.runtime]
        try:
            if path == "dense":
                def observe() -> None:
                    live["held"].append(storage_bytes(_dense_cache_tensors(runs)))
            else:
                def observe() -> None:
                    live["held"].append(sum(
                        (rt.pool.blocks_per_layer - rt.scheduler.allocator.num_free)
                        * KVPool.bytes_per_block_all_layers(rt.config) for rt in rts))
            _schedule(dz, hy, "warm", n, m, chunks, dz_steps, hy_steps, lambda: None, [])  # compiles every shape
            gc.collect()
            live["held"] = [0]
            reserved = {}
            if path == "paged":
                reserved = {  # everything the runtimes allocated up front for KV and its metadata
                    "pool": sum(rt.pool.nbytes for rt in rts),
                    "writable_standins": sum(storage_bytes(getattr(rt, "_writable_standins", {}).values())
                                             for rt in rts),
                    "metadata_buffers": sum(storage_bytes([getattr(b, "device_buffer", None),
                                                           getattr(b, "host_buffer", None)])
                                            for rt in rts for b in rt.metadata.buckets.values()),
                }
            t0 = time.perf_counter()
            with AllocationTracker() as tracker:
                forwards = _schedule(dz, hy, "run", n, m, chunks, dz_steps, hy_steps, observe, runs)
            held_peak = max(live["held"])
            reserved_total = sum(reserved.values()) if path == "paged" else held_peak
            out[path] = {
                "forwards": forwards, "seconds": round(time.perf_counter() - t0, 2),
                "kv_reserved_bytes": reserved_total, "reserved_parts": reserved,
                "kv_held_peak_bytes": held_peak,
                "alloc_peak_during_run_bytes": tracker.peak_bytes,
                "alloc_left_after_run_bytes": tracker.final_bytes,
                "peak_incl_reserved_bytes": tracker.peak_bytes + (reserved_total if path == "paged" else 0),
                "graphs": (dz.backend.frames, hy.backend.frames),
            }
        finally:
            dz.close()
            hy.close()
    dense_dz = dreamzero_dense_bytes(dz_cfg, torch.float32)
    hy_dense = sum(hunyuan_dense_bytes(hy_cfg, 2, TINY_HY_CAPACITY, torch.float32)["held"]
                   for _ in range(m))
    return {
        "sessions": n, "requests": m, "chunks_per_session": chunks, "denoise_steps": dz_steps,
        "hunyuan_forwards_per_request": hy_steps, "inner_compiler": inner,
        "dreamzero": "tiny: 4 layers, 4 heads x 16, fp32, 16 tokens/frame, chunk 2 frames, window 8 frames",
        "hunyuan": f"tiny: 4 layers, 2 kv heads x 16, fp32, capacity {TINY_HY_CAPACITY}, prompts "
                   f"{TINY_HY_PROMPTS[:m]}, paged block {TINY_HY_BLOCK}",
        "predicted_dense_held_bytes": n * dense_dz["held"] + hy_dense,
        "predicted_paged_held_bytes": (n * 2 * (W - C) + 2 * C) * tb_dz + hy_blocks * TINY_HY_BLOCK * token_bytes(
            hy_cfg.num_layers, hy_cfg.num_kv_heads, hy_cfg.head_dim, torch.float32),
        "paths": out,
    }


def _dense_cache_tensors(runs: list[OwnerRun]) -> list[torch.Tensor]:
    """Every cache tensor the live dense runs hold (closed ones hold none)."""
    return tensors_in([run.hooks.held for run in runs])


def run(quick: bool = False, inner: str | None = None, sessions: int | None = None, requests: int | None = None,
        budget_gib: float = 40.0, threads: int | None = None) -> dict:
    inner = inner or ("aot_eager" if quick else "inductor")
    t0 = time.perf_counter()
    with bench_settings(threads or (1 if quick else None)):
        machine = machine_info()
        meas = measured(sessions or (2 if quick else 3), requests or (2 if quick else 4), inner,
                        dz_steps=1, hy_steps=2 if quick else 3)
    real = real_sizes(budget_gib, budgets_gib=[8, 40, 80] if quick else BUDGETS_GIB)
    return {"benchmark": "memory", "machine": machine, "settings": {"inner_compiler": inner, "quick": quick},
            "measured": meas, "real": real, "seconds": round(time.perf_counter() - t0, 1)}


def _kib(b) -> str:
    return f"{b / 1024:.1f}"


def measured_rows(result: dict) -> list[dict]:
    m = result["measured"]
    rows = []
    for path, p in m["paths"].items():
        rows.append({"path": path, "reserved": _kib(p["kv_reserved_bytes"]), "held": _kib(p["kv_held_peak_bytes"]),
                     "predicted": _kib(m[f"predicted_{path}_held_bytes"]),
                     "alloc": _kib(p["alloc_peak_during_run_bytes"]), "total": _kib(p["peak_incl_reserved_bytes"]),
                     "forwards": p["forwards"]})
    return rows


MEASURED_COLUMNS = [("path", "path"), ("KV reserved KiB", "reserved"), ("KV held peak KiB", "held"),
                    ("held predicted KiB", "predicted"), ("alloc peak in run KiB", "alloc"),
                    ("peak incl. reserved KiB", "total"), ("forwards", "forwards")]


def _g(x: float) -> str:
    return f"{x:.2f}"


def real_rows(result: dict) -> tuple[list[dict], list[dict]]:
    r = result["real"]
    dz = [{"n": x["sessions"], "dh": _g(x["dense_held_gib"]), "dp": _g(x["dense_peak_gib"]),
           "pp": _g(x["paged_pool_gib"]), "ok": x["paged_runs_all"]} for x in r["dreamzero"]["rows"]]
    hy = [{"layout": x["prompts"], "m": x["requests"], "dh": _g(x["dense_held_gib"]), "dp": _g(x["dense_peak_gib"]),
           "pp": _g(x["paged_pool_gib"]), "ok": x["paged_runs_all"]} for x in r["hunyuan"]["rows"]]
    return dz, hy


DZ_COLUMNS = [("sessions", "n"), ("dense held GiB", "dh"), ("dense peak GiB", "dp"), ("paged pool GiB", "pp"),
              ("scheduler ran all", "ok")]
HY_COLUMNS = [("prompts", "layout"), ("requests", "m"), ("dense held GiB", "dh"), ("dense peak GiB", "dp"),
              ("paged pool GiB", "pp"), ("scheduler ran all", "ok")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 sessions + 2 requests, aot_eager, 3 budgets")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--inner", choices=("inductor", "aot_eager", "eager"), default=None)
    parser.add_argument("--sessions", type=int, default=None, help="DreamZero sessions in the measured run")
    parser.add_argument("--requests", type=int, default=None, help="HunyuanImage-3 requests in the measured run")
    parser.add_argument("--budget-gib", type=float, default=40.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--fp8-capacity", type=float, default=None, metavar="GIB",
                        help="only DreamZero-14B sessions per GIB of pool, bf16 vs FP8 (fast: no model runs)")
    args = parser.parse_args(argv)
    if args.fp8_capacity is not None:
        cap = fp8_capacity(args.fp8_capacity)
        if args.json:
            print(json.dumps(cap))
        else:
            print(f"DreamZero-14B in {cap['budget_gib']:g} GiB of pool, block size {cap['block_size']}")
            print(format_table(cap["rows"], FP8_COLUMNS))
        return 0
    result = run(args.quick, args.inner, args.sessions, args.requests, args.budget_gib, args.threads)
    if args.json:
        print(json.dumps(result))
        return 0
    m = result["measured"]
    print(f"measured: {m['sessions']} DreamZero sessions + {m['requests']} HunyuanImage-3 requests, tiny, "
          f"interleaved (inner compiler {m['inner_compiler']})")
    print(format_table(measured_rows(result), MEASURED_COLUMNS))
    dz, hy = real_rows(result)
    real = result["real"]
    print(f"\n{real['dreamzero']['config']}, {real['dtype']}")
    print(format_table(dz, DZ_COLUMNS))
    ratio = real["dreamzero"]["one_session_pool_over_held"]
    if ratio is not None:
        print(f"one session: paged pool / KV held = {ratio:.3f} (admission sizes it by its loop's own peak)")
    print(f"\n{real['hunyuan']['config']}, {real['dtype']}")
    print(format_table(hy, HY_COLUMNS))
    fit = real["fit"]
    print(f"\nin {real['budget_gib']:g} GiB of KV: DreamZero-14B sessions dense {fit['dreamzero_dense_held']} "
          f"(held only) / {fit['dreamzero_dense_peak']} (with a forward's new cache), paged "
          f"{fit['dreamzero_paged']}; HunyuanImage-3 requests dense {fit['hunyuan_dense']}, paged "
          f"{fit['hunyuan_paged']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
