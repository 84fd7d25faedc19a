"""Shared pieces of the CPU benchmarks: configs, drivers of both model families, counting backends,
allocation tracking, statistics, machine description and tables.

The drivers run the reference models one forward at a time, the way `dreamzero_rollout` and
`hunyuan_generate` do, so that paged and dense forwards can be interleaved and timed one by one. The
same driver code serves both paths: only the hooks differ (`DenseHooks`: real caches; `PagedHooks`:
stand-ins and a runtime plan per forward).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence


import torch

from paged_kv_compile.backend import paged_kv_backend
from paged_kv_compile.driver import PagedHooks
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config, hunyuan_spec
from paged_kv_compile.models.dreamzero import DREAMZERO_MID, DreamZeroConfig, DreamZeroModel, dreamzero_steps
from paged_kv_compile.models.hooks import DenseHooks
from paged_kv_compile.models.hunyuan_image3 import (
    HUNYUAN_IMAGE3_MID,
    HunyuanImage3Config,
    HunyuanImage3Model,
    hunyuan_steps,
)
from paged_kv_compile.ops import reference as _reference_module
from paged_kv_compile.ops import write_attend as _write_attend_module
from paged_kv_compile.runtime import PagedKVRuntime

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

# ---- configs ---------------------------------------------------------------------------------------

#: Tiny DreamZero: 4 layers, dim 64 (4 heads x 16), 16 tokens per frame, chunk 2 frames, window 8 frames.
DZ_TINY = DreamZeroConfig(local_attn_size=8, window_reset_frames=16)
#: Mid-size DreamZero: dim 512 (8 heads x 64), 64 tokens per frame, chunk 2 frames, window 8 frames,
#: 33 action/state registers as in the real model.
DZ_MID = DREAMZERO_MID
#: Tiny HunyuanImage-3: 4 layers, hidden 64, 4/2 heads x 16, image 4x4 (target 18 tokens).
HY_TINY = HunyuanImage3Config()
#: Mid-size HunyuanImage-3: hidden 512, 8/2 heads x 64, image 16x16 (target 258 tokens).
HY_MID = HUNYUAN_IMAGE3_MID

#: Hunyuan request layouts used with each config: (prompt lengths of the CFG rows, padded prefix capacity).
HY_PROMPTS = {"tiny": ((20, 7), 32), "mid": ((200, 60), 256)}

# ---- process settings ------------------------------------------------------------------------------


@contextlib.contextmanager
def bench_settings(threads: int | None = None, view_runs: bool = True) -> Iterator[None]:
    """No autograd, no host-side value checks in the op, a recompile limit that dense fill levels never hit.

    `write_attend.CHECK_VALUES` reads metadata on the host at every call on CPU tensors (a debug aid that
    has no GPU counterpart); it is off while benchmarking and restored afterwards. `threads` sets torch's
    intra-op threads for the duration (None: leave them). `view_runs=False` makes the CPU reference kernel
    gather and scatter even ascending runs (`ops/reference.py: VIEW_RUNS`): what a fragmented table costs.
    """
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    old_check = _write_attend_module.CHECK_VALUES
    old_view_runs = _reference_module.VIEW_RUNS
    old_limit = torch._dynamo.config.recompile_limit
    old_grad = torch.is_grad_enabled()
    _write_attend_module.CHECK_VALUES = False
    _reference_module.VIEW_RUNS = view_runs
    torch._dynamo.config.recompile_limit = 64
    torch.set_grad_enabled(False)
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
        torch.set_grad_enabled(old_grad)
        torch._dynamo.config.recompile_limit = old_limit
        _write_attend_module.CHECK_VALUES = old_check
        _reference_module.VIEW_RUNS = old_view_runs
        torch.set_num_threads(old_threads)


def machine_info(**extra: Any) -> dict:
    """What the numbers were measured on: host, torch, threads, memory and load."""
    mem_gib = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "loadavg_1_5_15": [round(x, 2) for x in load] if load else None,
        **extra,
    }


# ---- compiling -------------------------------------------------------------------------------------


def inner_compile(name: str, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """The plain inner compiler, exactly as the paged_kv backend hands a graph on (backend.py)."""
    if name == "eager":
        return gm.forward
    if name == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    raise ValueError(f"unknown inner compiler {name!r}; use inductor, aot_eager or eager")


@dataclass
class CountingBackend:
    """A torch.compile backend that counts compiled frames and the seconds spent inside it.

    kind "paged": the `paged_kv` backend with `inner` as its inner compiler; kind "dense": `inner` alone.
    """

    kind: str
    inner: str
    options: dict = field(default_factory=dict)
    frames: int = 0
    seconds: float = 0.0

    def __call__(self, gm, example_inputs):
        t0 = time.perf_counter()
        try:
            if self.kind == "paged":
                return paged_kv_backend(gm, example_inputs, options={"inner_compiler": self.inner, **self.options})
            return inner_compile(self.inner, gm, example_inputs)
        finally:
            self.frames += 1
            self.seconds += time.perf_counter() - t0


def compile_regional(blocks: Iterable[torch.nn.Module], backend: Callable) -> None:
    """Regional compilation, the usual way DiTs are compiled: every block on its own, fullgraph, static shapes."""
    for block in blocks:
        block.compile(backend=backend, fullgraph=True, dynamic=False)


def warm_inductor() -> None:
    """Import and run Inductor once so the first measured compile does not pay for its imports."""
    fn = torch.compile(lambda x: torch.relu(x) * 2 + 1, backend="inductor", fullgraph=True, dynamic=False)
    fn(torch.randn(8))
    torch._dynamo.reset()


# ---- model setups and drivers ----------------------------------------------------------------------


@dataclass
class Setup:
    """A model compiled for one path ("dense", "paged" or "eager": uncompiled) and, if paged, its runtime."""

    path: str
    model: torch.nn.Module
    runtime: PagedKVRuntime | None
    backend: CountingBackend | None

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()


def dreamzero_setup(cfg: DreamZeroConfig, path: str, inner: str, *, seed: int = 1, sessions: int = 1,
                    blocks_per_layer: int | None = None, kernel: str = "reference") -> Setup:
    model = DreamZeroModel(cfg, seed=seed).eval()
    runtime = backend = None
    if path == "paged":
        overrides = {"blocks_per_layer": blocks_per_layer} if blocks_per_layer is not None else {}
        runtime = PagedKVRuntime(dreamzero_runtime_config(cfg, sessions=sessions, kernel=kernel,
                                                          inner_compiler=inner, **overrides))
        runtime.bind(model.blocks)
    if path != "eager":
        backend = CountingBackend(path, inner)
        compile_regional(model.blocks, backend)
    return Setup(path, model, runtime, backend)


def hunyuan_setup(cfg: HunyuanImage3Config, path: str, inner: str, *, max_prefix: int, seed: int = 2,
                  requests: int = 1, blocks_per_layer: int | None = None, kernel: str = "reference",
                  block_size: int = 16) -> Setup:
    model = HunyuanImage3Model(cfg, seed=seed).eval()
    runtime = backend = None
    if path == "paged":
        overrides = {"blocks_per_layer": blocks_per_layer} if blocks_per_layer is not None else {}
        runtime = PagedKVRuntime(hunyuan_runtime_config(cfg, max_prefix=max_prefix, requests=requests,
                                                        block_size=block_size, kernel=kernel,
                                                        inner_compiler=inner, **overrides))
        runtime.bind(model.layers)
    if path != "eager":
        backend = CountingBackend(path, inner)
        compile_regional(model.layers, backend)
    return Setup(path, model, runtime, backend)


class _CacheRecorder:
    """Hooks for a library loop that hand out the driver's hooks' caches and keep them on the driver."""

    def __init__(self, driver) -> None:
        self.driver = driver

    def caches(self, model, batch, **geometry):
        self.driver.caches = self.driver.hooks.caches(model, batch, **geometry)
        return self.driver.caches

    def write_once_kv(self, model, cross_kvs):
        return self.driver.hooks.write_once_kv(model, cross_kvs)

    def reset_history(self) -> None:
        self.driver.hooks.reset_history()


class LoopDriver:
    """Runs a library step generator (`models/hooks.py`) a few forwards at a time, inside `hooks.forward`."""

    def __init__(self, steps, hooks, on_result: Callable[[Any, Any], None] | None = None) -> None:
        self.steps, self.hooks, self.on_result = steps, hooks, on_result
        self.pending = next(steps)
        self.done = False

    def pending_index(self) -> int | None:
        return None if self.done else self.pending.index

    def run_one(self):
        """Run the next forward; returns its result."""
        forward = self.pending
        with self.hooks.forward(forward.kind, **forward.info):
            result = forward.call()
        if self.on_result is not None:
            self.on_result(forward, result)
        try:
            self.pending = self.steps.send(result)
        except StopIteration:
            self.done = True
        return result

    def run_while(self, condition, observe: Callable[[], None] | None = None) -> None:
        """Run forwards while `condition(next forward)` holds; `observe()` after each."""
        while not self.done and condition(self.pending):
            self.run_one()
            if observe:
                observe()


class DreamZeroSession:
    """One DreamZero session driven forward by forward (the loop of `dreamzero_rollout`).

    Dense: real caches that grow by concatenation. Paged: stand-ins and the runtime's plan per forward.
    Two CFG rows (conditional, empty text), as in the rollout.
    """

    def __init__(self, setup: Setup, session_id: str = "session", seed: int = 0,
                 hooks: DenseHooks | None = None) -> None:
        self.model = model = setup.model
        self.cfg = cfg = model.cfg
        self.runtime = setup.runtime
        self.session_id = session_id
        if self.runtime is not None:
            self.runtime.admit(session_id, DreamZeroSpec.from_model_config(cfg), rows=2)
            self.hooks = hooks or PagedHooks(self.runtime, session_id)
        else:
            self.hooks = hooks or DenseHooks()
        self.seed = seed
        self._loop: LoopDriver | None = None  # the library loop, once run_chunk is first called
        self.gen = torch.Generator().manual_seed(seed)
        context = self.noise(1, cfg.text_len, cfg.text_dim)
        image = self.noise(2, cfg.image_len, cfg.image_dim) if cfg.image_len else None
        self.cross_kvs = model.prepare_cross_kv(torch.cat([context, torch.zeros_like(context)]), image)
        self.caches = self.hooks.caches(model, 2)
        self.start_frame = 0
        self.previous: tuple | None = None
        self.sigmas: list[float] = []

    def noise(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen)

    def commit(self, video: torch.Tensor, action: torch.Tensor, start_frame: int) -> None:
        """A commit forward over a clean chunk (its K/V becomes history)."""
        cfg = self.cfg
        with self.hooks.forward("commit", start_frame=start_frame, num_frames=cfg.num_frame_per_block):
            _, _, self.caches = self.model(video.expand(2, -1, -1), action.expand(2, -1, -1), torch.zeros(2),
                                           start_frame, self.caches, self.cross_kvs, update_kv_cache=True)

    def commit_random_chunk(self) -> None:
        """Commit a random clean chunk at the current start frame and advance (fills the window)."""
        cfg = self.cfg
        self.commit(self.noise(1, cfg.chunk_tokens, cfg.in_channels),
                    self.noise(1, cfg.action_register_length, cfg.action_dim), self.start_frame)
        self.start_frame += cfg.num_frame_per_block

    def denoise(self, x: torch.Tensor, a: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One denoising forward of the current chunk (nothing becomes history)."""
        cfg = self.cfg
        with self.hooks.forward("denoise", start_frame=self.start_frame, num_frames=cfg.num_frame_per_block):
            v_x, v_a, _ = self.model(x.expand(2, -1, -1), a.expand(2, -1, -1), t, self.start_frame, self.caches,
                                     self.cross_kvs, update_kv_cache=False)
        return v_x, v_a

    def denoise_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        return (self.noise(1, cfg.chunk_tokens, cfg.in_channels),
                self.noise(1, cfg.action_register_length, cfg.action_dim), torch.full((2,), 500.0))

    def run_chunk(self, steps: int, guidance: float = 5.0, observe: Callable[[], None] | None = None) -> None:
        """One chunk of the library's rollout loop (`dreamzero_steps`): the commit of the previous clean
        chunk, `steps` denoising forwards, advance (and reset the window when it is due)."""
        if self._loop is None:
            self._loop = LoopDriver(dreamzero_steps(self.model, num_chunks=2**31 - 1, num_inference_steps=steps,
                                                    guidance_scale=guidance, seed=self.seed,
                                                    hooks=_CacheRecorder(self)), self.hooks,
                                    on_result=self._keep_caches)
        chunk = self._loop.pending_index()
        self._loop.run_while(lambda forward: forward.index == chunk, observe)

    def _keep_caches(self, forward, result) -> None:
        if forward.kind == "commit":  # the caches the loop holds from now on (dense: grown by the commit)
            self.caches = result[2]

    def close(self) -> None:
        self.caches = []
        if self.runtime is not None:
            self.runtime.release(self.session_id)


