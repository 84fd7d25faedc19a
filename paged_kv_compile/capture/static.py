"""Static input and output buffers of captured block calls, and how a call is matched against them.

A captured graph reads fixed addresses, so every block call of a bucket copies its tensor arguments into
one buffer per argument position (`BucketState`; within one forward, a tensor already copied is not copied
again), is refused when its arguments are not what was warmed up (`BucketState.mismatch`), and hands out
copies of the static outputs (`copy_out`). Cache stand-ins (`binding.is_standin`) are already at fixed
addresses and pass through.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .. import binding
from ..config import Bucket
from ..errors import CaptureError

TENSOR, STANDIN, OBJECT, CONST = "tensor", "stand-in", "object", "constant"


def signature(value: Any, where: str, depth: int = 0) -> tuple[str, Any]:
    """(kind, signature) of one flattened argument; two calls match when both are equal."""
    if isinstance(value, torch.Tensor):
        if binding.is_standin(value):
            return STANDIN, (value.data_ptr(), tuple(value.shape), tuple(value.stride()), value.dtype)
        return TENSOR, (tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (str, int, float, bool, type(None), torch.dtype, torch.device)):
        return CONST, value
    attrs = getattr(value, "__dict__", None)
    if attrs is not None and depth < 2 and not isinstance(value, torch.nn.Module):
        items = []
        for name, attr in sorted(attrs.items()):
            kind, sig = signature(attr, f"{where}.{name}", depth + 1)
            if kind == TENSOR:
                raise CaptureError(
                    f"{where}.{name} is a tensor that is not a KV-cache stand-in inside a {type(value).__name__}: a "
                    "captured graph would keep reading it at its warm-up address. Pass it as a tensor argument"
                )
            items.append((name, kind, sig))
        return OBJECT, (type(value), tuple(items))
    raise CaptureError(f"{where} is a {type(value).__name__}, which a captured block call cannot take")


def describe(kind: str, sig: Any) -> str:
    if kind == TENSOR:
        shape, dtype, device = sig
        return f"tensor {list(shape)} {dtype} on {device}"
    if kind == STANDIN:
        return f"stand-in {list(sig[1])} at {sig[0]:#x}"
    if kind == OBJECT:
        return f"{sig[0].__name__} object"
    return f"{type(sig).__name__} {sig!r}"


def tensor_version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version: never skip their copy
        return None


@dataclass
class Slot:
    """One flattened argument position of a bucket's block calls."""

    kind: str
    sig: Any
    buffer: torch.Tensor | None = None  # the static buffer of a tensor argument
    last: tuple | None = None  # (weakref to the last source, its version, the forward): skip an identical copy


@dataclass
class BucketState:
    bucket: Bucket
    spec: Any  # pytree spec of (args, kwargs)
    slots: list[Slot]
    example: list  # the warm-up leaves in flattened order (None for tensors: their buffer holds them)
    graphs: dict[int, Any] = field(default_factory=dict)  # block index -> torch.cuda.CUDAGraph
    outputs: dict[int, Any] = field(default_factory=dict)  # block index -> output tree over static buffers
    out_buffers: list[torch.Tensor] = field(default_factory=list)
    calls: dict[int, list] = field(default_factory=dict)  # block index -> the paged calls its capture made
    forward: Any = None  # granularity="forward": the bucket's ForwardGraph (capture/forward_graph.py)

    def static_leaves(self) -> list:
        return [s.buffer if s.kind == TENSOR else leaf for s, leaf in zip(self.slots, self.example)]

    @classmethod
    def prepare(cls, bucket: Bucket, args: tuple, kwargs: dict) -> "BucketState":
        """One static buffer per tensor argument of the warm-up call (a copy of it)."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        slots = []
        for n, leaf in enumerate(leaves):
            kind, sig = signature(leaf, f"argument {n}")
            slot = Slot(kind, sig)
            if kind == TENSOR:
                if torch._debug_has_internal_overlap(leaf) == 1:
                    raise CaptureError(
                        f"argument {n} of the example inputs for {bucket} is an expanded (self-overlapping) tensor; "
                        "give a materialized tensor or a registered stand-in (runtime.standin)"
                    )
                slot.buffer = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device)
                slot.buffer.copy_(leaf)
            slots.append(slot)
        return cls(bucket, spec, slots, [None if s.kind == TENSOR else x for s, x in zip(slots, leaves)])

    def mismatch(self, leaves: list, spec) -> str:
        """Why a call's flattened arguments cannot use this bucket's buffers ("" when they can)."""
        if spec != self.spec:
            return "its arguments are structured differently from the warm-up's"
        for n, (slot, leaf) in enumerate(zip(self.slots, leaves)):
            kind, sig = signature(leaf, f"argument {n}")
            if kind != slot.kind or sig != slot.sig:
                return f"argument {n} is a {describe(kind, sig)}, warmed up as a {describe(slot.kind, slot.sig)}"
        return ""

    def changed(self, args: tuple, kwargs: dict) -> str:
        """What a block call changed in the containers of its static arguments ("" when nothing): dynamo replays
        such Python side effects (a cache dict's fill state) after the graph, a captured replay cannot."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        why = self.mismatch(leaves, spec)
        if why:
            return why
        for n, (slot, leaf) in enumerate(zip(self.slots, leaves)):
            if slot.kind == TENSOR and leaf is not slot.buffer:
                return f"argument {n} now holds another tensor"
        return ""

    def copy_in(self, leaves: list, stats: dict, forward: int) -> None:
        """Copy a call's tensor arguments into the static buffers.

        The copy is skipped only for the tensor copied last by an earlier call of the same runtime forward
        (`forward`: its generation), unmodified since (its version): the RoPE tables and modulation every block of
        a forward receives. Never across forwards: a change made through `.data` does not bump the version, so a
        caller's buffer refilled that way between forwards would otherwise be served stale."""
        for slot, leaf in zip(self.slots, leaves):
            if slot.kind != TENSOR:
                continue
            buf = slot.buffer
            if leaf is buf:
                continue
            version = tensor_version(leaf)
            if (version is not None and slot.last is not None and slot.last[0]() is leaf
                    and slot.last[1:] == (version, forward)):
                stats["copies_skipped"] += 1
                continue
            buf.copy_(leaf)
            slot.last = (weakref.ref(leaf), version, forward) if version is not None else None
            stats["copies"] += 1

    def call_leaves(self, leaves: list) -> list:
        """The call's leaves with every tensor replaced by its static buffer."""
        return [s.buffer if s.kind == TENSOR else leaf for s, leaf in zip(self.slots, leaves)]

    def addresses(self) -> tuple[int, ...]:
        """The addresses the bucket's calls read: static buffers and stand-ins."""
        return tuple(s.buffer.data_ptr() if s.kind == TENSOR else s.sig[0] for s in self.slots
                     if s.kind in (TENSOR, STANDIN))

    def static_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in [s.buffer for s in self.slots if s.buffer is not None]
                   + self.out_buffers)


def copy_out(value):
    """What a captured call returns: a copy of a static output (the next replay overwrites it)."""
    if isinstance(value, torch.Tensor) and not binding.is_standin(value):
        return value.clone()
    return value
