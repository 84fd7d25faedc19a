"""GPU suite: paged `write_attend` (Triton, flash-attn, reference kernels) vs dense SDPA over the
concatenated cache, at the real head geometries with fewer layers; eager and CUDA-graph replay; peak memory.

Cases (all with 2 CFG rows, bf16):
  * DreamZero-14B denoising step (40 heads x 128, 880 tokens/frame, chunk 2 frames + 33 registers, window
    21 frames) with the window's history at the first chunk, half and full window; dense = the model's
    idiom `cat([cache, new])[:, -window:]`, `cat` of the registers, SDPA (its FlashAttention backend), with
    and without the returned `stack([new_k, new_v])`; visibility "full".
  * HunyuanImage-3 (32/8 heads x 128, target 4098 tokens = 1024x1024, prompts 1000 + 300 padded to 1024):
    prefill and a denoising step; dense = cat + repeat_kv + SDPA with the boolean mask; visibility
    "general" (causal text, bidirectional image), which flash-attn's paged API cannot express.
Every case runs `--layers` layers of attention (one pool holding all of them; one dense cache per layer),
with the pool's history made equal to the dense caches so outputs are compared (max |paged - dense|).
Times: CUDA events, per repeat, variants interleaved; ratio = variant / dense (eager) per repeat. Memory:
`torch.cuda.max_memory_allocated()` during one eager call above what was allocated before it (the
persistent caches/pool are reported separately).

A requested kernel that cannot run (missing package, page-size rule, visibility) is an error: the suite
checks every (case, kernel) first and exits with status 2 and the reasons, before running anything.
A paged output further from dense than TOLERANCE allows (max |paged - dense| / max |dense|, per dtype)
is a mismatch: the suite reports it and exits with status 1.

    python -m benchmarks.gpu_suite [--out gpu_suite.json] [--kernels reference,triton,flash_attn]
                                   [--families dreamzero,hunyuan] [--layers 4] [--repeats 20] [--block-size 16]
    python -m benchmarks.gpu_suite --dry-run   # tiny shapes on CPU: reference kernel (+ triton under TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


import torch
import torch.nn.functional as F

from benchmarks._common import AllocationTracker, format_table, machine_info, summarize
from benchmarks._out import report_path
from paged_kv_compile.allocator import BuiltinAllocator
from paged_kv_compile.config import Bucket
from paged_kv_compile.errors import KernelUnavailableError
from paged_kv_compile.metadata import MetadataBuilder
from paged_kv_compile.ops import resolve_kernel
from paged_kv_compile.ops import write_attend as write_attend_module
from paged_kv_compile.ops.reference import write_kv
from paged_kv_compile.models.dreamzero import DREAMZERO_14B
from paged_kv_compile.models.hunyuan_image3 import HUNYUAN_IMAGE3
from paged_kv_compile.pool import KVPool
from paged_kv_compile.scheduler import Scheduler
from paged_kv_compile.families.dreamzero import DreamZeroSpec
from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec

EXIT_UNAVAILABLE = 2

#: Largest accepted max |paged - dense| / max |dense| per dtype. Both sides round their output to the dtype
#: (half an ulp: 2**-9 relative for bfloat16, 2**-12 for float16) and round probabilities differently inside;
#: the bounds leave about 4-10x headroom over that. A kernel that reads wrong keys moves the output by the
#: order of its own scale, far above them. float32 is the CPU dry run (the two sides agree to ~1e-6).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class DreamZeroGeometry:
    """Attention geometry of a DreamZero step; defaults are the real model's (DREAMZERO_14B)."""

    heads: int = DREAMZERO_14B.num_heads
    head_dim: int = DREAMZERO_14B.head_dim
    frame_seqlen: int = DREAMZERO_14B.frame_seqlen
    chunk_frames: int = DREAMZERO_14B.num_frame_per_block
    window_frames: int = DREAMZERO_14B.window_frames
    action_tokens: int = DREAMZERO_14B.action_register_length


