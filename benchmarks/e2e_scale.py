"""Whole forwards at real sizes: DreamZero-14B and HunyuanImage-3, paged vs dense, both compiled and captured.

Random weights are made on the device (built on the meta device, then initialized there: no checkpoint is read,
no host copy of the weights is made). Both families run through their block stacks the way their pipelines
drive them, with the same inputs for every variant, variants interleaved per repeat:

  * DreamZero-14B (`DREAMZERO_14B`: 40 blocks, dim 5120, 40 heads x 128, 880 tokens per frame, 2-frame chunks plus
    33 registers, 2 CFG rows): per chunk a commit of the previous chunk, then `--steps` denoising forwards, through
    a window fill and a reset (`--window-reset-frames`, by default 8 instead of the real 20 to fit the time
    budget: the dense side compiles one graph per cache length). Cross-attention K/V: dense per layer on the
    dense side, in the pool's shared regions on the paged side.
  * HunyuanImage-3 at its real attention geometry (32 heads, 8 KV heads x 128, 1024x1024 = 4096 image tokens,
    prompts of 1000 and 300 tokens padded to 1024, 2 CFG rows): a prefill, then `--steps` denoising steps. The
    released MoE (64 experts, top-8 plus one shared expert, each 3072 wide) is replaced by a dense SwiGLU MLP of
    the same active width, 9 x 3072 = 27648; `--hunyuan-layers` of its 32 layers (default: all).

Variants (per family): `dense` -- the blocks compiled with Inductor (regional, dynamic=False: one dynamo graph
per shape, so per cache length; the count is reported) and the whole block stack captured as one CUDA graph per
forward shape, its caches in fixed buffers (no copies); `paged/block` -- the blocks compiled with the paged_kv
backend and captured one CUDA graph per block (`CapturedBlocks`); `paged/forward` -- the same compiled blocks
captured as one graph per forward (`granularity="forward"`). The embeddings and the head run eagerly, the same
code on every side.

Reported in one run: ms per chunk (DreamZero), ms per prefill and per step (HunyuanImage-3), every paged/dense
ratio per repeat, peak memory above what each side holds, host time per forward (plan + metadata + launches,
measured without synchronizing) and its share of the forward's GPU time, graph launches per forward, compile and
capture seconds, and max |paged - dense| over every forward with the per-dtype bound of gpu_suite.

    python -m benchmarks.e2e_scale [--families dreamzero,hunyuan] [--repeats 3] [--steps 2] [--out e2e_scale.json]
    python -m benchmarks.e2e_scale --dry-run   # tiny sizes on the CPU: aot_eager, graphs emulated (dense) and
                                               # replayed without Python (paged); runs in CI
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import format_table, machine_info, summarize  # noqa: E402
from benchmarks._out import report_path  # noqa: E402
from benchmarks.gpu_suite import TOLERANCE  # noqa: E402
from paged_kv_compile import families  # noqa: E402
from paged_kv_compile.backend import paged_kv_backend  # noqa: E402
from paged_kv_compile.capture import CapturedBlocks, CompiledOnlyGraphs, CudaGraphs, EmulatedGraphs  # noqa: E402
from paged_kv_compile.capture.report import unique_graphs  # noqa: E402
from paged_kv_compile.families.dreamzero import (  # noqa: E402
    DreamZeroSpec,
    dreamzero_block_inputs,
    dreamzero_buckets,
    dreamzero_runtime_config,
)
from paged_kv_compile.families.hunyuan_image3 import (  # noqa: E402
    hunyuan_buckets,
    hunyuan_layer_inputs,
    hunyuan_runtime_config,
    hunyuan_spec,
)
from paged_kv_compile.models.common import residual_scale, sinusoidal_embedding  # noqa: E402
from paged_kv_compile.models.dreamzero import DREAMZERO_14B, DreamZeroConfig, DreamZeroModel  # noqa: E402
from paged_kv_compile.models.hunyuan_image3 import (  # noqa: E402
    HUNYUAN_IMAGE3,
    HunyuanImage3Config,
    HunyuanImage3Model,
)
from paged_kv_compile.ops import write_attend as write_attend_module  # noqa: E402
from paged_kv_compile.runtime import PagedKVRuntime  # noqa: E402

EXIT_UNAVAILABLE = 2
MOE_ACTIVE_EXPERTS, MOE_EXPERT_WIDTH = 8 + 1, 3072  # HunyuanImage-3.0: top-8 routed + 1 shared expert, each 3072
VARIANTS = ("dense", "paged/block", "paged/forward")
PAGED = {"paged/block": "block", "paged/forward": "forward"}

DRY_DREAMZERO = DreamZeroConfig(num_layers=2, dim=32, num_heads=2, head_dim=16, ffn_dim=64, frame_seqlen=8,
                                local_attn_size=-1, window_reset_frames=4, action_register_length=3, text_len=4,
                                text_dim=16, image_len=2, image_dim=16, in_channels=4, action_dim=4, freq_dim=16)
DRY_HUNYUAN = HunyuanImage3Config(num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate=64,
                                  image_h=2, image_w=2)
PROMPTS = {"real": ((1000, 300), 1024), "dry": ((6, 3), 8)}  # prompt lengths of the 2 CFG rows, prefix capacity


# ---- models with random weights made on the device --------------------------------------------------------


def random_model(build: Callable[[], torch.nn.Module], device: torch.device, dtype: torch.dtype, seed: int,
                 residual_names: tuple[str, ...], num_layers: int) -> torch.nn.Module:
    """`build()` on the meta device, then every parameter drawn on `device` (the models' own init rule: weights
    N(0, 1/sqrt(fan_in)), residual writes scaled down, biases 0, norms 1)."""
    with torch.device("meta"):
        model = build().to(dtype)  # cast while nothing is allocated: no float32 copy on the device
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    scale = residual_scale(num_layers)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "norm" in name and p.dim() == 1:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = p.shape[-1] ** -0.5 * (scale if any(r in name for r in residual_names) else 1.0)
                p.normal_(0.0, std, generator=gen)
    return model.eval()


def compile_blocks(blocks, inner: str, kernel: str | None = None) -> torch.nn.ModuleList:
    """Regional compilation (fullgraph, static shapes) of each block with `inner` (dense), or with the paged_kv
    backend and `kernel` handing the graph to `inner`; the compiled wrappers share the blocks' weights."""
    if kernel is None:
        backend = inner
    else:
        def backend(gm, example_inputs):
            return paged_kv_backend(gm, example_inputs, options={"inner_compiler": inner, "kernel": kernel})
    return torch.nn.ModuleList(torch.compile(b, backend=backend, fullgraph=True, dynamic=False) for b in blocks)


