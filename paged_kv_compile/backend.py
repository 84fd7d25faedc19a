"""The `paged_kv` torch.compile backend.

``torch.compile(block, backend="paged_kv", fullgraph=True, options={...})``. It rewrites a copy of
dynamo's graph (passes/), appends the pool and the metadata as extra inputs, hands the graph to the
inner compiler, and returns a callable that supplies those inputs for the layer that is calling,
found from the site's projection weight (binding.py). With no cache stand-in among the inputs it is
the inner compiler alone.

Options (``options=`` of torch.compile; defaults come from the bound runtime's config):
  kernel: "auto" | "reference" | "triton" | "flash_attn" | "npu"
  inner_compiler: "inductor" | "aot_eager" | "eager"
  strict: raise on a KV-cache site that cannot be rewritten (default: warn, then reject the graph)
  dump_dir: write the graph before/after the passes and the pass report there (see debug.py)
  check_mask: debug: at every call, check the model's dense mask against the runtime's layout
    (kv_visible_end) and raise on a mismatch. Costs a host sync per site: never in production.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from . import binding, families, forward_context, layout
from .capture import calls
from .config import INNER_COMPILERS, KERNELS, Bucket
from .errors import BindingError, ConfigError, RequestError
from .ops import write_attend as write_attend_op
from .passes.extra_inputs import extra_values
from .passes.rewrite import PassResult, rewrite

OPTION_NAMES = ("kernel", "inner_compiler", "strict", "dump_dir", "check_mask")

_RECORDERS: list[list[PassResult]] = []  # the open `record_passes()` blocks, innermost last


@contextlib.contextmanager
def record_passes() -> Iterator[list[PassResult]]:
    """Collect the pass result of every graph the backend compiles inside the block (the demo, the tests).

    Each compiled paged function also keeps its own as `fn.pass_result`.
    """
    got: list[PassResult] = []
    _RECORDERS.append(got)
    try:
        yield got
    finally:
        _RECORDERS.remove(got)


def _record(result: PassResult) -> PassResult:
    for recorder in _RECORDERS:
        recorder.append(result)
    return result


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """Copy dynamo's graph: dynamo still reads its own placeholders after the backend returns."""
    graph = fx.Graph()
    value_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, value_map)
    graph.output(out)
    for old, new in value_map.items():
        if old.op == "placeholder":
            new._dynamo_source = getattr(old, "_dynamo_source", None)
        new.meta = copy.copy(old.meta)
    new_gm = fx.GraphModule(gm, graph)
    new_gm.meta = copy.copy(getattr(gm, "meta", {}))
    for attr in ("_param_name_to_source",):
        if hasattr(gm, attr):
            setattr(new_gm, attr, getattr(gm, attr))
    return new_gm


def inner_compile(name: str, gm: fx.GraphModule, example_inputs: list) -> Callable:
    """Compile `gm` with the inner compiler `name` ("inductor", "aot_eager" or "eager"), as this backend hands a
    graph on; also what a dense model compiled for comparison gets (the benchmarks, `counting.CountingBackend`)."""
    if name == "eager":
        return gm.forward
    if name == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    raise ConfigError(f"unknown inner_compiler {name!r}; choose one of {', '.join(INNER_COMPILERS)}")


def _resolve_options(options: dict | None, runtime) -> dict:
    options = dict(options or {})
    unknown = set(options) - set(OPTION_NAMES)
    if unknown:
        raise ConfigError(f"unknown paged_kv option(s) {sorted(unknown)}; valid: {', '.join(OPTION_NAMES)}")
    cfg = runtime.config if runtime is not None else None
    resolved = {
        "kernel": options.get("kernel", cfg.kernel if cfg else "auto"),
        "inner_compiler": options.get("inner_compiler", cfg.inner_compiler if cfg else "inductor"),
        "strict": bool(options.get("strict", cfg.strict if cfg else False)),
        "dump_dir": options.get("dump_dir", cfg.dump_dir if cfg else None),
        "check_mask": bool(options.get("check_mask", False)),
    }
    if resolved["kernel"] not in KERNELS:
        raise ConfigError(f"unknown kernel {resolved['kernel']!r}; choose one of {', '.join(KERNELS)}")
    if resolved["inner_compiler"] not in INNER_COMPILERS:
        raise ConfigError(
            f"unknown inner_compiler {resolved['inner_compiler']!r}; choose one of {', '.join(INNER_COMPILERS)}"
        )
    return resolved