@dataclass(frozen=True)
class HunyuanGeometry:
    """Attention geometry of a HunyuanImage-3 request; defaults are the real model's (HUNYUAN_IMAGE3)."""

    heads: int = HUNYUAN_IMAGE3.num_heads
    kv_heads: int = HUNYUAN_IMAGE3.num_kv_heads
    head_dim: int = HUNYUAN_IMAGE3.head_dim
    image_h: int = HUNYUAN_IMAGE3.image_h
    image_w: int = HUNYUAN_IMAGE3.image_w
    prompts: tuple[int, int] = (1000, 300)
    capacity: int = 1024

    @property
    def target_len(self) -> int:
        return self.image_h * self.image_w + 2


REAL = {"dreamzero": DreamZeroGeometry(), "hunyuan": HunyuanGeometry()}
DRY = {"dreamzero": DreamZeroGeometry(heads=2, head_dim=16, frame_seqlen=4, chunk_frames=2, window_frames=6,
                                      action_tokens=2),
       "hunyuan": HunyuanGeometry(heads=4, kv_heads=2, head_dim=16, image_h=2, image_w=2, prompts=(6, 3),
                                  capacity=8)}
DEFAULT_KERNELS = {"dreamzero": ("reference", "triton", "flash_attn"), "hunyuan": ("reference", "triton")}
NOT_APPLICABLE = {("hunyuan", "flash_attn"): "visibility 'general' (causal text + bidirectional image) is not "
                                             "expressible with flash-attn's paged API (full or causal only)"}


@dataclass
class Case:
    """One attention workload over `layers` layers: a dense baseline and the paged op per kernel."""

    name: str
    family: str
    visibility: str
    query: torch.Tensor
    pool: torch.Tensor
    dense: dict[str, Callable[[], list]] = field(default_factory=dict)
    paged: Callable[[str], Callable[[], list]] | None = None
    compare_rows: slice = field(default_factory=lambda: slice(None))  # query tokens compared (dim 1)
    persistent: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)