# ---- the dense side: one graph per forward shape over the whole stack ----------------------------------------


class DenseStack:
    """Dense blocks run as a stack; with `graphs`, one captured graph per key (forward kind and shape).

    `region(key)` runs the stack on the static inputs and returns (leaves, targets): the graph ends by copying
    each leaf into its target (the output hidden states; the caches a commit writes, in the buffers the next
    forwards read). The caches live in fixed buffers: nothing is copied in but the static inputs."""

    def __init__(self, region: Callable[[Any], tuple[list, list]], statics: dict[str, torch.Tensor], graphs) -> None:
        self.region, self.statics, self.graphs = region, statics, graphs
        self.targets: dict[Any, list] = {}
        self.captured: dict[Any, Any] = {}
        self.launches = 0

    def _run(self, key) -> None:
        leaves, targets = self.region(key)
        self.targets[key] = targets
        for target, leaf in zip(targets, leaves):
            target.copy_(leaf)

    def prepare(self, keys) -> tuple[int, float, float]:
        """Compile every key (dynamo graphs made, seconds), then capture each (seconds)."""
        t0, g0 = time.perf_counter(), unique_graphs()
        for key in keys:
            self._run(key)
        graphs, compile_s = unique_graphs() - g0, time.perf_counter() - t0
        t0 = time.perf_counter()
        for key in keys if self.graphs is not None else ():
            self.graphs.warm(lambda key=key: self._run(key), 2)
            self.captured[key], _ = self.graphs.capture(lambda key=key: self.region(key)[0], self.targets[key],
                                                        list(self.statics.values()))
        self.graphs is not None and self.graphs.synchronize()
        return graphs, compile_s, time.perf_counter() - t0

    def run(self, key, **inputs: torch.Tensor) -> None:
        """Copy the inputs in, then replay the key's graph (or run the stack without graphs)."""
        for name, value in inputs.items():
            self.statics[name].copy_(value)
        if key in self.captured:
            self.captured[key].replay()
        else:
            self._run(key)
        self.launches += 1


# ---- timing ----------------------------------------------------------------------------------------------------


class Clock:
    """Marks on the GPU stream (CUDA events, read after a run) or, on a CPU, the wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _peak(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, int | None]:
    """fn()'s result and the most memory allocated above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