class HunyuanRequestDriver:
    """One HunyuanImage-3 request (1 or 2 CFG rows) driven forward by forward (the loop of `hunyuan_generate`)."""

    def __init__(self, setup: Setup, prompt_lens: Sequence[int], capacity: int, request_id: str = "request",
                 seed: int = 0, hooks: DenseHooks | None = None) -> None:
        self.model = model = setup.model
        self.cfg = cfg = model.cfg
        self.runtime = setup.runtime
        self.request_id = request_id
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, cfg.vocab, (n,), generator=gen) for n in prompt_lens]
        if self.runtime is not None:
            self.runtime.admit(request_id, hunyuan_spec(cfg, prompts))
            self.hooks = hooks or PagedHooks(self.runtime, request_id)
        else:
            self.hooks = hooks or DenseHooks()
        self.prompts, self.seed = prompts, seed
        self._loop: LoopDriver | None = None  # the library loop, once forward is first called
        self.req = model.build_request(prompts, capacity)
        self.caches = self.hooks.caches(model, self.req.batch, prefix_capacity=capacity)
        self.x = torch.randn(cfg.image_tokens, cfg.latent_channels, generator=gen)
        self.steps_done = 0

    def _target(self, t: float) -> torch.Tensor:
        b = self.req.batch
        return self.model.embed_target(self.x.expand(b, -1, -1), torch.full((b,), t))

    def prefill(self, t: float = 1000.0) -> torch.Tensor:
        req = self.req
        target = self._target(t)
        with self.hooks.forward("prefill", attention_mask=req.attention_mask):
            hidden = self.model(torch.cat([req.prefix_embeds, target], dim=1), req.rope_cos, req.rope_sin,
                                req.attention_mask, self.caches, req.prefix_valid, "prefill")
        return hidden[:, req.prefix_capacity:]

    def step(self, t: float = 500.0) -> torch.Tensor:
        req = self.req
        target = self._target(t)
        with self.hooks.forward("step", attention_mask=req.step_attention_mask):
            return self.model(target, req.step_rope_cos, req.step_rope_sin, req.step_attention_mask, self.caches,
                              req.prefix_valid, "step")

    def forward(self, num_steps: int) -> torch.Tensor:
        """The next forward of the library's `num_steps` generation loop (`hunyuan_steps`); its hidden states."""
        if self._loop is None:
            self._loop = LoopDriver(hunyuan_steps(self.model, self.prompts, prefix_capacity=self.req.prefix_capacity,
                                                  num_steps=num_steps, seed=self.seed, hooks=_CacheRecorder(self)),
                                    self.hooks)
        hidden = self._loop.run_one()
        self.steps_done += 1
        return hidden

    def finish(self) -> None:
        self.caches = []
        if self.runtime is not None:
            self.runtime.release(self.request_id)