def _scheduler(layers, blocks, block, kv_heads, head_dim, scratch_tokens, dtype, device):
    pool = KVPool(layers, blocks, block, kv_heads, head_dim, scratch_rows=2,
                  scratch_blocks_per_row=-(-scratch_tokens // block) + 1, dtype=dtype, device=device)
    pool.tensor.normal_()
    return pool, Scheduler(pool, BuiltinAllocator(blocks), max_rows=2), MetadataBuilder(pool)


def _fill_history(pool: KVPool, meta, layer: int, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write k/v [h, H, D] at logical positions 0..h-1 of `row` through layer `layer`'s block table."""
    h = k.shape[0]
    if h == 0:
        return
    table = meta.layers[layer].block_table[row : row + 1].to(torch.int64)
    slots = pool.slots_for_positions(table, torch.arange(h, device=table.device).view(1, h))
    write_kv(pool.tensor, k.unsqueeze(0), v.unsqueeze(0), slots)


def _paged_runner(case_pool: KVPool, meta, q, k, v, layers: int, visibility: str):
    scale = q.shape[-1] ** -0.5

    def make(kernel: str) -> Callable[[], list]:
        def run() -> list:
            outs = []
            for l in range(layers):  # each layer's slots and table computed once, as the compiled graph does
                slots, table = meta.layers[l].tensors()
                outs.append(torch.ops.paged_kv.write_attend(q, k, v, case_pool.tensor, slots, table, meta.seq_lens,
                                                            meta.kv_visible_end, scale, kernel=kernel,
                                                            visibility=visibility))
            return outs
        return run

    return make


def dreamzero_case(g: DreamZeroGeometry, fill: str, layers: int, block: int, dtype, device) -> Case:
    F_, C, W, A = g.frame_seqlen, g.chunk_frames * g.frame_seqlen, g.window_frames * g.frame_seqlen, g.action_tokens
    per_window = g.window_frames // g.chunk_frames
    commits = {"chunk 1": 0, "half window": max(per_window // 2 - 1, 1), "full window": per_window}[fill]
    spec = DreamZeroSpec(frame_seqlen=F_, chunk_frames=g.chunk_frames, window_frames=g.window_frames,
                         action_tokens=A)
    blocks = 2 * -(-W // block)
    pool, sched, builder = _scheduler(layers, blocks, block, g.heads, g.head_dim, C + A, dtype, device)
    sched.admit("s", spec, rows=2)
    for _ in range(commits):
        sched.finish_forward(sched.plan("s", "commit"))
    plan = sched.plan("s", "denoise")
    meta = builder.build(Bucket(2, C + A, W), plan.rows, plan.key)
    sched.finish_forward(plan)
    h = plan.rows[0].seq_len - C - A  # history tokens visible to this chunk
    R, H, D = 2, g.heads, g.head_dim
    caches = [torch.randn(2, R, h, H, D, dtype=dtype, device=device) for _ in range(layers)]
    for l, cache in enumerate(caches):
        for r in range(R):
            _fill_history(pool, meta, l, r, cache[0, r], cache[1, r])
    q, k, v = (torch.randn(R, C + A, H, D, dtype=dtype, device=device) for _ in range(3))

    def dense(stack: bool) -> Callable[[], list]:
        def run() -> list:
            outs = []
            for cache in caches:
                new_k = torch.cat([cache[0], k[:, :C]], dim=1)[:, -W:]
                new_v = torch.cat([cache[1], v[:, :C]], dim=1)[:, -W:]
                kk, vv = torch.cat([new_k, k[:, C:]], dim=1), torch.cat([new_v, v[:, C:]], dim=1)
                outs.append(F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2),
                                                           vv.transpose(1, 2)).transpose(1, 2))
                if stack:
                    outs.append(torch.stack([new_k, new_v]))
            return outs[:: 2 if stack else 1]
        return run

    case = Case(f"dreamzero {fill}", "dreamzero", "full", q, pool.tensor,
                dense={"dense": dense(False), "dense+stack": dense(True)},
                paged=_paged_runner(pool, meta, q, k, v, layers, "full"))
    case.persistent = {"dense_caches": sum(c.numel() * c.element_size() for c in caches),
                       "pool": pool.nbytes, "metadata": meta.device_buffer.nbytes}
    case.info = {"history_tokens": h, "new_tokens_per_row": C + A, "keys_per_query": h + C + A, "block_size": block}
    return case


def hunyuan_case(g: HunyuanGeometry, phase: str, layers: int, block: int, dtype, device) -> Case:
    from paged_kv_compile.models.hunyuan_image3 import hunyuan_attention_mask, repeat_kv

    P, T, R = g.capacity, g.target_len, len(g.prompts)
    Hq, Hkv, D = g.heads, g.kv_heads, g.head_dim
    spec = HunyuanSpec(tuple(g.prompts), T, ((1, 1 + g.image_h * g.image_w),))
    blocks = sum(-(-p // block) for p in g.prompts)
    pool, sched, builder = _scheduler(layers, blocks, block, Hkv, D, T, dtype, device)
    sched.admit("r", spec)
    mask = spec.padded_mask(P)
    sched.finish_forward(sched.plan("r", "prefill", prefix_capacity=P, attention_mask=mask))
    plan = sched.plan("r", phase, prefix_capacity=P, attention_mask=mask if phase == "prefill" else None)
    tokens = P + T if phase == "prefill" else T
    meta = builder.build(Bucket(R, tokens, P), plan.rows, plan.key)
    sched.finish_forward(plan)
    mask, _ = hunyuan_attention_mask(list(g.prompts), P, g.image_h, g.image_w)
    mask = mask.to(device)
    if phase == "step":
        mask = mask[:, :, P:].contiguous()
    valid = (torch.arange(P)[None] < torch.tensor(g.prompts)[:, None]).to(device)
    caches = []
    for l in range(layers):
        ck = torch.randn(R, P, Hkv, D, dtype=dtype, device=device) * valid[:, :, None, None]
        cv = torch.randn(R, P, Hkv, D, dtype=dtype, device=device) * valid[:, :, None, None]
        caches.append((ck, cv))
        if phase == "step":
            for r, p in enumerate(g.prompts):
                _fill_history(pool, meta, l, r, ck[r, :p], cv[r, :p])
    q = torch.randn(R, tokens, Hq, D, dtype=dtype, device=device)
    k, v = (torch.randn(R, tokens, Hkv, D, dtype=dtype, device=device) for _ in range(2))
    if phase == "prefill":  # pad tokens of the prompt carry zeros, as the dense model's embeddings do
        pad = torch.cat([~valid, torch.zeros(R, T, dtype=torch.bool, device=device)], dim=1)
        k, v = k.masked_fill(pad[:, :, None, None], 0), v.masked_fill(pad[:, :, None, None], 0)

    def dense() -> list:
        outs = []
        for ck, cv in caches:
            if phase == "prefill":
                ck.copy_(torch.where(valid[:, :, None, None], k[:, :P], 0))
                cv.copy_(torch.where(valid[:, :, None, None], v[:, :P], 0))
                kk, vv = k, v
            else:
                kk, vv = torch.cat([ck, k], dim=1), torch.cat([cv, v], dim=1)
            kk, vv = repeat_kv(kk.transpose(1, 2), Hq // Hkv), repeat_kv(vv.transpose(1, 2), Hq // Hkv)
            outs.append(F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask,
                                                       scale=D**-0.5).transpose(1, 2))
        return outs

    case = Case(f"hunyuan {phase}", "hunyuan", "general", q, pool.tensor, dense={"dense": dense},
                paged=_paged_runner(pool, meta, q, k, v, layers, "general"),
                compare_rows=slice(P, None) if phase == "prefill" else slice(None))
    case.persistent = {"dense_caches": sum(2 * ck.numel() * ck.element_size() for ck, _ in caches),
                       "pool": pool.nbytes, "metadata": meta.device_buffer.nbytes}
    case.info = {"new_tokens_per_row": tokens, "keys_per_query": P + T, "prompts": list(g.prompts),
                 "block_size": block}
    return case


# ---- measurement ----------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _peak_bytes(fn: Callable, device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base, "torch.cuda.max_memory_allocated"
    with AllocationTracker() as tracker:
        fn()
    return tracker.peak_bytes, "torch.profiler CPU allocations (dry run)"


def _graphed(fn: Callable, device: torch.device) -> tuple[Callable, str]:
    """A CUDA graph of `fn` (captured after warm-up on a side stream) and its replay; on CPU, `fn` itself."""
    if device.type != "cuda":
        return fn, "emulated: no CUDA on this machine, the eager call stands in for the replay"
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay, "cuda graph replay"


def _max_diff(a: list, b: list, rows: slice) -> float:
    return max(float((x[:, rows].float() - y[:, rows].float()).abs().max()) for x, y in zip(a, b))


def _max_abs(a: list, rows: slice) -> float:
    return max(float(x[:, rows].float().abs().max()) for x in a)


def run_case(case: Case, kernels: list[str], repeats: int, device: torch.device) -> dict:
    variants: dict[str, Callable] = dict(case.dense)
    for kernel in kernels:
        variants[f"paged:{kernel}"] = case.paged(kernel)
    reference = case.dense["dense"]()
    scale = max(_max_abs(reference, case.compare_rows), 1e-30)
    tolerance = TOLERANCE[case.query.dtype]
    out = {"case": case.name, "family": case.family, "visibility": case.visibility, **case.info,
           "persistent_bytes": case.persistent, "dense_max_abs": scale, "tolerance_rel": tolerance,
           "variants": {}, "errors": {}, "mismatches": {}}
    runners: dict[str, Callable] = {}
    for name, fn in variants.items():
        try:
            result = fn()  # warm-up (Triton JIT, cuDNN/flash plans)
            _sync(device)
            diff = _max_diff(result, reference, case.compare_rows) if name.startswith("paged") else 0.0
            peak, peak_source = _peak_bytes(fn, device)
            replay, graph_mode = _graphed(fn, device)
            runners[f"{name} eager"], runners[f"{name} graph"] = fn, replay
            out["variants"][name] = {"max_abs_diff_vs_dense": diff, "rel_diff_vs_dense": diff / scale,
                                     "transient_peak_bytes": peak, "memory_source": peak_source,
                                     "graph_mode": graph_mode}
            if not diff / scale <= tolerance:  # also catches NaN
                out["mismatches"][name] = (f"max |paged - dense| = {diff:.3g} is {diff / scale:.3g} of max |dense| "
                                           f"= {scale:.3g}, above the {case.query.dtype} tolerance {tolerance:g}")
        except Exception as e:  # recorded, reported, and turned into a failing exit status by main()
            out["errors"][name] = f"{type(e).__name__}: {e}"
    times: dict[str, list[float]] = {k: [] for k in runners}
    names = list(runners)
    for rep in range(repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            times[name].append(_time_ms(runners[name], device))
    base = times.get("dense eager")
    for name, ts in times.items():
        variant, mode = name.rsplit(" ", 1)
        entry = out["variants"][variant]
        entry[f"{mode}_ms"] = round(statistics.median(ts), 4)
        if base:
            entry[f"{mode}_ratio_vs_dense_eager"] = summarize([t / b for t, b in zip(ts, base)])
    return out


VISIBILITY = {"dreamzero": "full", "hunyuan": "general"}


def check_kernels(families: list[str], kernels_of: dict[str, list[str]], geometry: dict, block: int, dtype,
                  device: torch.device) -> list[str]:
    """Every requested (family, kernel) that cannot run, with the reason (resolve_kernel's message).

    Checked on small stand-in tensors of the cases' device, dtype, head geometry and block size, before
    any case allocates its caches and pool.
    """
    problems = []
    for family in families:
        g = geometry[family]
        kv_heads = getattr(g, "kv_heads", g.heads)
        query = torch.empty(1, 1, g.heads, g.head_dim, dtype=dtype, device=device)
        pool = torch.empty(2, 1, block, kv_heads, g.head_dim, dtype=dtype, device=device)
        for kernel in kernels_of[family]:
            try:
                resolve_kernel(kernel, query, pool, VISIBILITY[family])
            except KernelUnavailableError as e:
                problems.append(f"{family}: kernel {kernel!r} is unavailable: {e}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on CPU (reference kernel; triton too when TRITON_INTERPRET=1)")
    parser.add_argument("--out", default=None, help="JSON output (default gpu_suite.json; a dry run: a temporary folder)")
    parser.add_argument("--kernels", default=None,
                        help="comma-separated paged kernels for every family (default: reference,triton,flash_attn "
                             "for DreamZero, reference,triton for HunyuanImage-3; dry run: reference[,triton])")
    parser.add_argument("--families", default="dreamzero,hunyuan")
    parser.add_argument("--layers", type=int, default=None, help="attention layers per case (default 4; dry run 2)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 20; dry run 2)")
    parser.add_argument("--block-size", type=int, default=None, help="pool block size (default 16; dry run 4)")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    args = parser.parse_args(argv)

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_suite: no CUDA device here. This suite measures GPU kernels; run it on a GPU machine, or use "
              "--dry-run for the tiny CPU smoke mode.", file=sys.stderr)
        return EXIT_UNAVAILABLE
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    layers = args.layers or (2 if dry else 4)
    repeats = args.repeats or (2 if dry else 20)
    block = args.block_size or (4 if dry else 16)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = set(families) - set(REAL)
    if unknown:
        print(f"gpu_suite: unknown families {sorted(unknown)}; choose from {sorted(REAL)}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    geometry = DRY if dry else REAL
    if args.kernels:
        explicit = [k.strip() for k in args.kernels.split(",") if k.strip()]
        kernels_of = {f: explicit for f in families}
    elif dry:
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        kernels_of = {f: ["reference"] + (["triton"] if interp else []) for f in families}
    else:
        kernels_of = {f: list(DEFAULT_KERNELS[f]) for f in families}
    not_run = {f"{f} / {k}": why for (f, k), why in NOT_APPLICABLE.items()
               if not dry and f in families and k not in kernels_of[f]}

    problems = check_kernels(families, kernels_of, geometry, block, dtype, device)
    if problems:
        print("gpu_suite: refusing to run, requested kernels are unavailable:\n  " + "\n  ".join(problems)
              + "\nInstall what is missing, or choose kernels with --kernels (e.g. --kernels reference,triton).",
              file=sys.stderr)
        return EXIT_UNAVAILABLE

    torch.manual_seed(0)
    old_check = write_attend_module.CHECK_VALUES
    write_attend_module.CHECK_VALUES = False  # a CPU debug aid; it would sync and is off on GPUs anyway
    t0 = time.perf_counter()
    results = []
    try:
        with torch.no_grad():
            builders = []
            if "dreamzero" in families:
                builders += [(dreamzero_case, geometry["dreamzero"], fill)
                             for fill in ("chunk 1", "half window", "full window")]
            if "hunyuan" in families:
                builders += [(hunyuan_case, geometry["hunyuan"], phase) for phase in ("prefill", "step")]
            for build, g, which in builders:  # one case alive at a time
                case = build(g, which, layers, block, dtype, device)
                results.append(run_case(case, kernels_of[case.family], repeats, device))
                del case
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        write_attend_module.CHECK_VALUES = old_check
    report = {
        "benchmark": "gpu_suite", "dry_run": dry, "device": torch.cuda.get_device_name(device) if not dry else "cpu",
        "machine": machine_info(), "dtype": str(dtype).replace("torch.", ""), "layers": layers, "repeats": repeats,
        "block_size": block, "kernels": kernels_of, "not_run": not_run, "cases": results,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out = report_path("gpu_suite", dry, args.out)
    out.write_text(json.dumps(report, indent=1))
    errors = {f"{c['case']} / {v}": e for c in results for v, e in c["errors"].items()}
    mismatches = {f"{c['case']} / {v}": e for c in results for v, e in c["mismatches"].items()}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"gpu suite on {report['device']} ({report['dtype']}, {layers} layers, {repeats} repeats, "
              f"block {block}, {report['seconds']} s){' DRY RUN' if dry else ''}; JSON: {out}")
        print(format_table(table_rows(report), COLUMNS))
        for k, why in not_run.items():
            print(f"not run: {k}: {why}")
    if errors:
        print("gpu_suite: variants failed:\n  " + "\n  ".join(f"{k}: {e}" for k, e in errors.items()), file=sys.stderr)
    if mismatches:
        print("gpu_suite: paged output differs from dense:\n  "
              + "\n  ".join(f"{k}: {e}" for k, e in mismatches.items()), file=sys.stderr)
    return 1 if errors or mismatches else 0


COLUMNS = [("case", "case"), ("variant", "variant"), ("eager ms", "eager_ms"), ("graph ms", "graph_ms"),
           ("eager / dense", "er"), ("graph / dense eager", "gr"), ("transient peak MiB", "peak"),
           ("persistent KV MiB", "persist"), ("max |diff|", "diff")]


def table_rows(report: dict) -> list[dict]:
    rows = []
    for c in report["cases"]:
        p = c["persistent_bytes"]
        for name, v in c["variants"].items():
            persist = p["dense_caches"] if name.startswith("dense") else p["pool"] + p["metadata"]
            rows.append({
                "case": c["case"], "variant": name, "eager_ms": v.get("eager_ms", "-"), "graph_ms": v.get("graph_ms", "-"),
                "er": _ratio(v.get("eager_ratio_vs_dense_eager")), "gr": _ratio(v.get("graph_ratio_vs_dense_eager")),
                "peak": f"{v['transient_peak_bytes'] / 2**20:.1f}", "persist": f"{persist / 2**20:.1f}",
                "diff": f"{v['max_abs_diff_vs_dense']:.1e}",
            })
        for name, e in c["errors"].items():
            rows.append({"case": c["case"], "variant": name, "eager_ms": "FAILED", "diff": e[:60]})
    return rows


def _ratio(s: dict | None) -> str:
    return "-" if not s else f"{s['median']:.3f} [{s['q1']:.3f}-{s['q3']:.3f}]"


if __name__ == "__main__":
    raise SystemExit(main())
