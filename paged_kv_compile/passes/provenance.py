"""Provenance of an attention input: per column of SDPA's (B, H, L, D) query, keys or values, which tensor and
which sequence position it reads, with batch, heads (GQA replication) and head_dim verified element by element.

Read by tag execution (`tags.py`); any spelling that moves the same elements is accepted, anything else is
refused with a reason. Term used here: a leaf's *axis order*, which of its axes are the K/V half, batch,
sequence, heads and head_dim ((B, S, H, D) token-major or (B, H, S, D) head-major, optionally behind a leading
K/V axis), not to be confused with a row's pool layout (`layout.RowLayout`) or the mask's (`MaskLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .graph import example
from .tags import CAT_FUNCTIONS, InPlaceSteps, evaluate, leaf_index, movement_leaves, offset


@dataclass
class LeafRead:
    """How one leaf feeds an attention input: the shape it is read as and its axis order."""

    node: fx.Node
    shape: tuple[int, ...]  # the leaf read with heads split out, e.g. (B, S, H*D) read as (B, S, H, D)
    seq_dim: int  # which dim of `shape` is the sequence
    head_dim_index: int  # which dim is the head axis
    #: with a selector axis (`select_dim`: a cache's leading K/V axis, or a fused projection's q/k/v axis
    #: anywhere, e.g. (B, L, 3, H, D)): the one index of it that is read
    kv_index: int | None
    select_dim: int | None = None
    batch_dim: int = 0
    feature_dim: int = -1  # which dim is head_dim (the last unless the selector comes after it)
    heads: tuple[int, int] | None = None  # (first, count) when the input reads only these heads of the leaf

    def bshd_axes(self) -> tuple[int, int, int, int]:
        """(batch, seq, heads, head_dim) axes of the leaf read as `shape` once the selector axis is indexed away."""
        def after_select(axis: int) -> int:
            axis %= len(self.shape)
            return axis - 1 if self.select_dim is not None and axis > self.select_dim else axis
        return tuple(after_select(a) for a in (self.batch_dim, self.seq_dim, self.head_dim_index, self.feature_dim))


@dataclass
class Provenance:
    """Per column of an attention input (B, H, L, D): the leaf and sequence position it reads."""

    columns: list[tuple[fx.Node, int]]
    reads: dict[fx.Node, LeafRead] = field(default_factory=dict)
    leaves: list[fx.Node] = field(default_factory=list)
    moves: list[fx.Node] = field(default_factory=list)
    values: dict[fx.Node, object] = field(default_factory=dict)  # each movement node's tags
    column_tags: list[int] = field(default_factory=list)  # the tag of element (batch 0, head 0, d 0) per column

    def runs(self) -> list[tuple[fx.Node, list[int]]]:
        """Consecutive columns grouped by leaf: [(leaf, [seq positions...]), ...]."""
        out: list[tuple[fx.Node, list[int]]] = []
        for leaf, pos in self.columns:
            if out and out[-1][0] is leaf:
                out[-1][1].append(pos)
            else:
                out.append((leaf, [pos]))
        return out


_FOUR_AXIS_ORDERS = [(0, 1, 2, 3), (0, 2, 1, 3), (1, 0, 2, 3)]  # (batch, seq, head, dim): BSHD, BHSD, SBHD


def _axis_orders(ndim: int) -> list[tuple[int | None, int, int, int, int]]:
    """Candidate (selector, batch, seq, head, dim) axes of a leaf of `ndim` dims: token-major, head-major, and for 4
    dims sequence-major (S, B, H, D), what a Ulysses all-to-all receives (vllm-omni's `all_to_all_4D`); for 5
    dims the same with a selector axis anywhere (a cache's leading K/V axis first, then a fused projection's
    q/k/v axis: (B, L, 3, H, D), (B, L, H, 3, D), ...)."""
    if ndim == 4:
        return [(None, *order) for order in _FOUR_AXIS_ORDERS]
    if ndim == 5:
        out = []
        for sel in range(5):
            rest = [a for a in range(5) if a != sel]
            out += [(sel, *(rest[i] for i in order)) for order in _FOUR_AXIS_ORDERS]
        return out
    return []


def _selector_splits(shape: tuple[int, ...], head_dim: int, heads: int) -> list[tuple[int, ...]]:
    """`shape` with one axis split into a selector and heads: a fused q/k/v feature axis m*H*D as (m, H, D) or
    (H, m, D), a fused head axis m*H as (m, H); H any divisor of the query heads (GQA)."""
    out = []
    for i, n in enumerate(shape):
        for kv_heads in (g for g in range(1, heads + 1) if heads % g == 0):
            if i == len(shape) - 1 and n % (kv_heads * head_dim) == 0 and n > kv_heads * head_dim:
                m = n // (kv_heads * head_dim)
                out += [shape[:i] + (m, kv_heads, head_dim), shape[:i] + (kv_heads, m, head_dim)]
            elif i < len(shape) - 1 and n % kv_heads == 0 and n > kv_heads and len(shape) == 4:
                out.append(shape[:i] + (n // kv_heads, kv_heads) + shape[i + 1:])
    return out


def _read_shapes(shape: tuple[int, ...], head_dim: int, batch: int, heads: int):
    """(shape to read the leaf as, axes) pairs: as is; with a fused H*D last axis split in two; with a leading
    flattened token axis (vLLM's (num_tokens, H, D) or (num_tokens, H*D)) split into (batch, seq); with two
    leading axes merged (a Ulysses all-to-all's received (U, S/U, B, H, D) buffer read as (S, B, H, D)); and last
    with a selector axis split out of a fused projection (`_selector_splits`).
    Splits and merges keep row-major order, so every candidate is verified element by element by the caller."""
    shapes = [shape]
    if shape and shape[-1] % head_dim == 0 and shape[-1] != head_dim:
        shapes.append(shape[:-1] + (shape[-1] // head_dim, head_dim))
    for s in list(shapes):
        if len(s) == 3 and batch > 0 and s[0] % batch == 0:
            shapes.append((batch, s[0] // batch) + s[1:])
        if len(s) == 5:
            shapes.append((s[0] * s[1],) + s[2:])
    shapes += [split for s in list(shapes) if len(s) in (3, 4) for split in _selector_splits(s, head_dim, heads)]
    shapes = list(dict.fromkeys(shapes))
    return [(s, axes) for s in shapes for axes in _axis_orders(len(s))]


def _leaf_read(leaf: fx.Node, flat: torch.Tensor) -> tuple[LeafRead, list[int]] | None:
    """How `leaf` is read, given the flat offsets (B, H, cols, D) of the columns that read it, and the sequence
    position of each of those columns; None when no axis order maps batch, heads and head_dim as the op does.

    A read of all the leaf's heads is preferred; failing that, a contiguous subset of them (a Ulysses rank's heads
    of a replicated tensor: vllm-omni's joint text prefix, sliced by head rank)."""
    candidates = _read_shapes(tuple(example(leaf).shape), flat.shape[3], flat.shape[0], flat.shape[1])
    for subset in (False, True):
        for shape, axes in candidates:
            found = _read_as(leaf, flat, shape, axes, subset)
            if found is not None:
                return found
    return None


def _read_as(leaf: fx.Node, flat: torch.Tensor, shape: tuple[int, ...], axes: tuple, subset: bool
             ) -> tuple[LeafRead, list[int]] | None:
    """`leaf` read as `shape` with (selector, batch, seq, head, dim) `axes`, if every offset agrees: each query
    head h reads kv head first + h // rep (GQA), all of them (`subset=False`) or a contiguous range."""
    Bx, Hx, _, Dx = flat.shape
    kv, b, s, h, d = axes
    if shape[b] != Bx or shape[d] != Dx or (not subset and Hx % shape[h]):
        return None
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    coords = [(flat // strides[i]) % shape[i] for i in range(len(shape))]
    first = int(coords[h].min()) if subset else 0
    count = int(coords[h].max()) - first + 1 if subset else shape[h]
    if Hx % count or (subset and count == shape[h]):
        return None
    h_idx = (first + torch.arange(Hx) // (Hx // count)).view(1, -1, 1, 1)
    if not (
        bool((coords[b] == torch.arange(Bx).view(-1, 1, 1, 1)).all())
        and bool((coords[h] == h_idx).all())
        and bool((coords[d] == torch.arange(Dx).view(1, 1, 1, -1)).all())
        and bool((coords[s] == coords[s][:1, :1, :, :1]).all())
        and (kv is None or bool((coords[kv] == coords[kv].flatten()[0]).all()))
    ):
        return None
    kv_index = None if kv is None else int(coords[kv].flatten()[0])
    heads = (first, count) if subset else None
    return LeafRead(leaf, shape, s, h, kv_index, kv, b, d, heads), coords[s][0, 0, :, 0].tolist()


def provenance(node: fx.Node, writes: InPlaceSteps | None = None) -> tuple[Provenance | None, str]:
    """Where each column of the attention input `node` ((B, H, L, D)) comes from, or a refusal reason.

    `writes`: in-place stores into stand-ins that `node` reads back (`writes.plan_writes`), followed on the tags.
    """
    if writes is None:
        leaves, moves = movement_leaves(node)
        values = evaluate(node, leaves, moves)
    else:
        leaves, moves = writes.leaves, [n for n in writes.steps if not writes.performs(n)]
        values = evaluate(node, leaves, writes.steps, writes)
    if values is None:
        return None, "its data-movement chain could not be evaluated at static shapes"
    tags = values[node]
    if tags.dim() != 4:
        return None, f"attention input has {tags.dim()} dims, expected (batch, heads, seq, head_dim)"
    which = leaf_index(tags)
    if not bool((which == which[:1, :1, :, :1]).all()):
        return None, "a key/value column mixes several tensors"
    column_leaf = which[0, 0, :, 0]
    columns: list[tuple[fx.Node, int] | None] = [None] * tags.shape[2]
    reads: dict[fx.Node, LeafRead] = {}
    for index in torch.unique(column_leaf).tolist():
        leaf = leaves[index]
        cols = torch.nonzero(column_leaf == index).flatten()
        got = _leaf_read(leaf, offset(tags)[:, :, cols, :])
        if got is None:
            return None, (
                f"{leaf.name} does not map batch/heads/head_dim the way the paged op reads them "
                "(expected (B, S, H, D) or (B, H, S, D) leaves, GQA as head h -> kv head h // rep)"
            )
        reads[leaf], positions = got
        for c, pos in zip(cols.tolist(), positions):
            columns[c] = (leaf, int(pos))
    return Provenance(columns, reads, leaves, moves, values, tags[0, 0, :, 0].tolist()), ""


def joining_columns(prov: Provenance, standins: set[fx.Node]) -> set[int] | None:
    """Columns of an attention input whose new (non-stand-in) token joins the cache history: the window's tokens.

    The cache concatenation is a concatenation whose inputs are cache history (stand-in data only) and new
    tokens (no stand-in data), none of them both: ``cat([cache, new])`` before a window slice
    (``[:, -window:]``), or ``cat([cache[:, :sink], cache[:, sink + chunk:], new])``. The new tokens it joins
    are what the model's cache carries forward; tokens appended later to the joined tensor (DreamZero's
    action registers, even when they are slices of the same roped tensor as the video keys) are not. Read
    from the tags each movement node carries, not from which leaf a token comes from. None when the chain
    has no cache concatenation.
    """
    standin_ids = torch.tensor([i for i, leaf in enumerate(prov.leaves) if leaf in standins], dtype=torch.int64)
    if not len(standin_ids):
        return None
    joined: list[torch.Tensor] = []
    for n in prov.moves:
        if n.op != "call_function" or n.target not in CAT_FUNCTIONS or not isinstance(n.args[0], (list, tuple)):
            continue
        kinds = set()
        for part in n.args[0]:
            tags = prov.values.get(part) if isinstance(part, fx.Node) else None
            if not isinstance(tags, torch.Tensor) or not tags.numel():
                continue
            cache = torch.isin(leaf_index(tags), standin_ids)
            kinds.add("mixed" if bool(cache.any()) and not bool(cache.all()) else "cache" if bool(cache.all()) else "new")
        if kinds != {"cache", "new"}:
            continue  # not where history and new tokens first meet
        out = prov.values[n]
        joined.append(out[~torch.isin(leaf_index(out), standin_ids)].flatten())
    if not joined:
        return None
    cols = torch.tensor(prov.column_tags, dtype=torch.int64)
    return set(torch.nonzero(torch.isin(cols, torch.cat(joined))).flatten().tolist())
