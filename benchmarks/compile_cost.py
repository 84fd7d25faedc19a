"""Compile cost, paged vs dense: compiled graphs and compile seconds for models of L regionally compiled blocks.

DreamZero: one session driven through every fill level of its window (chunks until the dense cache has
reached its maximum length), 1 denoising step per chunk. HunyuanImage-3: one request, prefill + 1 step.
Graphs are dynamo frames counted by a counting backend wrapped around "paged_kv" (paged) and around the
plain inner compiler (dense). Compile seconds = wall time of the first (cold) run minus that of a second,
identical run in the same process (warm: no compile), so it includes dynamo tracing, the paged passes
and the inner compiler; "backend s" is the part spent inside the backend. By default Inductor's FX-graph
and AOT-autograd caches are disabled so every graph is really compiled; its C++ build cache (compiled
kernels keyed by source) stays on disk.

    python -m benchmarks.compile_cost [--quick] [--json] [--inner inductor] [--layers 4,8,16]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from typing import Callable

import torch

from benchmarks._common import OwnerRun, Setup, bench_settings, format_table, machine_info, warm_inductor
from benchmarks._models import (DZ_TINY, HY_PROMPTS, HY_TINY, dreamzero_loop, dreamzero_setup, hunyuan_loop,
                               hunyuan_setup)
from paged_kv_compile.models.dreamzero import DREAMZERO_14B


def dense_cache_lengths(cfg) -> list[int]:
    """Distinct cache lengths (tokens) a dense DreamZero block sees over a window-reset cycle.

    Chunk c of a cycle is denoised (and committed at the start of chunk c + 1) with c committed chunks
    in the cache, capped at the window. Each length is its own compiled graph under dynamic=False.
    """
    cycle = cfg.window_reset_frames // cfg.num_frame_per_block
    return sorted({min(c * cfg.chunk_tokens, cfg.max_attention_size) for c in range(max(cycle, 1))})


@contextlib.contextmanager
def inductor_caches(enabled: bool):
    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig

    old = iconfig.fx_graph_cache, fconfig.enable_autograd_cache
    iconfig.fx_graph_cache = fconfig.enable_autograd_cache = enabled
    try:
        yield
    finally:
        iconfig.fx_graph_cache, fconfig.enable_autograd_cache = old


def _row(family, layers, path, setup, cold, warm, frames_cold) -> dict:
    return {
        "family": family, "layers": layers, "path": path, "graphs": frames_cold,
        "recompiles_when_warm": setup.backend.frames - frames_cold,
        "compile_s": round(cold - warm, 2), "backend_s": round(setup.backend.seconds, 2),
        "cold_run_s": round(cold, 2), "warm_run_s": round(warm, 3),
    }


def _bench(family: str, layers: int, make: Callable[[str], Setup], loop: dict) -> list[dict]:
    """One session/request of the model's loop run twice (cold, then warm) per path, each time from a fresh
    dynamo."""
    rows = []
    for path in ("dense", "paged"):
        torch._dynamo.reset()
        setup = make(path)
        try:
            timings = []
            for run_id in ("cold", "warm"):
                t0 = time.perf_counter()
                run = OwnerRun(setup, run_id, **loop)
                run.loop.run()
                run.close()
                timings.append(time.perf_counter() - t0)
                if run_id == "cold":
                    frames_cold = setup.backend.frames
            rows.append(_row(family, layers, path, setup, *timings, frames_cold))
        finally:
            setup.close()
    return rows


def bench_dreamzero(layers: int, inner: str) -> list[dict]:
    cfg = dataclasses.replace(DZ_TINY, num_layers=layers)
    chunks = cfg.window_frames // cfg.num_frame_per_block + 1  # until the dense cache is at its maximum
    return _bench("dreamzero", layers, lambda path: dreamzero_setup(cfg, path, inner),
                  dreamzero_loop(num_chunks=chunks, steps=1, seed=0))


def bench_hunyuan(layers: int, inner: str) -> list[dict]:
    cfg = dataclasses.replace(HY_TINY, num_layers=layers)
    lens, capacity = HY_PROMPTS["tiny"]
    return _bench("hunyuan_image3", layers, lambda path: hunyuan_setup(cfg, path, inner, max_prefix=capacity),
                  hunyuan_loop(cfg, lens, capacity, num_steps=2, seed=0))


def run(quick: bool = False, inner: str | None = None, layers: list[int] | None = None,
        inductor_cache: bool = False, threads: int | None = None) -> dict:
    inner = inner or ("aot_eager" if quick else "inductor")
    layers = layers or ([2, 4] if quick else [4, 8, 16])
    t0 = time.perf_counter()
    rows = []
    with bench_settings(threads or (1 if quick else None)), inductor_caches(inductor_cache):
        machine = machine_info()
        if inner == "inductor":
            warm_inductor()
        for n in layers:
            rows += bench_dreamzero(n, inner)
            rows += bench_hunyuan(n, inner)
    real = DREAMZERO_14B
    lengths = dense_cache_lengths(real)
    return {
        "benchmark": "compile_cost",
        "machine": machine,
        "settings": {"inner_compiler": inner, "layers": layers, "inductor_fx_cache": inductor_cache, "quick": quick,
                     "dreamzero_config": "tiny, window 8 frames, chunk 2 frames",
                     "dreamzero_dense_cache_lengths_tiny": dense_cache_lengths(DZ_TINY)},
        "rows": rows,
        "dreamzero_14b": {
            "dense_graphs_per_cycle": len(lengths),
            "dense_cache_lengths_frames": [n // real.frame_seqlen for n in lengths],
            "paged_graphs": 1,
            "dynamo_recompile_limit_default": torch._dynamo.config.recompile_limit,
        },
        "seconds": round(time.perf_counter() - t0, 1),
    }


COLUMNS = [("family", "family"), ("L", "layers"), ("path", "path"), ("graphs", "graphs"),
           ("compile s", "compile_s"), ("backend s", "backend_s"), ("cold run s", "cold_run_s"),
           ("warm run s", "warm_run_s"), ("recompiles warm", "recompiles_when_warm")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L = 2, 4 with aot_eager")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--inner", choices=("inductor", "aot_eager", "eager"), default=None)
    parser.add_argument("--layers", default=None, help="comma-separated block counts (default 4,8,16)")
    parser.add_argument("--inductor-cache", action="store_true",
                        help="keep Inductor's FX-graph/AOT caches on (repeat compiles of one graph then hit them)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's; 1 with --quick)")
    args = parser.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    result = run(args.quick, args.inner, layers, args.inductor_cache, args.threads)
    if args.json:
        print(json.dumps(result))
        return 0
    s, real = result["settings"], result["dreamzero_14b"]
    print(f"compile cost, regional compile (inner compiler {s['inner_compiler']}, FX cache "
          f"{'on' if s['inductor_fx_cache'] else 'off'}, {result['seconds']} s)")
    print(format_table(result["rows"], COLUMNS))
    print(f"DreamZero-14B: the dense blocks see {real['dense_graphs_per_cycle']} cache lengths per window cycle "
          f"({real['dense_cache_lengths_frames']} frames) = that many graphs under dynamic=False "
          f"(dynamo's default recompile limit is {real['dynamo_recompile_limit_default']}: with fullgraph=True "
          f"the next one raises FailOnRecompileLimitHit); paged: "
          f"{real['paged_graphs']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