# ---- driving and measuring ------------------------------------------------------------------------------------


@dataclass
class Workload:
    """One family's forwards, the same inputs on every side: forward i is `kinds[i]` of group `groups[i]` (a
    DreamZero chunk). `dense(i)` runs it densely; `paged(owner, i)` inside the runtime's forward for `owner`,
    which `admit`/`release` bracket; `before(owner, i)` runs between forwards (a window reset)."""

    kinds: list[str]
    groups: list[int]
    dense: Callable[[int], Any]
    paged: Callable[[str, int], Any]
    admit: Callable[[str], None]
    release: Callable[[str], None]
    before: Callable[[str, int], None] = lambda owner, i: None


def run_variant(work: Workload, variant: str, rep: int, captured: dict, dense: DenseStack, clock: Clock) -> dict:
    """Every forward of `work` once through `variant`; GPU ms and host ms per forward, ms per group, launches."""
    owner = f"{variant}-{rep}"  # ids are single-use: warm-up runs count down from -1
    paged = variant != "dense"
    launches = (lambda: captured[variant].stats["replays"]) if paged else (lambda: dense.launches)
    if paged:
        work.admit(owner)
        captured[variant].install()
    first, marks, host, outputs = launches(), [], [], []
    try:
        with torch.no_grad():
            for i in range(len(work.kinds)):
                if paged:
                    work.before(owner, i)
                start, t0 = clock.mark(), time.perf_counter()
                out = work.paged(owner, i) if paged else work.dense(i)
                host.append((time.perf_counter() - t0) * 1e3)
                marks.append((start, clock.mark()))
                outputs.append(out)
        clock.sync()
    finally:
        if paged:
            captured[variant].uninstall()
            work.release(owner)
    groups: dict[int, list] = {}
    for g, (a, b) in zip(work.groups, marks):
        groups.setdefault(g, [a, b])[1] = b
    return {"kinds": work.kinds, "forward_ms": [clock.ms(a, b) for a, b in marks], "host_ms": host,
            "group_ms": [clock.ms(a, b) for a, b in groups.values()],
            "launches_per_forward": (launches() - first) / len(work.kinds), "outputs": outputs}


def measure(work: Workload, captured: dict, dense: DenseStack, repeats: int, device: torch.device,
            warmup_runs: int) -> dict:
    """Every variant once per repeat, the order rotating, after `warmup_runs` untimed runs of each; peak memory
    and outputs from the first timed repeat."""
    clock = Clock(device)
    for rep in range(warmup_runs):
        for variant in VARIANTS:
            run_variant(work, variant, -1 - rep, captured, dense, clock)
    per: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    peaks: dict[str, int | None] = {}
    for rep in range(repeats):
        for variant in VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)]:
            rec, peak = _peak(device, lambda: run_variant(work, variant, rep, captured, dense, clock))
            if rep:
                rec.pop("outputs")
            else:
                peaks[variant] = peak
            per[variant].append(rec)
    return {"per_repeat": per, "peaks": peaks}


def warm_paged(blocks: torch.nn.ModuleList, runtime, inputs: Callable, dry: bool) -> tuple[dict, dict]:
    """CapturedBlocks of both granularities over the same compiled blocks, warmed up (compiled and captured)."""
    captured, warm = {}, {}
    for variant, granularity in PAGED.items():
        t0, g0 = time.perf_counter(), unique_graphs()
        with torch.no_grad():
            captured[variant] = CapturedBlocks(blocks, runtime, inputs, graphs=CompiledOnlyGraphs() if dry else
                                               CudaGraphs(), granularity=granularity)
            report = captured[variant].warmup(progress=False)
        warm[variant] = {"seconds": round(time.perf_counter() - t0, 2), "dynamo_graphs": unique_graphs() - g0,
                         "graphs_captured": sum(b.cuda_graphs for b in report.buckets),
                         "compile_s": round(sum(b.compile_s for b in report.buckets), 2),
                         "capture_s": round(sum(b.capture_s for b in report.buckets), 2)}
    return captured, warm


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---- DreamZero ------------------------------------------------------------------------------------------------


