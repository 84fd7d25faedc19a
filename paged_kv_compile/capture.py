"""Warm-up over shape buckets, then CUDA-graph capture and replay of the compiled blocks.

    runtime = PagedKVRuntime(dreamzero_runtime_config(cfg, buckets=dreamzero_buckets(cfg)))
    runtime.bind(model.blocks)
    for block in model.blocks:
        block.compile(backend="paged_kv", fullgraph=True, dynamic=False)
    captured = warm_up(model, runtime)      # compiles every bucket; on CUDA also captures
    with captured.serving():                # from here on, any compile is an error
        paged_dreamzero_rollout(model, runtime, num_chunks=10)

`warm_up` wraps the model's blocks (`CapturedBlocks`). Per bucket it owns one set of static input
buffers, shared by all blocks (one buffer per argument position: hidden states, modulation, RoPE
tables, cross-attention K/V, masks...); cache stand-ins and the pool are already at fixed addresses
and pass through. A block call copies its tensor arguments into those buffers (skipped when the same
unmodified tensor was copied last, e.g. RoPE tables shared by all blocks) and then, on CUDA, replays
that block's graph and copies the outputs out; on a machine without a GPU it calls the compiled block
on the same static buffers, so the address logic is the same and tested.

Graph granularity: one CUDA graph per (bucket, block), all captured into ONE shared memory pool,
not one graph over the whole stack. The models own their loop over blocks (`for block in
self.blocks: x = block(x, ...)`) and nothing runs between two blocks that a graph over the stack
could replace without deferring every block's result to the last one; per-block graphs keep every
returned tensor real, keep the binding property that blocks may run in any order or be skipped, and
cost one graph launch per block (microseconds against milliseconds of block compute at real sizes;
vLLM's piecewise graphs make the same trade). Static outputs live in per-bucket buffers that each
graph writes last, so the graphs' intermediates are reused across captures through the shared pool.

A forward whose bucket was not warmed up raises `RequestError` naming it and the warmed-up ones
(the runtime already refuses shapes outside its configured buckets). With `fallback="eager"` such a
forward instead runs uncaptured: the runtime lets the shape through as its own bucket, the block is
called directly (dynamo compiles that shape once, with a warning; counted in `stats`), never
replayed. Serving under `serving()` sets `torch.compiler.set_stance("fail_on_recompile")`, so a
silent recompile is an error; captured calls enforce that stance themselves as well.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree

from . import binding, families
from .config import Bucket
from .errors import ConfigError, PagedKVError, RequestError
# Re-exported where the README and older callers import them; they live with their family.
from .families.dreamzero import dreamzero_block_inputs, dreamzero_buckets  # noqa: F401
from .families.hunyuan_image3 import hunyuan_buckets, hunyuan_layer_inputs  # noqa: F401

FALLBACKS = ("error", "eager")

#: example_inputs(bucket) -> (args, kwargs) of ONE block call of that bucket (the same for every block).
ExampleInputs = Callable[[Bucket], "tuple[tuple, dict]"]


class CaptureError(PagedKVError, RuntimeError):
    """Warm-up or capture is impossible as asked, or a block call does not match what was captured."""


def model_blocks_and_inputs(model, runtime) -> tuple[torch.nn.ModuleList, ExampleInputs, str]:
    """The block list, the example-input factory and the family name of a reference model."""
    family = families.for_model(model)
    return family.blocks(model), functools.partial(family.example_inputs, model, runtime), family.name


# ---- argument leaves ------------------------------------------------------------------------------

_TENSOR, _STANDIN, _OBJECT, _CONST = "tensor", "stand-in", "object", "constant"


def _signature(value: Any, where: str, depth: int = 0) -> tuple[str, Any]:
    """(kind, signature) of one flattened argument; two calls match when both are equal."""
    if isinstance(value, torch.Tensor):
        if binding.is_standin(value):
            return _STANDIN, (value.data_ptr(), tuple(value.shape), tuple(value.stride()), value.dtype)
        return _TENSOR, (tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (str, int, float, bool, type(None), torch.dtype, torch.device)):
        return _CONST, value
    attrs = getattr(value, "__dict__", None)
    if attrs is not None and depth < 2 and not isinstance(value, torch.nn.Module):
        items = []
        for name, attr in sorted(attrs.items()):
            kind, sig = _signature(attr, f"{where}.{name}", depth + 1)
            if kind == _TENSOR:
                raise CaptureError(
                    f"{where}.{name} is a tensor that is not a KV-cache stand-in inside a {type(value).__name__}: a "
                    "captured graph would keep reading it at its warm-up address. Pass it as a tensor argument"
                )
            items.append((name, kind, sig))
        return _OBJECT, (type(value), tuple(items))
    raise CaptureError(f"{where} is a {type(value).__name__}, which a captured block call cannot take")


def _describe(kind: str, sig: Any) -> str:
    if kind == _TENSOR:
        shape, dtype, device = sig
        return f"tensor {list(shape)} {dtype} on {device}"
    if kind == _STANDIN:
        return f"stand-in {list(sig[1])} at {sig[0]:#x}"
    if kind == _OBJECT:
        return f"{sig[0].__name__} object"
    return f"{type(sig).__name__} {sig!r}"


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version: never skip their copy
        return None


@dataclass
class _Slot:
    """One flattened argument position of a bucket's block calls."""

    kind: str
    sig: Any
    buffer: torch.Tensor | None = None  # the static buffer of a tensor argument
    last: tuple | None = None  # (weakref to the last source, its version): skip an identical copy


