"""Forward time, paged vs dense, both compiled regionally with the same inner compiler.

DreamZero: a denoising forward as the window fills (first chunk, half window, full window) and a
commit forward at full window. HunyuanImage-3: the prefill and a denoising step. Then the attention
of those forwards alone (all layers; dense cat + SDPA vs the paged op), to separate its share. The dense model's
cache grows as the window fills, so its compiled blocks see a new shape per fill level (compiled per
level, dynamic=False); the paged blocks compile once. Both are warmed up before timing; paged and
dense forwards alternate within every repeat and the ratio paged/dense is taken per repeat, so the
reported figure is the median of per-repeat ratios with its spread (min/max and interquartile range).
Outputs of both paths are compared too (max |paged - dense|), so the two time the same computation.

    python -m benchmarks.forward_time [--quick] [--json] [--inner inductor] [--configs tiny,mid] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


import torch

from benchmarks._common import (
    OwnerRun,
    bench_settings,
    format_table,
    interleaved,
    machine_info,
    ratio_entry,
    warm_inductor,
)
from benchmarks._models import (
    DZ_MID,
    DZ_TINY,
    HY_MID,
    HY_PROMPTS,
    HY_TINY,
    dreamzero_loop,
    dreamzero_setup,
    hunyuan_loop,
    hunyuan_setup,
)

CONFIGS = {"tiny": (DZ_TINY, HY_TINY), "mid": (DZ_MID, HY_MID)}
#: (repeats, forwards per timed sample) per config in a full run.
REPEATS = {"tiny": (15, 5), "mid": (10, 1)}


def fill_levels(cfg, quick: bool = False) -> list[tuple[str, int]]:
    """(label, chunks committed before the timed denoising forward)."""
    per_window = cfg.window_frames // cfg.num_frame_per_block
    levels = [("chunk 1", 0), ("half window", per_window // 2 - 1), ("full window", per_window)]
    return [levels[0], levels[-1]] if quick else levels


def _span(cfg, committed: int) -> int:
    """Video keys a query of the denoised chunk attends to (plus the action registers)."""
    return min((committed + 1) * cfg.chunk_tokens, cfg.max_attention_size)


def host_ms(run: OwnerRun, n: int = 20) -> float:
    """Median ms of the paged runtime's host work alone for the run's pending forward: plan + metadata + finish, no
    model."""
    forward, hooks, rt, times = run.loop.pending, run.hooks, run.runtime, []
    for _ in range(n):
        t0 = time.perf_counter()
        # no model: the forward deliberately runs no attention
        with rt.forward_plan(rt.plan(hooks.owner_id, forward.kind, **{**hooks.geometry, **forward.info}),
                             expect_attention=False):
            pass
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def _diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def bench_dreamzero(name: str, cfg, inner: str, repeats: int, inner_loops: int, quick: bool) -> list[dict]:
    """The session's own loop, 1 denoising step per chunk, on both paths with the same seed. At each fill level
    both loops run to their first denoising forward after that many commits, and that forward (it changes no
    state) is repeated and timed; then, at full window, the next commit is repeated and timed."""
    dense = dreamzero_setup(cfg, "dense", inner)
    paged = dreamzero_setup(cfg, "paged", inner)
    levels = fill_levels(cfg, quick)
    loop = dreamzero_loop(num_chunks=levels[-1][1] + 2, steps=1, seed=0)  # up to the commit after the last level
    rows = []
    try:
        sd, sp = OwnerRun(dense, **loop), OwnerRun(paged, **loop)
        for label, committed in levels:
            def before_level(forward, committed=committed) -> bool:
                return forward.kind != "denoise" or forward.index < committed

            # The dense history is built uncompiled: its compiled blocks see only the timed cache lengths.
            with torch.compiler.set_stance("force_eager"):
                sd.loop.run_while(before_level)
            sp.loop.run_while(before_level)
            diff = _diff(sd.loop.call_pending()[:2], sp.loop.call_pending()[:2])  # (video, action) velocities
            times = interleaved({"dense": sd.loop.call_pending, "paged": sp.loop.call_pending}, repeats, inner_loops)
            span = _span(cfg, committed)
            rows.append({
                "family": "dreamzero", "config": name, "forward": "denoise", "fill": label,
                "committed_chunks": committed, "keys_per_query": span + cfg.action_register_length,
                "fill_fraction": round(span / cfg.max_attention_size, 3), **ratio_entry(times),
                "paged_host_ms": host_ms(sp), "max_abs_diff": diff,
            })
        # A commit at full window: the paged side allocates, builds fresh metadata and evicts every time.
        for run in (sd, sp):
            run.loop.run_one()  # the last timed denoising forward; the next chunk's commit is pending
        assert sd.loop.pending.kind == sp.loop.pending.kind == "commit"
        times = interleaved({"dense": sd.loop.call_pending, "paged": sp.loop.call_pending}, repeats, inner_loops)
        rows.append({
            "family": "dreamzero", "config": name, "forward": "commit", "fill": "full window",
            "committed_chunks": committed, "keys_per_query": cfg.max_attention_size + cfg.action_register_length,
            "fill_fraction": 1.0, **ratio_entry(times), "paged_host_ms": None, "max_abs_diff": None,
        })
        for r in rows:
            r["graphs_dense"], r["graphs_paged"] = dense.backend.frames, paged.backend.frames
        sd.close()
        sp.close()
    finally:
        paged.close()
    return rows


def bench_hunyuan(name: str, cfg, inner: str, repeats: int, inner_loops: int) -> list[dict]:
    """The request's own loop (a prefill, one step) on both paths with the same prompts and seed; each forward is
    repeated and timed before the loop moves on (a repeated prefill writes the same prefix again)."""
    lens, capacity = HY_PROMPTS[name]
    dense = hunyuan_setup(cfg, "dense", inner, max_prefix=capacity)
    paged = hunyuan_setup(cfg, "paged", inner, max_prefix=capacity)
    loop = hunyuan_loop(cfg, lens, capacity, num_steps=2, seed=0)
    rows = []
    try:
        rd, rp = OwnerRun(dense, **loop), OwnerRun(paged, **loop)
        for forward in ("prefill", "step"):
            assert rd.loop.pending.kind == rp.loop.pending.kind == forward
            # the target span's hidden states (a prefill's output also holds the padded prompt's)
            diff = float((rd.loop.call_pending()[:, -cfg.target_len:]
                          - rp.loop.call_pending()[:, -cfg.target_len:]).abs().max())
            times = interleaved({"dense": rd.loop.call_pending, "paged": rp.loop.call_pending}, repeats, inner_loops)
            tokens = capacity + cfg.target_len if forward == "prefill" else cfg.target_len
            rows.append({
                "family": "hunyuan_image3", "config": name, "forward": forward,
                "fill": f"prompts {list(lens)} / capacity {capacity}", "tokens_per_row": tokens,
                "keys_per_query": capacity + cfg.target_len, **ratio_entry(times),
                "paged_host_ms": host_ms(rp), "max_abs_diff": diff,
            })
            for run in (rd, rp):
                run.loop.run_one()
        for r in rows:
            r["graphs_dense"], r["graphs_paged"] = dense.backend.frames, paged.backend.frames
        rd.close()
        rp.close()
    finally:
        paged.close()
    return rows


def bench_attention_only(name: str, dz_cfg, hy_cfg, repeats: int, inner_loops: int, quick: bool,
                         clock: str = "wall") -> list[dict]:
    """The attention of the same forwards alone (all layers), at the same shapes: dense cat + SDPA vs the op.

    Uses the GPU suite's workloads (benchmarks/gpu_suite.py) on the CPU with the reference kernel; it
    separates the attention's share of the model-level ratio from the rest of the block.
    """
    from benchmarks import gpu_suite

    dz = gpu_suite.DreamZeroGeometry(heads=dz_cfg.num_heads, head_dim=dz_cfg.head_dim,
                                     frame_seqlen=dz_cfg.frame_seqlen, chunk_frames=dz_cfg.num_frame_per_block,
                                     window_frames=dz_cfg.window_frames, action_tokens=dz_cfg.action_register_length)
    lens, capacity = HY_PROMPTS[name]
    hy = gpu_suite.HunyuanGeometry(heads=hy_cfg.num_heads, kv_heads=hy_cfg.num_kv_heads, head_dim=hy_cfg.head_dim,
                                   image_h=hy_cfg.image_h, image_w=hy_cfg.image_w, prompts=tuple(lens),
                                   capacity=capacity)
    cases = [gpu_suite.dreamzero_case(dz, label, dz_cfg.num_layers, dz_cfg.frame_seqlen, torch.float32,
                                      torch.device("cpu")) for label, _ in fill_levels(dz_cfg, quick)]
    cases += [gpu_suite.hunyuan_case(hy, phase, hy_cfg.num_layers, 16, torch.float32, torch.device("cpu"))
              for phase in ("prefill", "step")]
    rows = []
    for case in cases:
        paged = case.paged("reference")
        diff = max(float((a[:, case.compare_rows] - b[:, case.compare_rows]).abs().max())
                   for a, b in zip(paged(), case.dense["dense"]()))
        times = interleaved({"dense": case.dense["dense"], "paged": paged}, repeats, inner_loops,
                            clock=time.thread_time if clock == "cpu" else time.perf_counter)
        rows.append({"family": case.family, "config": name, "attention": case.name, "clock": clock,
                     "keys_per_query": case.info["keys_per_query"], **ratio_entry(times), "max_abs_diff": diff})
    return rows


def op_overhead(repeats: int = 20, calls: int = 200) -> dict:
    """Fixed host cost of one ``write_attend`` call at tiny shapes (2 rows x 16 tokens, 2 heads x 8): the op
    through the dispatcher as the runtime calls it (the lean Autograd kernel, `ops/write_attend.py:
    _lean_autograd`), the same through `custom_op`'s own Python layers, and the kernel function called
    directly (`write_attend._run`: checks + reference kernel, no dispatcher). Each repeat times `calls`
    calls of each, interleaved; microseconds per call, median and min over repeats, CPU time of the calling
    thread (the dispatch is Python on this thread)."""
    from paged_kv_compile.ops import write_attend as wa

    R, T, H, D, B = 2, 16, 2, 8, 4
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(R, T, H, D, generator=gen) for _ in range(3))
    pool = torch.zeros(2, 2 * R * T // B + 1, B, H, D)
    slots = torch.arange(R * T, dtype=torch.int64).view(R, T)
    table = torch.arange(R * T // B, dtype=torch.int32).view(R, T // B)
    seq, vis = torch.full((R,), T, dtype=torch.int32), torch.full((R, T), T, dtype=torch.int32)
    args = (q, k, v, pool, slots, table, seq, vis, D ** -0.5)
    op = torch.ops.paged_kv.write_attend.default

    def loop(fn):
        def run():
            for _ in range(calls):
                fn()
        return run

    def through_custom_op_layers():
        with wa.custom_op_layers():
            loop(lambda: op(*args, "reference", "full"))()

    fns = {"op (lean dispatch)": loop(lambda: op(*args, "reference", "full")),
           "op (custom_op layers)": through_custom_op_layers,
           "kernel function alone": loop(lambda: wa._run(*args, "reference", "full", None, None))}
    times = interleaved(fns, repeats, clock=time.thread_time)
    return {name: {"median_us": round(statistics.median(t) / calls * 1e6, 1),
                   "min_us": round(min(t) / calls * 1e6, 1)} for name, t in times.items()}


def settle_heap() -> None:
    """Allocate and free one 16 MiB block, so that glibc serves later allocations below 16 MiB from its
    heap and keeps freed memory there, as a long-running process has it (its mmap threshold adapts to
    the largest mmapped block freed, up to 32 MiB: a larger block would not move it).

    Why: without it, which side paid page faults for fresh memory depended on what the other side had
    just freed: the paged op reads the pool through views (ops/reference.py: _span_view) and allocates
    less per call, and dense's `cat` outputs then took about 1,100 minor faults per call; the same code
    measured 0.93x-1.16x at chunk 1 from one process to the next, 1.31x in both runs after this call
    (docs/benchmarks.md, "CPU attention")."""
    block = torch.empty(16 * 2**20, dtype=torch.uint8)
    block.fill_(0)
    del block


def run(quick: bool = False, inner: str | None = None, configs: list[str] | None = None,
        repeats: int | None = None, threads: int | None = None, attention_only: bool = False,
        clock: str = "wall", overhead: bool = False, view_runs: bool = True) -> dict:
    inner = inner or ("aot_eager" if quick else "inductor")
    configs = configs or (["tiny"] if quick else ["tiny", "mid"])
    t0 = time.perf_counter()
    rows, attention = [], []
    settle_heap()
    with bench_settings(threads or (1 if quick else None), view_runs=view_runs):
        machine = machine_info()
        if inner == "inductor" and not attention_only:
            warm_inductor()
        for name in configs:
            reps, loops = (3, 1) if quick else REPEATS[name]
            reps = repeats or reps
            dz, hy = CONFIGS[name]
            if not attention_only:
                torch._dynamo.reset()
                rows += bench_dreamzero(name, dz, inner, reps, loops, quick)
                torch._dynamo.reset()
                rows += bench_hunyuan(name, hy, inner, reps, loops)
            attention += bench_attention_only(name, dz, hy, reps, loops, quick, clock)
        extra = {"op_overhead": op_overhead(3 if quick else 20)} if overhead else {}
    return {
        "benchmark": "forward_time",
        "machine": machine,
        "settings": {"inner_compiler": inner, "kernel": "reference", "compile": "regional, fullgraph, dynamic=False",
                     "configs": configs, "quick": quick, "dtype": "float32",
                     "view_runs": view_runs},
        "rows": rows,
        "attention_rows": attention,
        **extra,
        "seconds": round(time.perf_counter() - t0, 1),
    }


COLUMNS = [("family", "family"), ("config", "config"), ("forward", "forward"), ("fill", "fill"),
           ("keys/query", "keys_per_query"), ("dense ms", "dense_ms"), ("paged ms", "paged_ms"),
           ("paged/dense median", "r_med"), ("[min, max]", "r_range"), ("IQR", "r_iqr"), ("n", "r_n"),
           ("paged host ms", "host"), ("max |diff|", "diff"), ("graphs d/p", "graphs")]


ATTENTION_COLUMNS = [("config", "config"), ("attention (all layers)", "attention"), ("keys/query", "keys_per_query"),
                     ("dense ms", "dense_ms"), ("paged ms", "paged_ms"), ("paged/dense median", "r_med"),
                     ("[min, max]", "r_range"), ("IQR", "r_iqr"), ("max |diff|", "diff")]


def attention_table_rows(result: dict) -> list[dict]:
    out = []
    for r in result.get("attention_rows", []):
        q = r["ratio"]
        out.append({**r, "r_med": f"{q['median']:.3f}", "r_range": f"[{q['min']:.3f}, {q['max']:.3f}]",
                    "r_iqr": f"{q['q1']:.3f}-{q['q3']:.3f}", "diff": f"{r['max_abs_diff']:.1e}"})
    return out


def table_rows(result: dict) -> list[dict]:
    out = []
    for r in result["rows"]:
        q = r["ratio"]
        out.append({**r, "r_med": f"{q['median']:.3f}", "r_range": f"[{q['min']:.3f}, {q['max']:.3f}]",
                    "r_iqr": f"{q['q1']:.3f}-{q['q3']:.3f}", "r_n": q["n"],
                    "diff": "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}",
                    "host": "-" if r["paged_host_ms"] is None else r["paged_host_ms"],
                    "graphs": f"{r['graphs_dense']}/{r['graphs_paged']}"})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny configs, 2 fill levels, 3 repeats, aot_eager")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--inner", choices=("inductor", "aot_eager", "eager"), default=None,
                        help="inner compiler of both paths (default: inductor; aot_eager with --quick)")
    parser.add_argument("--configs", default=None, help="comma-separated: tiny,mid")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's; 1 with --quick)")
    parser.add_argument("--attention-only", action="store_true",
                        help="only the attention-alone table (no model forwards, nothing compiled)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="what the attention-alone table times: wall time, or the calling thread's CPU time "
                             "(time.thread_time, not inflated by other processes' preemption; use with --threads 1, "
                             "where that thread does all the work)")
    parser.add_argument("--op-overhead", action="store_true",
                        help="also the fixed host cost of one op call at tiny shapes: lean dispatch vs custom_op's "
                             "Python layers vs the kernel function alone")
    parser.add_argument("--no-view-runs", action="store_true",
                        help="the reference kernel gathers and scatters even where a row's blocks/slots are one "
                             "ascending run (ops/reference.py: VIEW_RUNS): what a fragmented table costs")
    args = parser.parse_args(argv)
    configs = args.configs.split(",") if args.configs else None
    result = run(args.quick, args.inner, configs, args.repeats, args.threads, args.attention_only, args.clock,
                 args.op_overhead, not args.no_view_runs)
    if args.json:
        print(json.dumps(result))
        return 0
    s = result["settings"]
    print(f"forward time, paged / dense (inner compiler {s['inner_compiler']}, kernel {s['kernel']}, "
          f"{result['machine']['torch_threads']} threads, {result['seconds']} s, "
          f"{'views of ascending runs' if s['view_runs'] else 'gather/scatter always'})")
    if result["rows"]:
        print(format_table(table_rows(result), COLUMNS))
    print(f"\nattention alone (dense cat + SDPA vs write_attend, reference kernel), same shapes, {args.clock} time")
    print(format_table(attention_table_rows(result), ATTENTION_COLUMNS))
    if "op_overhead" in result:
        print("\none write_attend call at tiny shapes, us of CPU time (median, min over repeats)")
        for name, t in result["op_overhead"].items():
            print(f"  {name:24s} {t['median_us']:8.1f} {t['min_us']:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