def dreamzero_schedule(cfg: DreamZeroConfig, chunks: int, steps: int) -> list[tuple[str, int, int, bool]]:
    """(kind, chunk, start_frame, reset_before) of every forward, as `dreamzero_steps` drives them: a commit of the
    previous chunk, then the denoising steps; the window resets once the start frame reaches window_reset_frames."""
    out, start, previous, reset = [], 0, None, False
    for chunk in range(chunks):
        if previous is not None:
            out.append(("commit", chunk, previous, False))
        out += [("denoise", chunk, start, reset and i == 0) for i in range(steps)]
        previous, start, reset = start, start + cfg.num_frame_per_block, False
        if start >= cfg.window_reset_frames:
            start, previous, reset = 0, None, True
    return out


def run_dreamzero(args, device: torch.device, dtype: torch.dtype, dry: bool) -> dict:
    cfg = DRY_DREAMZERO if dry else dataclasses.replace(DREAMZERO_14B, window_reset_frames=args.window_reset_frames,
                                                        num_layers=args.dreamzero_layers or DREAMZERO_14B.num_layers)
    inner, kernel = ("aot_eager", "reference") if dry else ("inductor", args.kernel)
    t0 = time.perf_counter()
    model = random_model(lambda: DreamZeroModel(cfg), device, dtype, 1, ("self_attn.o.", "cross_attn.o.", "ffn.2."),
                         cfg.num_layers)
    build_s = time.perf_counter() - t0
    chunks = args.chunks or cfg.chunks_per_window + 1
    schedule = dreamzero_schedule(cfg, chunks, args.steps)
    R, L, A, F_ = 2, cfg.chunk_tokens, cfg.action_register_length, cfg.frame_seqlen
    gen = torch.Generator(device=device).manual_seed(7)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    inputs = [(rand(R, L, cfg.in_channels), rand(R, A, cfg.action_dim),
               torch.full((R,), 1000.0 if kind == "denoise" else 0.0, device=device)) for kind, *_ in schedule]
    with torch.no_grad():
        cross = model.prepare_cross_kv(rand(R, cfg.text_len, cfg.text_dim),
                                       rand(R, cfg.image_len, cfg.image_dim) if cfg.image_len else None)
    rope = {start: model.rope_tables(start, cfg.num_frame_per_block, device) for _, _, start, _ in schedule}

    def cache_frames(start: int) -> int:  # the dense cache's length when a forward at `start` runs
        return min(start, cfg.window_frames)

    def embed(i: int):
        latents, actions, t = inputs[i]
        x = torch.cat([model.patch_embed(latents), model.action_embed(actions)], dim=1)
        e0 = model.time_embedding(sinusoidal_embedding(t, cfg.freq_dim).to(x.dtype))
        return x, model.time_projection(e0).unflatten(1, (6, cfg.dim)), e0

    # dense: one compiled graph per cache length, one captured stack per (kind, cache length)
    dense_blocks = compile_blocks(model.blocks, inner)
    longest = max(cache_frames(start) for _, _, start, _ in schedule) + cfg.num_frame_per_block
    caches = [torch.zeros(2, R, longest * F_, cfg.num_heads, cfg.head_dim, device=device, dtype=dtype) for _ in cross]
    statics = {"x": torch.zeros(R, L + A, cfg.dim, device=device, dtype=dtype),
               "e": torch.zeros(R, 6, cfg.dim, device=device, dtype=dtype),
               "cos": torch.zeros_like(rope[0][0]), "sin": torch.zeros_like(rope[0][1])}
    dense_out = torch.zeros_like(statics["x"])

    def dense_region(key):
        kind, frames = key
        x, news = statics["x"], []
        for block, cache, cross_kv in zip(dense_blocks, caches, cross):
            x, new = block(x, statics["e"], statics["cos"], statics["sin"], cache[:, :, :frames * F_], cross_kv)
            news.append(new)
        if kind != "commit":
            return [x], [dense_out]
        kept = min(frames * F_ + L, cfg.max_attention_size)  # the new caches, in the buffers later forwards read
        return [x, *news], [dense_out, *(cache[:, :, :kept] for cache in caches)]

    dense = DenseStack(dense_region, statics, EmulatedGraphs() if dry else CudaGraphs())
    keys = list(dict.fromkeys((kind, cache_frames(start)) for kind, _, start, _ in schedule))
    with torch.no_grad():
        dense_graphs, dense_compile_s, dense_capture_s = dense.prepare(keys)

    def dense_forward(i: int):
        kind, _, start, _ = schedule[i]
        x, e, e0 = embed(i)
        dense.run((kind, cache_frames(start)), x=x, e=e, cos=rope[start][0], sin=rope[start][1])
        return model.head(dense_out, e0)

    # paged: the same weights compiled with the paged_kv backend, captured per block and per forward
    runtime = PagedKVRuntime(dreamzero_runtime_config(
        cfg, block_size=args.block_size or F_, cross_regions=2, kernel=kernel, inner_compiler=inner,
        buckets=dreamzero_buckets(cfg), device=device, dtype=dtype))
    paged_blocks = compile_blocks(model.blocks, inner, kernel)
    runtime.bind(paged_blocks)
    captured, warm = warm_paged(paged_blocks, runtime, lambda b: dreamzero_block_inputs(model, runtime, b), dry)
    standin = families.for_model(model).standin_caches(runtime, model, R)[0]
    regions = families.for_model(model).region_standins(runtime, model, R)[0]

    def paged_forward(owner: str, i: int):
        kind, _, start, _ = schedule[i]
        x, e, e0 = embed(i)
        with runtime.forward(owner, kind):
            for block in paged_blocks:
                x, _ = block(x, e, rope[start][0], rope[start][1], standin, regions)
        return model.head(x, e0)

    work = Workload(
        [k for k, *_ in schedule], [c for _, c, _, _ in schedule], dense_forward, paged_forward,
        admit=lambda owner: runtime.admit(owner, DreamZeroSpec.from_model_config(cfg), R, cross_kv=cross,
                                          content_keys=[b"e2e cond", b"e2e uncond"]),  # no digest of 40 layers' bytes
        release=runtime.release, before=lambda owner, i: schedule[i][3] and runtime.reset(owner))
    measured = measure(work, captured, dense, args.repeats, device, args.warmup_runs)
    out = report_family("dreamzero", measured, dtype, warm, {"block": cfg.num_layers, "forward": 1})
    out.update({
        "config": {"layers": cfg.num_layers, "dim": cfg.dim, "heads": cfg.num_heads, "head_dim": cfg.head_dim,
                   "frame_tokens": F_, "chunk_frames": cfg.num_frame_per_block, "registers": A,
                   "window_frames": cfg.window_frames, "window_reset_frames": cfg.window_reset_frames,
                   "cfg_rows": R, "dtype": str(dtype).replace("torch.", "")},
        "schedule": {"chunks": chunks, "denoise_steps_per_chunk": args.steps, "forwards": len(schedule),
                     "commits": sum(k == "commit" for k, *_ in schedule),
                     "resets": sum(r for *_, r in schedule)},
        "dense_compile": {"dynamo_graphs": dense_graphs, "cache_lengths_frames": sorted({f for _, f in keys}),
                          "captured_stack_graphs": len(dense.captured), "compile_s": round(dense_compile_s, 2),
                          "capture_s": round(dense_capture_s, 2)},
        "build_s": round(build_s, 2), "block_size": runtime.pool.block_size,
        "persistent_bytes": {"dense_caches": _nbytes(caches), "dense_cross_kv": _nbytes(cross),
                             "pool": runtime.pool.nbytes,
                             **{f"{v} static": captured[v].static_bytes() for v in PAGED}},
    })
    runtime.close()
    return out


