"""The ``paged_kv::write_attend`` and ``paged_kv::attend`` custom ops: schema, fake kernel, checks, dispatch.

``write_attend`` mutates exactly one argument, the stacked all-layer pool, so Inductor re-inplaces it
instead of cloning the pool (README.md, "Words used here": pool; tests/test_op_compile.py checks the generated code).
``attend`` is the read-only twin for static regions. Kernels live in sibling modules and are imported
only when selected: importing this module pulls in neither triton nor any vendor package.

``visibility`` is a hint about the ``kv_visible_end`` pattern that vendor kernels need and cannot
check without a host sync: "full" (every query that sees anything sees [0, seq_len)), "causal"
(bottom-right causal: query t sees [0, seq_len - T + t + 1)), or "general" (anything). The reference
and triton kernels read ``kv_visible_end`` and ignore the hint; flash_attn and npu trust it, so a wrong
hint on their devices gives wrong attention. With CPU tensors and ``CHECK_VALUES`` it is verified.

``kv_scales`` (``KVPool.scales``, float32 ``[2, N, Hkv]``) goes with an FP8 pool and only with one:
the op quantizes the new K/V into the pool and dequantizes what attention reads (ops/fp8.py). The
scales are read, never written, so the pool stays the one mutated argument.

``kv_gap`` (int32 ``[R, 2]``, optional) hides a span of each row's logical keys: p with
``kv_gap[r, 0] <= p < kv_gap[r, 1]`` is not visible. It lets a row's visible keys start and end inside
blocks: a recent window that starts ``o`` tokens into its first block is the gap ``(0, o)``; a sink of
S tokens followed by such a window is ``(S, ceil(S / B) * B + o)``; no gap is ``(0, 0)`` or None.
Query (r, t) sees p iff ``p < min(kv_visible_end[r, t], seq_lens[r])`` and p is not in the gap.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import numpy as np
import torch

from ..config import KERNELS
from ..errors import KernelUnavailableError, OpInputError
from . import kernels
from .fp8 import is_fp8, row_scales

#: Value-range checks read tensors on the host. They run only when the inputs are on the CPU; a caller
#: that wants no host work even there (benchmarks) sets this to False.
CHECK_VALUES = True

VISIBILITIES = ("general", "full", "causal")

_LAYOUTS = {
    "query": (4, "[R, T, Hq, D]"),
    "key": (4, "[R, T, Hkv, D]"),
    "value": (4, "[R, T, Hkv, D]"),
    "kv_pool": (5, "[2, N, B, Hkv, D]"),
    "slot_mapping": (2, "[R, T]"),
    "block_table": (2, "[R, M]"),
    "seq_lens": (1, "[R]"),
    "kv_visible_end": (2, "[R, T]"),
    "kv_gap": (2, "[R, 2]"),
}
_INT_DTYPES = {
    "slot_mapping": torch.int64, "block_table": torch.int32, "seq_lens": torch.int32, "kv_visible_end": torch.int32,
    "kv_gap": torch.int32,
}


def validate_inputs(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_pool: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_visible_end: torch.Tensor,
    kernel: str = "auto",
    visibility: str = "general",
    kv_scales: torch.Tensor | None = None,
    kv_gap: torch.Tensor | None = None,
) -> None:
    """Shape, dtype, device and option checks: no host sync, so they also run on fake tensors.

    ``key``, ``value`` and ``slot_mapping`` are None for the read-only ``attend``; ``kv_gap`` None means no gap.
    """
    if kernel not in KERNELS:
        raise OpInputError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if visibility not in VISIBILITIES:
        raise OpInputError(f"unknown visibility {visibility!r}; choose one of {', '.join(VISIBILITIES)}")
    args = {
        "query": query, "key": key, "value": value, "kv_pool": kv_pool, "slot_mapping": slot_mapping,
        "block_table": block_table, "seq_lens": seq_lens, "kv_visible_end": kv_visible_end, "kv_gap": kv_gap,
    }
    args = {name: t for name, t in args.items() if t is not None}
    for name, t in args.items():
        rank, layout = _LAYOUTS[name]
        if t.dim() != rank:
            raise OpInputError(f"{name} must have rank {rank} {layout}, got shape {tuple(t.shape)}")
    if not query.dtype.is_floating_point or is_fp8(query.dtype):
        raise OpInputError(f"query must be a floating dtype (a compute dtype, not FP8), got {query.dtype}")
    _check_scales(kv_pool, kv_scales, query.device)
    for name in ("key", "value") + (() if is_fp8(kv_pool.dtype) else ("kv_pool",)):
        if name in args and args[name].dtype != query.dtype:
            raise OpInputError(
                f"{name} is {args[name].dtype} but query is {query.dtype}; query, key, value and kv_pool must "
                "share one float dtype: cast them to the pool's dtype"
            )
    for name, dtype in _INT_DTYPES.items():
        if name in args and args[name].dtype != dtype:
            raise OpInputError(f"{name} must be {dtype}, got {args[name].dtype}; convert it with .to({dtype})")
    for name, t in args.items():
        if t.device != query.device:
            raise OpInputError(
                f"{name} is on {t.device} but query is on {query.device}; move every op input to one device"
            )
    _check_shapes(query, key, value, kv_pool, slot_mapping, block_table, seq_lens, kv_visible_end)
    if kv_gap is not None and tuple(kv_gap.shape) != (query.shape[0], 2):
        raise OpInputError(
            f"kv_gap has shape {tuple(kv_gap.shape)}, expected [R, 2] = {(query.shape[0], 2)}: one (start, end) "
            "of hidden keys per row, (0, 0) for a row without a gap"
        )


def _check_scales(kv_pool: torch.Tensor, kv_scales: torch.Tensor | None, device: torch.device) -> None:
    if not is_fp8(kv_pool.dtype):
        if kv_scales is not None:
            raise OpInputError(
                f"kv_scales were given but kv_pool stores {kv_pool.dtype}: scales go with an FP8 pool only; "
                "pass kv_scales=None"
            )
        return
    want = (2, kv_pool.shape[1], kv_pool.shape[3]) if kv_pool.dim() == 5 else None
    if kv_scales is None:
        raise OpInputError(
            f"kv_pool stores {kv_pool.dtype} and needs kv_scales, float32 [2, N, Hkv] = {want}: pass KVPool.scales"
        )
    if kv_scales.dtype != torch.float32 or tuple(kv_scales.shape) != want or kv_scales.device != device:
        raise OpInputError(
            f"kv_scales must be float32 {want} [2, N, Hkv] on {device}, got {kv_scales.dtype} "
            f"{tuple(kv_scales.shape)} on {kv_scales.device}: pass KVPool.scales"
        )


def _check_shapes(query, key, value, kv_pool, slot_mapping, block_table, seq_lens, kv_visible_end) -> None:
    R, T, Hq, D = query.shape
    two, _, _, Hkv, pool_d = kv_pool.shape
    if two != 2:
        raise OpInputError(f"kv_pool's first dim must be 2 (K, V), got shape {tuple(kv_pool.shape)}")
    if not kv_pool.is_contiguous():
        raise OpInputError(
            "kv_pool must be contiguous: the op addresses it as flat slots; pass the KVPool tensor itself"
        )
    if D != pool_d:
        raise OpInputError(
            f"head_dim mismatch: query has D={D}, kv_pool has D={pool_d}; both must use the model's head_dim"
        )
    if Hq % Hkv:
        raise OpInputError(
            f"query heads Hq={Hq} are not a multiple of the pool's kv heads Hkv={Hkv} (GQA needs Hq % Hkv == 0)"
        )
    for name, t in (("key", key), ("value", value)):
        if t is not None and tuple(t.shape) != (R, T, Hkv, D):
            raise OpInputError(
                f"{name} has shape {tuple(t.shape)}, expected [R, T, Hkv, D] = {(R, T, Hkv, D)} from query and "
                "kv_pool (pool Hkv/D must match the key's)"
            )
    expected = {"slot_mapping": (R, T), "kv_visible_end": (R, T), "seq_lens": (R,)}
    for name, t in (("slot_mapping", slot_mapping), ("kv_visible_end", kv_visible_end), ("seq_lens", seq_lens)):
        if t is not None and tuple(t.shape) != expected[name]:
            raise OpInputError(f"{name} has shape {tuple(t.shape)}, expected {expected[name]} (R, T from query)")
    if block_table.shape[0] != R or block_table.shape[1] < 1:
        raise OpInputError(
            f"block_table has shape {tuple(block_table.shape)}, expected [R={R}, M>=1]; pad unused entries with a "
            "valid block id such as the pool's pad block"
        )


def check_values(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_visible_end: torch.Tensor,
    visibility: str = "general",
    kv_gap: torch.Tensor | None = None,
) -> None:
    """Range checks on the metadata's values; they read tensors on the host (CPU use only).

    Valid values (every call the runtime makes) are confirmed with numpy on the host (`_values_ok`, ~60 us);
    the torch checks below, which name the first bad entry, run only when that finds something (they cost
    about 220 us a call at DreamZero's sizes, a few percent of a CPU attention)."""
    if _values_ok(query, kv_pool, slot_mapping, block_table, seq_lens, kv_visible_end, visibility, kv_gap):
        return
    _, N, B, _, _ = kv_pool.shape
    M, T = block_table.shape[1], query.shape[1]
    if slot_mapping is not None:
        _first_bad("slot_mapping", slot_mapping, (slot_mapping < -1) | (slot_mapping >= N * B),
                   f"outside [-1, N*B={N * B}): a slot is block * block_size + offset into the pool, "
                   "-1 means do not write")
        written = slot_mapping[slot_mapping >= 0]
        if written.unique().numel() != written.numel():
            dup = written.sort().values
            dup = dup[1:][dup[1:] == dup[:-1]][0].item()
            raise OpInputError(f"slot_mapping writes slot {dup} twice; every new token needs its own slot")
    _first_bad("block_table", block_table, (block_table < 0) | (block_table >= N),
               f"outside [0, N={N}): pad unused entries with a valid id such as the pad block {N - 1}")
    _first_bad("seq_lens", seq_lens, (seq_lens < 0) | (seq_lens > M * B),
               f"outside [0, M*B={M * B}], the block table's capacity: widen block_table or shorten the row")
    seq = seq_lens.view(-1, 1)
    _first_bad("kv_visible_end", kv_visible_end, (kv_visible_end < 0) | (kv_visible_end > seq),
               "outside [0, seq_lens[r]]: a query can see only the row's valid keys (0 for padded queries)")
    if visibility != "general":
        t = torch.arange(T, dtype=seq.dtype)
        want = seq.expand(-1, T) if visibility == "full" else seq - T + t + 1
        _first_bad("kv_visible_end", kv_visible_end, (kv_visible_end > 0) & (kv_visible_end != want),
                   f"not what the visibility={visibility!r} hint promises; pass visibility='general'")
    if kv_gap is not None:
        _check_gap_values(kv_gap, seq_lens, kv_visible_end, visibility)


def _check_gap_values(kv_gap, seq_lens, kv_visible_end, visibility) -> None:
    """``0 <= kv_gap[r, 0] <= kv_gap[r, 1] <= seq_lens[r]``, and what a causal hint promises with a gap."""
    start, end = kv_gap[:, 0], kv_gap[:, 1]
    for bad, why in (
        (start < 0, "a negative start: a gap is a span [start, end) of the row's logical keys, (0, 0) for no gap"),
        (end < start, "an end below its start: pass (start, end) with start <= end, (0, 0) for no gap"),
        (end > seq_lens, "an end past seq_lens[r]: a gap hides keys the row holds; clip it to the row's length"),
    ):
        if bool(bad.any()):
            r = int(bad.nonzero()[0, 0])
            raise OpInputError(
                f"kv_gap[{r}] = {tuple(kv_gap[r].tolist())} (seq_lens[{r}] = {int(seq_lens[r])}) has {why}"
            )
    if visibility == "causal":
        before_gap = (end > start).view(-1, 1) & (kv_visible_end < start.view(-1, 1))
        _first_bad("kv_visible_end", kv_visible_end, (kv_visible_end > 0) & before_gap,
                   "below its row's kv_gap start: with visibility='causal' and a gap, a query that sees anything must "
                   "see every key before the gap (a sink); pass visibility='general'")


def _values_ok(query, kv_pool, slot_mapping, block_table, seq_lens, kv_visible_end, visibility, kv_gap=None) -> bool:
    """Whether `check_values` would pass, decided on numpy views of the host tensors; False also when a tensor
    has no numpy view (the caller then runs the torch checks, which decide and name the problem)."""
    try:
        table, seq, vis = (t.numpy() for t in (block_table, seq_lens, kv_visible_end))
        slots = None if slot_mapping is None else slot_mapping.numpy()
    except (RuntimeError, TypeError):  # a tensor that needs grad, a subclass: no view
        return False
    _, N, B, _, _ = kv_pool.shape
    M, T = table.shape[1], query.shape[1]
    if slots is not None and slots.size:
        if slots.min() < -1 or slots.max() >= N * B:
            return False
        ordered = np.sort(slots, axis=None)
        ordered = ordered[np.searchsorted(ordered, 0):]  # the written slots (-1: no write)
        if bool((ordered[1:] == ordered[:-1]).any()):
            return False
    if table.size and (table.min() < 0 or table.max() >= N):
        return False
    if seq.size and (seq.min() < 0 or seq.max() > M * B):
        return False
    ends = seq.reshape(-1, 1)
    if vis.size and (vis.min() < 0 or bool((vis > ends).any())):
        return False
    if visibility != "general":
        want = ends if visibility == "full" else ends - T + np.arange(T, dtype=ends.dtype) + 1
        if bool(((vis > 0) & (vis != want)).any()):
            return False
    if kv_gap is not None:
        try:
            gap = kv_gap.numpy()
        except (RuntimeError, TypeError):
            return False
        start, end = gap[:, :1], gap[:, 1:]
        if gap.size and (gap.min() < 0 or bool((end < start).any()) or bool((end > ends).any())):
            return False
        if visibility == "causal" and bool(((vis > 0) & (end > start) & (vis < start)).any()):
            return False
    return True


def _first_bad(name: str, t: torch.Tensor, bad: torch.Tensor, why: str) -> None:
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise OpInputError(f"{name}{list(index)} = {int(t[index])} is {why}")


def unavailable_reason(kernel: str, query: torch.Tensor, kv_pool: torch.Tensor, visibility: str) -> str | None:
    """Why `kernel` cannot run these inputs here (missing package, device, page size, layout), or None."""
    return kernels.get(kernel).unavailable_reason(query, kv_pool, visibility)


def resolve_kernel(kernel: str, query: torch.Tensor, kv_pool: torch.Tensor, visibility: str = "general") -> str:
    """The concrete kernel for `kernel` ("auto" picks the best usable one); raises KernelUnavailableError."""
    if kernel == "auto":
        for candidate in kernels.auto_preference(query.device.type):
            if candidate.unavailable_reason(query, kv_pool, visibility) is None:
                return candidate.name
        return "reference"
    reason = unavailable_reason(kernel, query, kv_pool, visibility)
    if reason is not None:
        raise KernelUnavailableError(reason)
    return kernel


#: what is told of every real call of the paged ops (both ops, any kernel) and of every compiled graph with nothing
#: to page: the forwards open while it runs count them (`forward_context.ForwardContext.note_call`), and one in
#: which no paged op ran is refused, naming the cause (`PagedKVRuntime._check_attention_ran`)
_CALL_OBSERVERS: list[Callable[[str | None], None]] = []


@contextlib.contextmanager
def observe_calls(observer: Callable[[str | None], None]) -> Iterator[None]:
    """Call `observer(None)` at every real call of the paged ops made inside the block, and `observer(why)` at every
    call of a graph the backend compiled with nothing to page (`report_call`)."""
    _CALL_OBSERVERS.append(observer)
    try:
        yield
    finally:  # by identity: the same observer may be open twice
        del _CALL_OBSERVERS[next(i for i in reversed(range(len(_CALL_OBSERVERS))) if _CALL_OBSERVERS[i] is observer)]


def report_call(nothing_to_page: str | None = None) -> None:
    """Tell the open observers of a call: of a paged op (None), or of a compiled graph that had nothing to page, with
    why (`backend._unpaged_callable`), so that a forward that paged nothing names its cause."""
    for observer in _CALL_OBSERVERS:
        observer(nothing_to_page)


def _refuse_pool_aliases(kv_pool: torch.Tensor, **reads: torch.Tensor | None) -> None:
    """Refuse a read argument in the pool's memory: the op would read what it writes. Inductor produces such a
    call from `y = pool.clone(); op(y-derived, pool)` (pytorch/pytorch#198031, open in torch 2.13 and 2.14): a
    clear error instead of silently wrong numbers. Real tensors only (a fake tensor has no memory)."""
    base = kv_pool.untyped_storage().data_ptr()
    shared = [name for name, t in reads.items() if t is not None and t.untyped_storage().data_ptr() == base]
    if shared:
        raise OpInputError(
            f"{', '.join(shared)} share(s) memory with kv_pool, which the op writes: pass tensors of their own "
            "(under torch.compile this comes from a clone of the pool next to the op, pytorch/pytorch#198031: "
            "do not clone the pool in compiled code)"
        )


def _run(query, key, value, kv_pool, slot_mapping, block_table, seq_lens, kv_visible_end, scale, kernel, visibility,
         kv_scales, kv_gap):
    report_call()
    validate_inputs(query, key, value, kv_pool, slot_mapping, block_table, seq_lens, kv_visible_end, kernel, visibility,
                    kv_scales, kv_gap)
    _refuse_pool_aliases(kv_pool, query=query, key=key, value=value, slot_mapping=slot_mapping,
                         block_table=block_table, seq_lens=seq_lens, kv_visible_end=kv_visible_end, kv_scales=kv_scales,
                         kv_gap=kv_gap)
    name = resolve_kernel(kernel, query, kv_pool, visibility)
    if CHECK_VALUES and query.device.type == "cpu":
        check_values(query, kv_pool, slot_mapping, block_table, seq_lens, kv_visible_end, visibility, kv_gap)
    module = kernels.get(name).load()  # a kernel module: write_kv(...) and attend(..., visibility)
    # row_scales only for FP8 pools, kv_gap only when given: a kernel need not take a keyword it never serves.
    extra = {} if kv_scales is None else {"row_scales": row_scales(kv_scales, block_table)}
    if key is not None:
        module.write_kv(kv_pool, key, value, slot_mapping, **extra)
    if kv_gap is not None:
        extra["kv_gap"] = kv_gap
    return module.attend(query, kv_pool, block_table, seq_lens, kv_visible_end, scale, visibility, **extra)


@torch.library.custom_op("paged_kv::write_attend", mutates_args=("kv_pool",))
def write_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_visible_end: torch.Tensor,
    scale: float,
    kernel: str = "auto",
    visibility: str = "general",
    kv_scales: torch.Tensor | None = None,
    kv_gap: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write key/value at their slots (skipping -1), then attend each query over its row's block table."""
    return _run(
        query, key, value, kv_pool, slot_mapping, block_table, seq_lens, kv_visible_end, scale, kernel, visibility,
        kv_scales, kv_gap,
    )


@write_attend.register_fake
def _write_attend_fake(query, key, value, kv_pool, slot_mapping, block_table, seq_lens, kv_visible_end, scale,
                       kernel="auto", visibility="general", kv_scales=None, kv_gap=None):
    validate_inputs(query, key, value, kv_pool, slot_mapping, block_table, seq_lens, kv_visible_end, kernel, visibility,
                    kv_scales, kv_gap)
    return query.new_empty(query.shape)


@torch.library.custom_op("paged_kv::attend", mutates_args=())
def attend(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_visible_end: torch.Tensor,
    scale: float,
    kernel: str = "auto",
    visibility: str = "general",
    kv_scales: torch.Tensor | None = None,
    kv_gap: torch.Tensor | None = None,
) -> torch.Tensor:
    """Read-only twin of write_attend for static regions: attend without writing."""
    return _run(query, None, None, kv_pool, None, block_table, seq_lens, kv_visible_end, scale, kernel, visibility,
                kv_scales, kv_gap)


@attend.register_fake
def _attend_fake(query, kv_pool, block_table, seq_lens, kv_visible_end, scale, kernel="auto", visibility="general",
                 kv_scales=None, kv_gap=None):
    validate_inputs(query, None, None, kv_pool, None, block_table, seq_lens, kv_visible_end, kernel, visibility,
                    kv_scales, kv_gap)
    return query.new_empty(query.shape)


#: per op name: (the lean Autograd kernel registered below, custom_op's own), for `custom_op_layers`
AUTOGRAD_KERNELS: dict[str, tuple] = {}


def _lean_autograd(op_def) -> None:
    """Replace `custom_op`'s Python Autograd kernel of `op_def` with one that costs one Python call when no
    input needs a gradient (always, for the runtime): bump the mutated arguments' version counters, as
    `custom_op`'s ADInplaceOrView kernel does, and redispatch straight to the backend kernel.

    Why: on the CPU every call went through two Python layers before the kernel, `custom_op`'s Autograd
    kernel and its ADInplaceOrView kernel; on torch 2.13 the latter's `torch._library.utils.fill_defaults`
    rebuilt the schema's argument list once per argument, about 0.2 ms per call measured at tiny shapes
    (docs/benchmarks.md). Torch 2.14 dropped that `fill_defaults`; the lean kernel still saves the layer.
    When an input requires grad, `custom_op`'s own kernel runs (same behaviour as before). On a torch
    without these internals the registration is left as `custom_op` made it.
    """
    try:
        from torch._library.autograd import make_autograd_impl

        overload = op_def._opoverload
        original = make_autograd_impl(overload, op_def)
        below = torch._C._after_ADInplaceOrView_keyset
        below_autograd = torch._C._AutoDispatchBelowAutograd
        lib = op_def._lib
    except (ImportError, AttributeError):  # another torch version: tests/test_op_reference.py plants it
        return
    mutated = [i for i, a in enumerate(overload._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    bump = torch.autograd.graph.increment_version

    def autograd_kernel(keyset, *args, **kwargs):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return original(keyset, *args, **kwargs)
        for i in mutated:  # never dropped by the dispatcher: mutated arguments have no default
            bump(args[i])
        with below_autograd():
            return overload.redispatch(keyset & below, *args, **kwargs)

    name = overload._schema.name.split("::")[1]
    lib.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    AUTOGRAD_KERNELS[name] = (lib, autograd_kernel, original)


@contextlib.contextmanager
def custom_op_layers() -> Iterator[None]:
    """Within the block the ops run through `custom_op`'s own Python layers again (benchmarks measure what
    `_lean_autograd` saves: benchmarks/forward_time.py, ``--op-overhead``)."""
    for name, (lib, _, original) in AUTOGRAD_KERNELS.items():
        lib.impl(name, original, "Autograd", with_keyset=True)
    try:
        yield
    finally:
        for name, (lib, lean, _) in AUTOGRAD_KERNELS.items():
            lib.impl(name, lean, "Autograd", with_keyset=True)


_lean_autograd(write_attend)
_lean_autograd(attend)