@dataclass
class _BucketState:
    bucket: Bucket
    spec: Any  # pytree spec of (args, kwargs)
    slots: list[_Slot]
    example: list  # the warm-up leaves in flattened order (None for tensors: their buffer holds them)
    graphs: dict[int, Any] = field(default_factory=dict)  # block index -> torch.cuda.CUDAGraph
    outputs: dict[int, Any] = field(default_factory=dict)  # block index -> output tree over static buffers
    out_buffers: list[torch.Tensor] = field(default_factory=list)
    site_layers: dict[int, set] = field(default_factory=dict)  # block index -> layers its paged sites serve

    def static_leaves(self) -> list:
        return [s.buffer if s.kind == _TENSOR else leaf for s, leaf in zip(self.slots, self.example)]


@dataclass
class BucketWarmup:
    """What warming up one bucket cost."""

    bucket: Bucket
    compile_s: float  # the first forward of the bucket over all blocks: dynamo + passes + inner compiler
    capture_s: float  # CUDA-graph capture of every block (0 without capture)
    graphs_compiled: int  # dynamo graphs compiled while warming this bucket (one serves every block)
    cuda_graphs: int

    def as_dict(self) -> dict:
        b = self.bucket
        return {"bucket": {"rows": b.rows, "tokens": b.tokens, "context": b.context},
                "compile_s": round(self.compile_s, 4), "capture_s": round(self.capture_s, 4),
                "graphs_compiled": self.graphs_compiled, "cuda_graphs": self.cuda_graphs}


@dataclass
class WarmupReport:
    buckets: list[BucketWarmup]
    captured: bool
    total_s: float
    graphs: str = "none"  # "cuda", "emulated" or "none"

    def as_dict(self) -> dict:
        return {"captured": self.captured, "graphs": self.graphs, "total_s": round(self.total_s, 4),
                "buckets": [b.as_dict() for b in self.buckets]}

    def format(self) -> str:
        mode = {"cuda": "compiled and captured as CUDA graphs", "emulated": "compiled and captured (emulated graphs)"
                }.get(self.graphs, "compiled (no CUDA graphs on this device)")
        lines = [f"warm-up: {len(self.buckets)} bucket(s) {mode} in {self.total_s:.2f} s"]
        for b in self.buckets:
            lines.append(
                f"  {format_bucket(b.bucket)}: compile {b.compile_s:.2f} s, capture {b.capture_s:.2f} s, "
                f"{b.graphs_compiled} graph(s) compiled, {b.cuda_graphs} CUDA graph(s)"
            )
        return "\n".join(lines)