# ---- HunyuanImage-3 ---------------------------------------------------------------------------------------------


def run_hunyuan(args, device: torch.device, dtype: torch.dtype, dry: bool) -> dict:
    cfg = DRY_HUNYUAN if dry else dataclasses.replace(
        HUNYUAN_IMAGE3, intermediate=MOE_ACTIVE_EXPERTS * MOE_EXPERT_WIDTH, num_layers=args.hunyuan_layers)
    inner, kernel = ("aot_eager", "reference") if dry else ("inductor", args.kernel)
    lens, P = PROMPTS["dry" if dry else "real"]
    t0 = time.perf_counter()
    model = random_model(lambda: HunyuanImage3Model(cfg), device, dtype, 2, ("o_proj", "down_proj"), cfg.num_layers)
    build_s = time.perf_counter() - t0
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in lens]
    with torch.no_grad():
        req = model.build_request(prompts, P)
    R, T = len(lens), cfg.target_len
    kinds = ["prefill"] + ["step"] * args.steps
    gen = torch.Generator(device=device).manual_seed(11)
    latents = [torch.randn(R, cfg.image_tokens, cfg.latent_channels, generator=gen, device=device, dtype=dtype)
               for _ in kinds]
    timesteps = [torch.full((R,), 1000.0 * (1 - i / len(kinds)), device=device) for i in range(len(kinds))]
    tables = {"prefill": (req.rope_cos, req.rope_sin, req.attention_mask),
              "step": (req.step_rope_cos, req.step_rope_sin, req.step_attention_mask)}

    def embed(i: int) -> torch.Tensor:
        target = model.embed_target(latents[i], timesteps[i])
        return torch.cat([req.prefix_embeds, target], dim=1) if kinds[i] == "prefill" else target

    def velocity(i: int, h: torch.Tensor) -> torch.Tensor:
        return model.velocity(model.norm(h[:, P:] if kinds[i] == "prefill" else h))

    # dense: one compiled graph and one captured stack per phase; its prefix caches written in place
    dense_layers = compile_blocks(model.layers, inner)
    dense_caches = model.dense_caches(R, P)
    statics = {"prefill": torch.zeros(R, P + T, cfg.hidden, device=device, dtype=dtype),
               "step": torch.zeros(R, T, cfg.hidden, device=device, dtype=dtype)}
    outs = {k: torch.zeros_like(v) for k, v in statics.items()}

    def dense_region(phase: str):
        h = statics[phase]
        for layer, cache in zip(dense_layers, dense_caches):
            h = layer(h, *tables[phase], cache, req.prefix_valid, phase)
        return [h], [outs[phase]]

    dense = DenseStack(dense_region, statics, EmulatedGraphs() if dry else CudaGraphs())
    with torch.no_grad():
        dense_graphs, dense_compile_s, dense_capture_s = dense.prepare(["prefill", "step"])

    def dense_forward(i: int):
        dense.run(kinds[i], **{kinds[i]: embed(i)})
        return velocity(i, outs[kinds[i]])

    runtime = PagedKVRuntime(hunyuan_runtime_config(
        cfg, max_prefix=P, block_size=args.block_size or 16, kernel=kernel, inner_compiler=inner,
        buckets=hunyuan_buckets(cfg, [P], rows=(R,)), device=device, dtype=dtype))
    paged_layers = compile_blocks(model.layers, inner, kernel)
    runtime.bind(paged_layers)
    captured, warm = warm_paged(paged_layers, runtime, lambda b: hunyuan_layer_inputs(model, runtime, b), dry)
    standins = families.for_model(model).standin_caches(runtime, model, R, prefix_capacity=P)

    def paged_forward(owner: str, i: int):
        h, phase = embed(i), kinds[i]
        with runtime.forward(owner, phase, prefix_capacity=P,
                              attention_mask=req.attention_mask if phase == "prefill" else None):
            for layer, cache in zip(paged_layers, standins):
                h = layer(h, *tables[phase], cache, req.prefix_valid, phase)
        return velocity(i, h)

    work = Workload(kinds, list(range(len(kinds))), dense_forward, paged_forward,
                    admit=lambda owner: runtime.admit(owner, hunyuan_spec(cfg, prompts)),
                    release=runtime.release)
    measured = measure(work, captured, dense, args.repeats, device, args.warmup_runs)
    out = report_family("hunyuan", measured, dtype, warm, {"block": cfg.num_layers, "forward": 1})
    out.update({
        "config": {"layers": cfg.num_layers, "of_real_layers": HUNYUAN_IMAGE3.num_layers, "hidden": cfg.hidden,
                   "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                   "image_tokens": cfg.image_tokens, "target_tokens": T, "prompts": list(lens), "prefix_capacity": P,
                   "cfg_rows": R, "dtype": str(dtype).replace("torch.", ""),
                   "mlp": (f"a dense SwiGLU {cfg.intermediate} wide replaces the MoE (top-8 of 64 experts + 1 shared "
                           f"expert, each {MOE_EXPERT_WIDTH} wide: the same active width)" if not dry else
                           f"a dense SwiGLU {cfg.intermediate} wide (dry run)")},
        "schedule": {"prefills": 1, "steps": args.steps},
        "dense_compile": {"dynamo_graphs": dense_graphs, "captured_stack_graphs": len(dense.captured),
                          "compile_s": round(dense_compile_s, 2), "capture_s": round(dense_capture_s, 2)},
        "build_s": round(build_s, 2), "block_size": runtime.pool.block_size,
        "persistent_bytes": {"dense_caches": _nbytes(t for c in dense_caches for t in (c.cached_key, c.cached_value)),
                             "pool": runtime.pool.nbytes,
                             **{f"{v} static": captured[v].static_bytes() for v in PAGED}},
    })
    runtime.close()
    return out


