"""`CapturedBlocks`: a model's compiled blocks, warmed up per bucket and replayed as CUDA graphs.

What a block call reads lives in static buffers (`capture/static.py`); graphs are captured by a
backend (`capture/graphs.py`); warm-up timings are reported by `capture/report.py`. The example
inputs of one block call come from the caller or from the model's family (`families/`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
import warnings
from typing import Callable, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree

from .. import binding, families, forward_context
from ..config import Bucket
from ..errors import CaptureError, ConfigError, RequestError
from .calls import record_calls
from .forward_graph import GRANULARITIES, ForwardGraph
from .graphs import CompiledOnlyGraphs, CudaGraphs, EmulatedGraphs
from .report import BucketWarmup, WarmupReport, format_bucket, progress_bar, unique_graphs
from .static import BucketState, copy_out

FALLBACKS = ("error", "eager")

#: example_inputs(bucket) -> (args, kwargs) of ONE block call of that bucket (the same for every block).
ExampleInputs = Callable[[Bucket], "tuple[tuple, dict]"]


def model_blocks_and_inputs(model, runtime) -> tuple[torch.nn.ModuleList, ExampleInputs, str]:
    """The block list, the example-input factory and the family name of a reference model."""
    family = families.for_model(model)
    return family.blocks(model), functools.partial(family.example_inputs, model, runtime), family.name


class _CapturedBlock(torch.nn.Module):
    """Stands in a ModuleList for one compiled block; its parameters are the block's own."""

    def __init__(self, captured: "CapturedBlocks", index: int, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block
        object.__setattr__(self, "_captured", captured)
        object.__setattr__(self, "_index", index)

    def forward(self, *args, **kwargs):
        return self._captured._call(self._index, args, kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # a model may read a block's submodule (block.cross_attn)
            if name.startswith("__") or "_modules" not in self.__dict__:
                raise
            return getattr(self._modules["block"], name)


class CapturedBlocks:
    """The compiled blocks of one model, warmed up per bucket and (on CUDA) captured as CUDA graphs.

    blocks: the model's ModuleList of compiled blocks (bound to `runtime`); example_inputs(bucket)
    gives the (args, kwargs) of one block call of that bucket. capture: "auto" (CUDA graphs when the
    pool is on a CUDA device), True or False. fallback: "error" (a forward of a bucket that was not
    warmed up raises) or "eager" (it runs uncaptured, compiling that shape once, with a warning).
    granularity: "block" (one graph per block and bucket: blocks in any order) or "forward" (one graph per
    bucket over every block in the model's order, one copy-in and one launch per forward:
    `capture/forward_graph.py` says what it costs).
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
        graphs: CudaGraphs | EmulatedGraphs | CompiledOnlyGraphs | None = None,
        granularity: str = "block",
    ) -> None:
        if fallback not in FALLBACKS:
            raise ConfigError(f"unknown fallback {fallback!r}; choose one of {', '.join(FALLBACKS)}")
        if granularity not in GRANULARITIES:
            raise ConfigError(f"unknown granularity {granularity!r}; choose one of {', '.join(GRANULARITIES)}")
        self.granularity = granularity
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
                "(each family module's <family>_buckets builds them)"
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
        runtime.allow_unconfigured_buckets(fallback == "eager")
        self.warmup_iters = warmup_iters
        self._states: dict[Bucket, BucketState] = {}
        self._warned: set = set()
        self._installed = False
        self.report: WarmupReport | None = None
        # replays: graph launches (per block, or per forward with granularity="forward", whose other block calls
        # count in forward_served); checks: recorded host checks run before launches
        self.stats = {"replays": 0, "checks": 0, "forward_served": 0, "direct_calls": 0, "copies": 0,
                      "copies_skipped": 0, "fallback_calls": 0, "fallback_compiles": 0}
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
        bar = progress_bar(len(self.buckets), progress)
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
        kind = "none" if not self.capture else {CudaGraphs: "cuda", CompiledOnlyGraphs: "compiled-only"}.get(
            type(self.graphs), "emulated")
        self.report = WarmupReport(timings, self.capture, time.perf_counter() - start, kind)
        return self.report

    def _prepare(self, bucket: Bucket) -> BucketState:
        args, kwargs = self.example_inputs(bucket)
        return BucketState.prepare(bucket, args, kwargs)

    def _static_call(self, state: BucketState, index: int):
        args, kwargs = pytree.tree_unflatten(state.static_leaves(), state.spec)
        return self.blocks[index](*args, **kwargs)

    def _warm_bucket(self, bucket: Bucket) -> BucketWarmup:
        t0 = time.perf_counter()
        graphs0 = unique_graphs()
        state = self._prepare(bucket)
        buffers = [s.buffer for s in state.slots if s.buffer is not None]
        versions = [b._version for b in buffers]
        with torch.no_grad(), self.runtime.warmup_forward(bucket) as active:
            seen = getattr(active, "layers_seen", None)
            served: dict[int, set] = {}  # block index -> layers its paged sites served
            for i in range(len(self.blocks)):
                before = set(seen) if seen is not None else set()
                args, kwargs = pytree.tree_unflatten(state.static_leaves(), state.spec)
                out = self.blocks[i](*args, **kwargs)
                served[i] = (set(seen) - before) if seen is not None else set()
                changed = state.changed(args, kwargs)
                if changed:
                    raise CaptureError(
                        f"block {i} changes its arguments' Python state while it runs ({changed} after the call): a "
                        "captured call cannot (a replay runs no Python, and the block gets copies of the caller's "
                        "containers). Pass such state (e.g. a cache dict's fill state) in as arguments and keep it in "
                        "the caller")
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
            missing = [i for i, layers in served.items() if not layers]
            if missing:
                raise CaptureError(
                    f"blocks {missing} ran no paged attention site in the warm-up forward of {bucket}: compile them "
                    "with block.compile(backend='paged_kv', fullgraph=True, dynamic=False) and bind the runtime to "
                    "them (runtime.bind) before warming up; uncompiled blocks would read empty KV-cache stand-ins"
                )
        compile_s = time.perf_counter() - t0
        graphs = unique_graphs() - graphs0
        capture_s = self._capture(state) if self.capture else 0.0
        self._states[bucket] = state
        return BucketWarmup(bucket, compile_s, capture_s, graphs, len(state.graphs) + (state.forward is not None))

    def _capture(self, state: BucketState) -> float:
        """One graph per block for this bucket, all in the shared pool; outputs go to static buffers. With
        granularity="forward", one graph over every block instead (`ForwardGraph`).

        The compiled paged calls each block's capture made are kept (`state.calls`): a captured call runs their
        host checks before its replay."""
        t0 = time.perf_counter()
        graphs, n = self.graphs, len(self.blocks)
        inputs = [s.buffer for s in state.slots if s.buffer is not None]
        with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"), \
                self.runtime.warmup_forward(state.bucket):
            if self.granularity == "forward":
                state.forward = ForwardGraph(state, self.blocks)
                state.forward.capture(graphs, self.warmup_iters)
                state.out_buffers = state.forward.kept()
                graphs.synchronize()
                return time.perf_counter() - t0
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

                with record_calls() as made:
                    graph, got = graphs.capture(lambda i=i: pytree.tree_leaves(self._static_call(state, i)),
                                                targets, inputs)
                state.graphs[i] = graph
                state.calls[i] = made
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
        active = forward_context.require(self.runtime.active)
        bucket = active.bucket
        state = self._states.get(bucket)
        if state is None:
            return self._fallback(
                index, bucket, args, kwargs,
                f"bucket {bucket} was not warmed up (warmed up: {self.warmed_buckets})",
                "add it to the runtime's configured buckets and warm up again",
            )
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if state.forward is not None:
            return self._forward_call(index, state, leaves, spec, args, kwargs, active.generation)
        why = state.mismatch(leaves, spec)
        if why:
            return self._fallback(index, bucket, args, kwargs, f"block {index}'s call for {bucket}: {why}",
                                  "call the blocks exactly as the model's loop does at warm-up")
        state.copy_in(leaves, self.stats, active.generation)
        if state.graphs:
            layers = self._host_checks(state.calls[index])  # on the static buffers, which now hold this call
            state.graphs[index].replay()
            active.record_layers(layers)  # the compiled function's Python did not run: record what it served
            self.stats["replays"] += 1
            return pytree.tree_map(copy_out, state.outputs[index])
        self.stats["direct_calls"] += 1
        call_args, call_kwargs = pytree.tree_unflatten(state.call_leaves(leaves), state.spec)
        with torch.compiler.set_stance("fail_on_recompile"):
            return self.blocks[index](*call_args, **call_kwargs)

    def _forward_call(self, index: int, state: BucketState, leaves: list, spec, args: tuple, kwargs: dict,
                      generation: int):
        """granularity="forward": block 0 copies in, checks every block and launches; later blocks are served."""
        graph = state.forward
        if index == 0:
            why = state.mismatch(leaves, spec)
            if not why:
                state.copy_in(leaves, self.stats, generation)
                graph.launch(leaves, generation, self._host_checks)
                self.stats["replays"] += 1
        else:
            why = graph.follows(index, leaves, spec, generation)
        if why:
            graph.launch_state = None  # the rest of this forward is not the captured one either
            return self._fallback(index, state.bucket, args, kwargs, f"block {index}'s call for {state.bucket}: {why}",
                                  "call the blocks exactly as the model's loop does at warm-up")
        out, layers = graph.serve(index)
        self.runtime.active.record_layers(layers)
        self.stats["forward_served"] += 1
        return out

    def _host_checks(self, made: list) -> list[int]:
        """Every check the recorded compiled calls make per call, before a replay; the layers they serve.

        A check that fails raises here, before anything ran: the runtime rolls the forward back as it would an
        uncaptured call's failure."""
        layers: list[int] = []
        for call in made:
            layers += call.check(self.runtime)
            self.stats["checks"] += 1
        return layers

    def _fallback(self, index: int, bucket: Bucket, args: tuple, kwargs: dict, why: str, fix: str):
        if self.fallback == "error":
            raise RequestError(f"{why}; {fix}, or build CapturedBlocks(fallback='eager') to run it uncaptured")
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"paged_kv capture: {why}; running it uncaptured (this shape compiles once now)",
                          stacklevel=4)
        self.stats["fallback_calls"] += 1
        self.fallback_buckets.add(bucket)
        before = unique_graphs()
        with torch.compiler.set_stance("default"):
            out = self.blocks[index](*args, **kwargs)
        self.stats["fallback_compiles"] += unique_graphs() - before
        return out

    # ---- introspection ----------------------------------------------------------------------------
    def addresses(self) -> dict[str, tuple[int, ...]]:
        """Every address a captured graph reads or writes: pool, metadata, stand-ins, static buffers."""
        out = {"pool": (self.runtime.pool.tensor.data_ptr(),)}
        for bucket, state in sorted(self._states.items()):
            name = format_bucket(bucket)
            out[f"metadata {name}"] = self.runtime.metadata.buffers(bucket).addresses()
            out[f"inputs {name}"] = state.addresses()
            out[f"outputs {name}"] = tuple(t.data_ptr() for t in state.out_buffers)
        return out

    def static_bytes(self) -> int:
        """Bytes of the static input/output buffers of every bucket (the pool and metadata excluded)."""
        return sum(state.static_bytes() for state in self._states.values())


def warm_up(
    model: torch.nn.Module,
    runtime,
    *,
    buckets: Sequence[Bucket] | None = None,
    capture: bool | str = "auto",
    fallback: str = "error",
    progress: bool = True,
    install: bool = True,
    granularity: str = "block",
) -> CapturedBlocks:
    """Warm up (compile, and capture on CUDA) every bucket of a reference model's compiled blocks.

    `buckets` default to the runtime's configured ones, or to the family's defaults (`Family.default_buckets`).
    The blocks must already be compiled with backend="paged_kv" and bound to `runtime`. Returns the
    `CapturedBlocks` (installed into the model unless install=False); its `.report` has the timings.
    """
    blocks, inputs, family = model_blocks_and_inputs(model, runtime)
    if buckets is None and not runtime.config.buckets:
        buckets = families.get(family).default_buckets(model.cfg)
    captured = CapturedBlocks(blocks, runtime, inputs, buckets=buckets, capture=capture, fallback=fallback,
                              granularity=granularity)
    captured.warmup(progress=progress)
    if install:
        captured.install()
    return captured