def format_bucket(bucket: Bucket) -> str:
    return f"rows={bucket.rows} tokens={bucket.tokens} context={bucket.context}"


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _progress(total: int, enabled: bool):
    """A tqdm bar on stderr when tqdm is installed (None otherwise: one printed line per bucket)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional
        return None
    return tqdm(total=total, desc="paged-kv warm-up", unit="bucket", file=sys.stderr, leave=True)


# ---- how graphs are captured ----------------------------------------------------------------------


class CudaGraphs:
    """CUDA graphs, all captured into one shared memory pool (`torch.cuda.graph_pool_handle()`)."""

    def __init__(self, pool=None) -> None:
        self.pool = pool

    def warm(self, run: Callable[[], Any], iters: int) -> None:
        """Run on a side stream first, as capture requires (lazy inits, allocator warm-up)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(iters):
                run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def capture(self, region: Callable[[], Any]) -> tuple[Any, Any]:
        """(graph, what region returned while captured); graph.replay() runs its kernels again."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = region()
        return graph, out

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class _Replay:
    def __init__(self, region: Callable[[], Any]) -> None:
        self.region = region

    def replay(self) -> None:
        self.region()


class EmulatedGraphs:
    """Stands in for CUDA graphs on machines without a GPU: "replay" calls the captured region again.

    It reads the same static buffers a CUDA graph would, so the capture bookkeeping (static inputs and
    outputs, copy in and out) is exercised end to end; `CapturedBlocks(..., graphs=EmulatedGraphs())`.
    """

    def warm(self, run: Callable[[], Any], iters: int) -> None:
        for _ in range(iters):
            run()

    def capture(self, region: Callable[[], Any]) -> tuple[Any, Any]:
        return _Replay(region), region()

    def synchronize(self) -> None:
        pass


# ---- the wrapper ----------------------------------------------------------------------------------


class _CapturedBlock(torch.nn.Module):
    """Stands in a ModuleList for one compiled block; its parameters are the block's own."""

    def __init__(self, owner: "CapturedBlocks", index: int, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_index", index)

    def forward(self, *args, **kwargs):
        return self._owner._call(self._index, args, kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # e.g. DreamZeroModel.prepare_cross_kv reads block.cross_attn
            if name.startswith("__") or "_modules" not in self.__dict__:
                raise
            return getattr(self._modules["block"], name)


class CapturedBlocks:
    """The compiled blocks of one model, warmed up per bucket and (on CUDA) captured as CUDA graphs.

    blocks: the model's ModuleList of compiled blocks (bound to `runtime`); example_inputs(bucket)
    gives the (args, kwargs) of one block call of that bucket. capture: "auto" (CUDA graphs when the
    pool is on a CUDA device), True or False. fallback: "error" (a forward of a bucket that was not
    warmed up raises) or "eager" (it runs uncaptured, compiling that shape once, with a warning).
    """

    def __init__(
        self,
        blocks: Sequence[torch.nn.Module],
        runtime,
        example_inputs: ExampleInputs,
        *,
        buckets: Sequence[Bucket] | None = None,
        capture: bool | str = "auto",
        fallback: str = "error",
        warmup_iters: int = 2,
        graphs: CudaGraphs | EmulatedGraphs | None = None,
    ) -> None:
        if fallback not in FALLBACKS:
            raise ConfigError(f"unknown fallback {fallback!r}; choose one of {', '.join(FALLBACKS)}")
        if isinstance(blocks, torch.nn.ModuleList):
            self.module_list: torch.nn.ModuleList | None = blocks
        else:
            self.module_list = None
        self.blocks = [b.block if isinstance(b, _CapturedBlock) else b for b in blocks]
        if len(self.blocks) != runtime.config.num_layers:
            raise ConfigError(
                f"{len(self.blocks)} blocks given but the runtime has {runtime.config.num_layers} layers; "
                "pass the model's list of blocks/decoder layers"
            )
        self.runtime = runtime
        self.example_inputs = example_inputs
        buckets = tuple(buckets) if buckets is not None else tuple(runtime.config.buckets)
        if not buckets:
            raise ConfigError(
                "no shape buckets to warm up: give buckets=... or configure PagedKVConfig(buckets=...) "
                "(capture.dreamzero_buckets / capture.hunyuan_buckets build them)"
            )
        if runtime.config.buckets:
            unknown = [b for b in buckets if b not in runtime.config.buckets]
            if unknown:
                raise ConfigError(
                    f"buckets {unknown} are not configured on the runtime "
                    f"(configured: {sorted(runtime.config.buckets)})"
                )
        self.buckets = tuple(dict.fromkeys(buckets))
        on_cuda = runtime.pool.tensor.is_cuda
        if capture == "auto":
            capture = on_cuda or graphs is not None
        if capture and not on_cuda and graphs is None:
            raise ConfigError("capture=True needs the runtime's pool on a CUDA device; use capture='auto' or False")
        self.capture = bool(capture)
        self.graphs = (graphs if graphs is not None else CudaGraphs()) if self.capture else None
        self.fallback = fallback
        runtime.allow_unconfigured_buckets = fallback == "eager"
        self.warmup_iters = warmup_iters
        self._states: dict[Bucket, _BucketState] = {}
        self._warned: set = set()
        self._installed = False
        self.report: WarmupReport | None = None
        self.stats = {"replays": 0, "direct_calls": 0, "copies": 0, "copies_skipped": 0,
                      "fallback_calls": 0, "fallback_compiles": 0}
        self.fallback_buckets: set[Bucket] = set()

    # ---- warm-up --------------------------------------------------------------------------------
    @property
    def warmed_buckets(self) -> list[Bucket]:
        return sorted(self._states)

    def warmup(self, *, progress: bool = True) -> WarmupReport:
        """Compile every bucket (one forward over all blocks each), then capture it on CUDA."""
        limit = torch._dynamo.config.recompile_limit
        if len(self.buckets) > limit:
            raise ConfigError(
                f"{len(self.buckets)} buckets but torch._dynamo.config.recompile_limit is {limit}: past the limit "
                "dynamo runs the block eagerly, which reads empty stand-ins. Raise it first: "
                f"torch._dynamo.config.recompile_limit = {len(self.buckets)}"
            )
        start = time.perf_counter()
        timings = []
        bar = _progress(len(self.buckets), progress)
        for bucket in self.buckets:
            if bar is not None:
                bar.set_postfix_str(f"compiling {format_bucket(bucket)}")
            timing = self._warm_bucket(bucket)
            timings.append(timing)
            line = (f"{format_bucket(timing.bucket)}: compile {timing.compile_s:.2f} s, "
                    f"capture {timing.capture_s:.2f} s")
            if bar is not None:
                bar.update(1)
                bar.write(f"paged-kv warm-up: {line}", file=sys.stderr)
            elif progress:
                print(f"paged-kv warm-up: {line}", file=sys.stderr)
        if bar is not None:
            bar.set_postfix_str("done")
            bar.close()
        kind = "none" if not self.capture else ("cuda" if isinstance(self.graphs, CudaGraphs) else "emulated")
        self.report = WarmupReport(timings, self.capture, time.perf_counter() - start, kind)
        return self.report

    def _prepare(self, bucket: Bucket) -> _BucketState:
        args, kwargs = self.example_inputs(bucket)
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        slots = []
        for n, leaf in enumerate(leaves):
            kind, sig = _signature(leaf, f"argument {n}")
            slot = _Slot(kind, sig)
            if kind == _TENSOR:
                if torch._debug_has_internal_overlap(leaf) == 1:
                    raise CaptureError(
                        f"argument {n} of the example inputs for {bucket} is an expanded (self-overlapping) tensor; "
                        "give a materialized tensor or a registered stand-in (runtime.standin)"
                    )
                slot.buffer = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device)
                slot.buffer.copy_(leaf)
            slots.append(slot)
        return _BucketState(bucket, spec, slots, [None if s.kind == _TENSOR else x for s, x in zip(slots, leaves)])

    def _static_call(self, state: _BucketState, index: int):
        args, kwargs = pytree.tree_unflatten(state.static_leaves(), state.spec)
        return self.blocks[index](*args, **kwargs)

    def _warm_bucket(self, bucket: Bucket) -> BucketWarmup:
        t0 = time.perf_counter()
        graphs0 = _unique_graphs()
        state = self._prepare(bucket)
        buffers = [s.buffer for s in state.slots if s.buffer is not None]
        versions = [b._version for b in buffers]
        with torch.no_grad(), self.runtime.warmup_forward(bucket) as active:
            seen = getattr(active, "layers_seen", None)
            for i in range(len(self.blocks)):
                before = set(seen) if seen is not None else set()
                out = self._static_call(state, i)
                state.site_layers[i] = (set(seen) - before) if seen is not None else set()
                for leaf in pytree.tree_leaves(out):
                    if isinstance(leaf, torch.Tensor) and not bool(torch.isfinite(leaf).all()):
                        raise CaptureError(f"block {i} gave non-finite outputs in the warm-up forward of {bucket}")
        mutated = [n for n, (b, v) in enumerate(zip(buffers, versions)) if b._version != v]
        if mutated:
            raise CaptureError(
                f"the blocks write into their tensor arguments in place (static inputs {mutated} of {bucket}): a "
                "captured call would write into its static copy, not the caller's tensor"
            )
        if seen is not None:
            missing = [i for i, layers in state.site_layers.items() if not layers]
            if missing:
                raise CaptureError(
                    f"blocks {missing} ran no paged attention site in the warm-up forward of {bucket}: compile them "
                    "with block.compile(backend='paged_kv', fullgraph=True, dynamic=False) and bind the runtime to "
                    "them (runtime.bind) before warming up; uncompiled blocks would read empty KV-cache stand-ins"
                )
        compile_s = time.perf_counter() - t0
        graphs = _unique_graphs() - graphs0
        capture_s = self._capture(state) if self.capture else 0.0
        self._states[bucket] = state
        return BucketWarmup(bucket, compile_s, capture_s, graphs, len(state.graphs))

    def _capture(self, state: _BucketState) -> float:
        """One graph per block for this bucket, all in the shared pool; outputs go to static buffers."""
        t0 = time.perf_counter()
        graphs, n = self.graphs, len(self.blocks)
        with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"), \
                self.runtime.warmup_forward(state.bucket):
            graphs.warm(lambda: [self._static_call(state, i) for i in range(n)], self.warmup_iters)
            out_buffers: dict[tuple, torch.Tensor] = {}
            for i in range(n):
                probe = self._static_call(state, i)  # the outputs' shapes, outside the capture
                leaves, out_spec = pytree.tree_flatten(probe)
                targets = []
                for k, leaf in enumerate(leaves):
                    if isinstance(leaf, torch.Tensor) and not binding.is_standin(leaf):
                        key = (k, tuple(leaf.shape), leaf.dtype)
                        if key not in out_buffers:
                            out_buffers[key] = torch.empty_like(leaf, memory_format=torch.contiguous_format)
                        targets.append(out_buffers[key])
                    else:
                        targets.append(None)
                del probe, leaves

                def region(i=i, targets=targets):
                    got = pytree.tree_leaves(self._static_call(state, i))
                    for target, leaf in zip(targets, got):
                        if target is not None:
                            target.copy_(leaf)  # the graph's last kernels: results into static outputs
                    return got

                graph, got = graphs.capture(region)
                state.graphs[i] = graph
                # Stand-in outputs (returned caches) are views of fixed stand-ins: kept as they are.
                state.outputs[i] = pytree.tree_unflatten(
                    [t if t is not None else leaf for t, leaf in zip(targets, got)], out_spec
                )
                del got  # the graph's intermediates go back to the shared pool
            state.out_buffers = list(out_buffers.values())
        graphs.synchronize()
        return time.perf_counter() - t0

    # ---- serving ----------------------------------------------------------------------------------
    def install(self) -> "CapturedBlocks":
        """Put wrappers in the model's ModuleList so the model's own loop calls the captured blocks."""
        if self.module_list is None:
            raise CaptureError(
                "install() needs the model's nn.ModuleList of blocks; call captured.call(i, ...) instead"
            )
        if not self._installed:
            for i, block in enumerate(self.blocks):
                self.module_list[i] = _CapturedBlock(self, i, block)
            self._installed = True
        return self

    def uninstall(self) -> None:
        """Put the original (compiled) blocks back."""
        if self._installed and self.module_list is not None:
            for i, block in enumerate(self.blocks):
                self.module_list[i] = block
        self._installed = False

    @contextlib.contextmanager
    def serving(self) -> Iterator["CapturedBlocks"]:
        """Serve with the wrappers installed and `fail_on_recompile`: a compile while serving is an error."""
        if not self._states:
            raise CaptureError("nothing was warmed up: call warmup() before serving")
        was_installed = self._installed
        self.install()
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                yield self
        finally:
            if not was_installed:
                self.uninstall()

    def call(self, index: int, *args, **kwargs):
        """Call block `index` through its captured path (what an installed wrapper does)."""
        return self._call(index, args, kwargs)

    def _call(self, index: int, args: tuple, kwargs: dict):
        active = self.runtime.require_active()
        bucket = active.bucket
        state = self._states.get(bucket)
        if state is None:
            return self._fallback(
                index, bucket, args, kwargs,
                f"bucket {bucket} was not warmed up (warmed up: {self.warmed_buckets})",
                "add it to the runtime's configured buckets and warm up again",
            )
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        why = self._mismatch(state, leaves, spec)
        if why:
            return self._fallback(index, bucket, args, kwargs, f"block {index}'s call for {bucket}: {why}",
                                  "call the blocks exactly as the model's loop does at warm-up")
        self._copy_in(state, leaves)
        if state.graphs:
            state.graphs[index].replay()
            seen = getattr(active, "layers_seen", None)
            if seen is not None:  # the site's Python did not run: record what the captured call served
                seen.update(state.site_layers.get(index, ()))
            self.stats["replays"] += 1
            return pytree.tree_map(_copy_out, state.outputs[index])
        self.stats["direct_calls"] += 1
        call_args, call_kwargs = pytree.tree_unflatten(
            [s.buffer if s.kind == _TENSOR else leaf for s, leaf in zip(state.slots, leaves)], state.spec
        )
        with torch.compiler.set_stance("fail_on_recompile"):
            return self.blocks[index](*call_args, **call_kwargs)

    def _mismatch(self, state: _BucketState, leaves: list, spec) -> str:
        if spec != state.spec:
            return "its arguments are structured differently from the warm-up's"
        for n, (slot, leaf) in enumerate(zip(state.slots, leaves)):
            kind, sig = _signature(leaf, f"argument {n}")
            if kind != slot.kind or sig != slot.sig:
                return f"argument {n} is a {_describe(kind, sig)}, warmed up as a {_describe(slot.kind, slot.sig)}"
        return ""

    def _copy_in(self, state: _BucketState, leaves: list) -> None:
        for slot, leaf in zip(state.slots, leaves):
            if slot.kind != _TENSOR:
                continue
            buf = slot.buffer
            if leaf is buf:
                continue
            version = _version(leaf)
            if version is not None and slot.last is not None and slot.last[0]() is leaf and slot.last[1] == version:
                self.stats["copies_skipped"] += 1  # e.g. the RoPE tables every block of a forward receives
                continue
            buf.copy_(leaf)
            slot.last = (weakref.ref(leaf), version) if version is not None else None
            self.stats["copies"] += 1

    def _fallback(self, index: int, bucket: Bucket, args: tuple, kwargs: dict, why: str, fix: str):
        if self.fallback == "error":
            raise RequestError(f"{why}; {fix}, or build CapturedBlocks(fallback='eager') to run it uncaptured")
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"paged_kv capture: {why}; running it uncaptured (this shape compiles once now)",
                          stacklevel=4)
        self.stats["fallback_calls"] += 1
        self.fallback_buckets.add(bucket)
        before = _unique_graphs()
        with torch.compiler.set_stance("default"):
            out = self.blocks[index](*args, **kwargs)
        self.stats["fallback_compiles"] += _unique_graphs() - before
        return out

    # ---- introspection ----------------------------------------------------------------------------
    def addresses(self) -> dict[str, tuple[int, ...]]:
        """Every address a captured graph reads or writes: pool, metadata, stand-ins, static buffers."""
        out = {"pool": (self.runtime.pool.tensor.data_ptr(),)}
        for bucket, state in sorted(self._states.items()):
            name = format_bucket(bucket)
            out[f"metadata {name}"] = self.runtime.metadata.buffers(bucket).addresses()
            out[f"inputs {name}"] = tuple(
                s.buffer.data_ptr() if s.kind == _TENSOR else s.sig[0] for s in state.slots
                if s.kind in (_TENSOR, _STANDIN)
            )
            out[f"outputs {name}"] = tuple(t.data_ptr() for t in state.out_buffers)
        return out

    def static_bytes(self) -> int:
        """Bytes of the static input/output buffers of every bucket (the pool and metadata excluded)."""
        total = 0
        for state in self._states.values():
            for t in [s.buffer for s in state.slots if s.buffer is not None] + state.out_buffers:
                total += t.untyped_storage().nbytes()
        return total


def _copy_out(value):
    if isinstance(value, torch.Tensor) and not binding.is_standin(value):
        return value.clone()
    return value


def warm_up(
    model: torch.nn.Module,
    runtime,
    *,
    buckets: Sequence[Bucket] | None = None,
    capture: bool | str = "auto",
    fallback: str = "error",
    progress: bool = True,
    install: bool = True,
) -> CapturedBlocks:
    """Warm up (compile, and capture on CUDA) every bucket of a reference model's compiled blocks.

    `buckets` default to the runtime's configured ones, or to the family's defaults (DreamZero:
    `dreamzero_buckets(cfg)`).
    The blocks must already be compiled with backend="paged_kv" and bound to `runtime`. Returns the
    `CapturedBlocks` (installed into the model unless install=False); its `.report` has the timings.
    """
    blocks, inputs, family = model_blocks_and_inputs(model, runtime)
    if buckets is None and not runtime.config.buckets:
        buckets = families.get(family).default_buckets(model.cfg)
    captured = CapturedBlocks(blocks, runtime, inputs, buckets=buckets, capture=capture, fallback=fallback)
    captured.warmup(progress=progress)
    if install:
        captured.install()
    return captured