# ---- allocations -----------------------------------------------------------------------------------


class AllocationTracker:
    """Peak of torch's CPU allocations made inside the `with` block, net of the frees made there.

    Read from the profiler's memory events (`profile_memory=True`): every allocation and free of torch's
    CPU allocator, compiled code included, in time order. Memory allocated before the block (weights, a
    pool reserved up front) is not counted, nor are its frees. This is the CPU stand-in for
    `torch.cuda.max_memory_allocated() - memory_allocated()` at entry; it is not RSS.
    """

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.final_bytes = 0
        self.events = 0
        self._prof = None

    def __enter__(self) -> "AllocationTracker":
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from torch._C._profiler import _EventType

        self._prof.__exit__(*exc)
        deltas = []
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                deltas.append((node.start_time_ns, node.extra_fields.alloc_size))
            stack.extend(node.children)
        live = peak = 0
        for _, size in sorted(deltas):
            live += size
            peak = max(peak, live)
        self.peak_bytes, self.final_bytes, self.events = peak, live, len(deltas)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views and repeats of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


# ---- statistics and output -------------------------------------------------------------------------


def summarize(values: Sequence[float], digits: int = 4) -> dict:
    """median, min, max and the interquartile range of `values`."""
    vals = sorted(values)
    if len(vals) >= 2:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    else:
        q1 = q3 = vals[0]
    r = lambda v: round(float(v), digits)  # noqa: E731
    return {"median": r(statistics.median(vals)), "min": r(vals[0]), "max": r(vals[-1]), "q1": r(q1), "q3": r(q3),
            "n": len(vals)}


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int, inner_loops: int = 1,
                warmup: int = 2, clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Per-repeat seconds of each callable, run alternately (the order rotates every repeat).

    Each sample is the mean of `inner_loops` back-to-back calls. Machine noise that lasts longer than
    one repeat hits every callable; ratios are taken per repeat. `clock=time.thread_time` measures the
    calling thread's CPU time instead of wall time (what other processes' preemption does not inflate; all
    the work with one intra-op thread).
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    out: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            fn = fns[name]
            t0 = clock()
            for _ in range(inner_loops):
                fn()
            out[name].append((clock() - t0) / inner_loops)
    return out


def ratio_entry(times: dict[str, list[float]], num: str = "paged", den: str = "dense") -> dict:
    """Median times (ms) of both and the per-repeat ratio num/den summarized."""
    ratios = [a / b for a, b in zip(times[num], times[den])]
    return {
        f"{num}_ms": round(statistics.median(times[num]) * 1e3, 3),
        f"{den}_ms": round(statistics.median(times[den]) * 1e3, 3),
        "ratio": summarize(ratios),
    }


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """A plain aligned text table; `columns` are (header, key) pairs, values formatted with str()."""
    cells = [[h for h, _ in columns]] + [[_fmt(r.get(k, "")) for _, k in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    esc = lambda text: text.replace("|", "\\|")  # noqa: E731  (a literal | would split the cell)
    head = "| " + " | ".join(esc(h) for h, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(esc(_fmt(r.get(k, ""))) for _, k in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-3 and v != 0 else (f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}")
    return str(v)


def gib(nbytes: float) -> float:
    return nbytes / 2**30


def mib(nbytes: float) -> float:
    return nbytes / 2**20