def _runtime_of_inputs(example_inputs: list):
    """The runtime bound to any parameter among the inputs (None when nothing is bound)."""
    for value in example_inputs:
        if isinstance(value, torch.nn.Parameter):
            try:
                return binding.resolve(value)[0]
            except BindingError:
                continue
    return None


def _nothing_to_page(result: PassResult) -> str:
    """Why a compiled graph has no paged site, in the words of its pass report."""
    left = [r for r in result.reports if r.status != "rewritten"]
    if not left:
        return ("no attention in them reads or writes a KV-cache stand-in (e.g. a first chunk whose cache is empty "
                "attends over its new tokens only and writes no cache in this forward)")
    return "their attention sites were not paged (" + "; ".join(f"{r.node}: {r.reason}" for r in left) + ")"


def _unpaged_callable(compiled: Callable, result: PassResult) -> Callable:
    """`compiled`, reporting its calls to the open forwards (`ops.write_attend.report_call`) so that a forward that
    pages nothing names the cause."""
    why = _nothing_to_page(result)

    def unpaged_compiled_forward(*args):
        write_attend_op.report_call(why)
        return compiled(*args)

    unpaged_compiled_forward.pass_result = result
    return unpaged_compiled_forward


def paged_kv_backend(gm: fx.GraphModule, example_inputs: list, options: dict | None = None, **_: Any) -> Callable:
    """torch.compile backend: rewrite KV-cache attention into the paged op, then compile."""
    runtime = _runtime_of_inputs(example_inputs)
    opts = _resolve_options(options, runtime)
    if not any(binding.is_standin(v) for v in example_inputs):
        result = _record(rewrite(gm, example_inputs, is_standin=binding.is_standin))
        return _unpaged_callable(inner_compile(opts["inner_compiler"], gm, example_inputs), result)

    from .debug import maybe_dump

    new_gm = _copy_graph_module(gm)
    before = new_gm.print_readable(print_output=False)
    fp8 = runtime is not None and runtime.pool.scales is not None
    gaps = runtime is None or runtime.config.kv_gaps
    result = rewrite(new_gm, example_inputs, is_standin=binding.is_standin, kernel=opts["kernel"], strict=opts["strict"],
                     kv_scales=fp8, kv_gaps=gaps, is_region=binding.is_region_standin, idioms=families.accepted_idioms())
    _record(result)
    maybe_dump(opts["dump_dir"], before, result)
    if not result.changed:
        return _unpaged_callable(inner_compile(opts["inner_compiler"], new_gm, example_inputs), result)
    if runtime is None:
        raise BindingError(
            "this graph reads KV-cache stand-ins but no live runtime has bound its weights: call runtime.bind(layers) "
            "with this model's layers before the first forward"
        )
    rows, tokens, context = result.shape
    bucket = Bucket(rows, tokens, context)
    meta = runtime.metadata.buffers(bucket)
    if result.region_tokens and meta.region_width * runtime.pool.block_size < result.region_tokens:
        raise ConfigError(
            f"this graph reads a shared region of {result.region_tokens} tokens but the runtime's metadata holds "
            f"{meta.region_width * runtime.pool.block_size}: set region_tokens={result.region_tokens} in the config "
            "(the family's runtime config sets it with cross_regions=N)")
    layers = [binding.resolve(example_inputs[site.weight_input])[1] for site in result.sites]
    extras = extra_values(result.inputs, runtime.pool, meta, layers)
    compiled = inner_compile(opts["inner_compiler"], new_gm, list(example_inputs) + extras)
    masks = [(s.mask_input, s.mask_replay) for s in result.sites] if opts["check_mask"] else []
    if opts["check_mask"] and any(index is None for index, _ in masks):
        raise ConfigError("check_mask: a site's mask is computed inside the graph, not passed in; it cannot be checked")
    return _paged_callable(compiled, result, bucket, _pool_geometry(runtime), masks)