# ---- reporting ------------------------------------------------------------------------------------------------------


def _leaves(value) -> list[torch.Tensor]:
    return [t for t in (value if isinstance(value, (tuple, list)) else [value])]


def report_family(family: str, result: dict, dtype: torch.dtype, warm: dict, launches: dict[str, int]) -> dict:
    """Per variant: ms per forward kind (and per chunk), host ms and share, launches, peak, paged/dense ratios
    per repeat, max |paged - dense| over every forward; anything out of bounds is a problem."""
    per = result["per_repeat"]
    tolerance = TOLERANCE[dtype]
    dense_out = per["dense"][0]["outputs"]
    scale = max(float(t.float().abs().max()) for out in dense_out for t in _leaves(out)) or 1e-30
    variants, problems = {}, []
    for variant in VARIANTS:
        recs = per[variant]
        kinds = recs[0]["kinds"]
        entry: dict[str, Any] = {"launches_per_forward": recs[0]["launches_per_forward"],
                                 "peak_bytes_above_held": result["peaks"].get(variant)}
        for kind in sorted(set(kinds)):
            idx = [i for i, k in enumerate(kinds) if k == kind]
            ms = [statistics.median(r["forward_ms"][i] for i in idx) for r in recs]
            host = [statistics.median(r["host_ms"][i] for i in idx) for r in recs]
            entry[f"{kind}_ms"], entry[f"{kind}_host_ms"] = summarize(ms), summarize(host)
            entry[f"{kind}_host_share"] = round(statistics.median(h / m for h, m in zip(host, ms)), 4)
        if family == "dreamzero":
            entry["chunk_ms"] = summarize([statistics.median(r["group_ms"]) for r in recs])
        if variant != "dense":
            diffs = [float((a.float() - b.float()).abs().max())
                     for got, want in zip(recs[0]["outputs"], dense_out) for a, b in zip(_leaves(got), _leaves(want))]
            entry.update(max_abs_diff_vs_dense=max(diffs), rel_diff_vs_dense=max(diffs) / scale,
                         warmup=warm[variant], ratio_vs_dense=_ratios(recs, per["dense"], family == "dreamzero"))
            if not entry["rel_diff_vs_dense"] <= tolerance:  # also catches NaN
                problems.append(f"{family} {variant}: max |paged - dense| is {entry['rel_diff_vs_dense']:.3g} of max "
                                f"|dense|, above the {dtype} bound {tolerance:g}")
            want = launches[PAGED[variant]]
            if entry["launches_per_forward"] != want:
                problems.append(f"{family} {variant}: {entry['launches_per_forward']:g} graph launches per forward, "
                                f"expected {want}")
        variants[variant] = entry
    return {"family": family, "tolerance_rel": tolerance, "dense_max_abs": scale, "variants": variants,
            "problems": problems}