def _check_write_positions(active, writes: list[tuple[torch.Tensor, int | None]], seen: dict) -> None:
    """The dense columns a static-cache site writes (its position_ids) must be the layout's (else refused).

    Checked on the host once per forward and input tensor (every layer reads the same position_ids): `seen`
    remembers what was checked in the runtime's current forward (its generation). A warm-up or capture forward
    (`runtime.warmup_forward`: a plan without rows, all-padding metadata) writes and reads nothing, so there is no
    layout to check its example positions against (without it a per-row write refused every warm-up)."""
    plan = active.plan
    if not plan.rows:
        return
    if seen.get("generation") != (id(active), active.generation):
        seen.clear()
        seen["generation"] = (id(active), active.generation)
    for positions, row in writes:
        key = (positions.data_ptr(), positions._version, tuple(positions.shape), positions.stride(), row)
        if key in seen:
            continue
        for r in range(len(plan.rows)) if row is None else [row]:
            if r >= len(plan.rows):
                raise RequestError(f"a static-cache write for row {r} but the forward has {len(plan.rows)} rows")
            keys = plan.key_positions[r] if plan.key_positions else None
            why = layout.write_positions_problem(plan.rows[r], keys, positions)
            if why:
                raise RequestError(
                    f"row {r}: the model writes its new keys/values into its static cache at position_ids that "
                    f"disagree with the layout read from the prefill mask ({why}); the forward was refused. Pass the "
                    "position_ids the pipeline derives from that mask (prefill: arange(S); steps: the target's "
                    "prefill positions) and prefix_capacity = the static cache length"
                )
        seen[key] = True


def _pool_geometry(runtime) -> tuple:
    """What a compiled graph assumes of the pool: its shape and dtype."""
    return (*runtime.pool.tensor.shape, runtime.pool.tensor.dtype)


def _paged_callable(compiled: Callable, result: PassResult, bucket: Bucket, pool_shape: tuple,
                    mask_inputs: list[tuple[int, Callable]]) -> Callable:
    """The function dynamo calls: its host checks, then the inner graph with the pool and the calling layer's
    metadata views appended.

    Two parts, because a CUDA-graph replay runs only the second: `host_checks(args) -> (runtime, layers)` is
    every per-call check and changes nothing; the captured path runs it on the recorded arguments before each
    replay (`capture/calls.py`). A plain function (not a callable object), so tools that read `__code__` (depyf)
    can name it.
    """
    weight_inputs = [s.weight_input for s in result.sites]
    write_checks = [check for s in result.sites for check in s.write_checks]
    checked: dict = {}
    layer_keys = [s.layer_key for s in result.sites]
    expect, idiom = result.expect, result.idiom
    region_tokens = result.region_tokens
    inputs = result.inputs  # the inputs the rewrite added, described once (passes/extra_inputs.py)

    def host_checks(args) -> tuple:
        """Which runtime and layers these arguments serve, after every check the call promises."""
        runtime = None
        layers = []
        for index, key in zip(weight_inputs, layer_keys):
            site_runtime, layer = binding.resolve(args[index])
            if runtime is not None and site_runtime is not runtime:
                raise BindingError(f"the sites of one graph are bound to different runtimes (at {key})")
            runtime = site_runtime
            layers.append(layer)
        active = forward_context.require(runtime.active)
        if active.bucket != bucket:
            raise RequestError(
                f"this graph was compiled for bucket {bucket} but the active forward is bucket "
                f"{active.bucket}: the model's inputs do not match the runtime's plan (stale metadata?)"
            )
        active.check_expectation(expect, idiom)
        if region_tokens:
            active.check_regions(region_tokens)
        if _pool_geometry(runtime) != pool_shape:
            raise RequestError("this graph was compiled against another pool geometry; compile again for this runtime "
                               "(shape and dtype must match: an FP8 pool adds its scales as an input)")
        if active.plan.rows:  # a warm-up forward (no rows, nothing visible) has no layout to compare a mask with
            for index, replay in mask_inputs:
                active.check_dense_mask(replay(args[index]))
        if write_checks:
            _check_write_positions(active, [(replay(args[index]), row) for index, replay, row in write_checks], checked)
        return runtime, layers

    def paged_kv_compiled_forward(*args):
        runtime, layers = host_checks(args)
        active = runtime.active  # the forward these arguments serve (`forward_context.ForwardContext`)
        active.record_layers(layers)
        extras = extra_values(inputs, runtime.pool, active.meta, layers)
        out = compiled(*args, *extras)
        if calls.recording():
            calls.report(calls.PagedCall(paged_kv_compiled_forward, args, runtime, tuple(layers), tuple(extras), out))
        return out

    paged_kv_compiled_forward.pass_result = result
    paged_kv_compiled_forward.bucket = bucket
    paged_kv_compiled_forward.host_checks = host_checks
    paged_kv_compiled_forward.compiled = compiled
    return paged_kv_compiled_forward