def _ratios(paged: list[dict], dense: list[dict], chunks: bool) -> dict:
    """paged / dense per repeat: per forward kind (median over that kind's forwards) and per chunk."""
    out = {}
    kinds = paged[0]["kinds"]
    for kind in sorted(set(kinds)):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        out[kind] = summarize([statistics.median(p["forward_ms"][i] for i in idx)
                               / statistics.median(d["forward_ms"][i] for i in idx) for p, d in zip(paged, dense)])
    if chunks:
        out["chunk"] = summarize([statistics.median(p["group_ms"]) / statistics.median(d["group_ms"])
                                  for p, d in zip(paged, dense)])
    return out


COLUMNS = [("family", "family"), ("variant", "variant"), ("forward", "kind"), ("ms", "ms"), ("/ dense", "ratio"),
           ("host ms", "host"), ("host share", "share"), ("launches/fwd", "launches"), ("peak MiB", "peak"),
           ("max |diff|", "diff")]


def table_rows(report: dict) -> list[dict]:
    rows = []
    for fam in report["families"].values():
        for variant, v in fam["variants"].items():
            for kind in [k[:-3] for k in v if k.endswith("_ms") and not k.endswith("host_ms")]:
                ratio = v.get("ratio_vs_dense", {}).get(kind)
                peak = v["peak_bytes_above_held"]
                rows.append({
                    "family": fam["family"], "variant": variant, "kind": kind, "ms": f"{v[kind + '_ms']['median']:.2f}",
                    "ratio": f"{ratio['median']:.3f} [{ratio['q1']:.3f}-{ratio['q3']:.3f}]" if ratio else "-",
                    "host": f"{v[kind + '_host_ms']['median']:.2f}" if kind != "chunk" else "-",
                    "share": f"{v[kind + '_host_share']:.2%}" if kind != "chunk" else "-",
                    "launches": f"{v['launches_per_forward']:g}",
                    "peak": "-" if peak is None else f"{peak / 2**20:.0f}",
                    "diff": "-" if variant == "dense" else f"{v['max_abs_diff_vs_dense']:.2e}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (runs in CI)")
    parser.add_argument("--families", default="dreamzero,hunyuan")
    parser.add_argument("--repeats", type=int, default=None, help="repeats of every variant (default 3; dry run 2)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps per chunk / after the prefill "
                                                                "(default 2; dry run 1)")
    parser.add_argument("--chunks", type=int, default=None, help="DreamZero chunks (default: a window cycle + 1)")
    parser.add_argument("--window-reset-frames", type=int, default=8,
                        help="DreamZero's reset frame (real model: 20; each cache length is a dense graph)")
    parser.add_argument("--dreamzero-layers", type=int, default=None, help="DreamZero blocks (default 40)")
    parser.add_argument("--hunyuan-layers", type=int, default=HUNYUAN_IMAGE3.num_layers)
    parser.add_argument("--warmup-runs", type=int, default=None, help="untimed runs of every variant first "
                                                                      "(default 1; dry run 0)")
    parser.add_argument("--kernel", default="triton", help="the paged kernel on the GPU (default triton)")
    parser.add_argument("--block-size", type=int, default=None, help="pool block size (default 16; DreamZero dry: "
                                                                     "one frame)")
    parser.add_argument("--out", default=None, help="JSON output (default e2e_scale.json; a dry run: a temporary folder)")
    args = parser.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("e2e_scale: no CUDA device here; run it on a GPU machine, or use --dry-run on a CPU.", file=sys.stderr)
        return EXIT_UNAVAILABLE
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    args.repeats = args.repeats or (2 if dry else 3)
    args.steps = args.steps or (1 if dry else 2)
    args.warmup_runs = args.warmup_runs if args.warmup_runs is not None else (0 if dry else 1)
    if not dry and args.block_size is None:
        args.block_size = 16
    names = [f.strip() for f in args.families.split(",") if f.strip()]
    runners = {"dreamzero": run_dreamzero, "hunyuan": run_hunyuan}
    unknown = set(names) - set(runners)
    if unknown:
        print(f"e2e_scale: unknown families {sorted(unknown)}; choose from {sorted(runners)}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    t0 = time.perf_counter()
    results = {}
    # dense compiles a graph per cache length: the limit is raised for this run only, as is CHECK_VALUES (a CPU
    # debug aid that reads metadata on the host) switched off
    with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 32)):
        old_check, write_attend_module.CHECK_VALUES = write_attend_module.CHECK_VALUES, False
        try:
            for name in names:
                torch._dynamo.reset()
                try:
                    results[name] = runners[name](args, device, dtype, dry)
                except Exception as e:  # noqa: BLE001 - reported; the other family still runs
                    results[name] = {"family": name, "error": f"{type(e).__name__}: {e}", "variants": {},
                                     "problems": [f"{name}: {type(e).__name__}: {e}"]}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        finally:
            write_attend_module.CHECK_VALUES = old_check
    report = {"benchmark": "e2e_scale", "dry_run": dry, "device": torch.cuda.get_device_name() if not dry else "cpu",
              "machine": machine_info(), "dtype": str(dtype).replace("torch.", ""), "kernel": args.kernel if not dry
              else "reference", "repeats": args.repeats, "families": results,
              "seconds": round(time.perf_counter() - t0, 1)}
    out = report_path("e2e_scale", dry, args.out)
    out.write_text(json.dumps(report, indent=1))
    print(f"e2e_scale on {report['device']} ({report['dtype']}, kernel {report['kernel']}, {args.repeats} repeats, "
          f"{report['seconds']} s){' DRY RUN' if dry else ''}; JSON: {out}")
    print(format_table(table_rows(report), COLUMNS))
    for fam in (f for f in results.values() if "error" not in f):
        if fam["family"] == "hunyuan":
            print(f"hunyuan: {fam['config']['mlp']}; {fam['config']['layers']} of {fam['config']['of_real_layers']} "
                  "layers")
        print(f"{fam['family']}: dense compiled {fam['dense_compile']['dynamo_graphs']} graph(s), captured "
              f"{fam['dense_compile']['captured_stack_graphs']} stack graph(s)")
    problems = [p for fam in results.values() for p in fam["problems"]]
    if problems:
        print("e2e_scale: problems:\n  " + "\n  ".join(problems), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
