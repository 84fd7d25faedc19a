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
    kv_index: int | None  # for a leaf with a leading K/V axis (a (2, B, L, H, D) cache): which half
    heads: tuple[int, int] | None = None  # (first, count) when the input reads only these heads of the leaf


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


def _axis_orders(ndim: int) -> list[tuple[int | None, int, int, int, int]]:
    """Candidate (kv, batch, seq, head, dim) axes of a leaf of `ndim` dims: token-major, head-major, and for 4 dims
    sequence-major (S, B, H, D), what a Ulysses all-to-all receives (vllm-omni's `all_to_all_4D`)."""
    if ndim == 4:
        return [(None, 0, 1, 2, 3), (None, 0, 2, 1, 3), (None, 1, 0, 2, 3)]
    if ndim == 5:
        return [(0, 1, 2, 3, 4), (0, 1, 3, 2, 4)]
    return []


def _read_shapes(shape: tuple[int, ...], head_dim: int, batch: int):
    """(shape to read the leaf as, axes) pairs: as is; with a fused H*D last axis split in two; with a leading
    flattened token axis (vLLM's (num_tokens, H, D) or (num_tokens, H*D)) split into (batch, seq); and with two
    leading axes merged (a Ulysses all-to-all's received (U, S/U, B, H, D) buffer read as (S, B, H, D)).
    Splits and merges keep row-major order, so every candidate is verified element by element by the caller."""
    shapes = [shape]
    if shape and shape[-1] % head_dim == 0 and shape[-1] != head_dim:
        shapes.append(shape[:-1] + (shape[-1] // head_dim, head_dim))
    for s in list(shapes):
        if len(s) == 3 and batch > 0 and s[0] % batch == 0:
            shapes.append((batch, s[0] // batch) + s[1:])
        if len(s) == 5:
            shapes.append((s[0] * s[1],) + s[2:])
    return [(s, axes) for s in shapes for axes in _axis_orders(len(s))]


def _leaf_read(leaf: fx.Node, flat: torch.Tensor) -> tuple[LeafRead, list[int]] | None:
    """How `leaf` is read, given the flat offsets (B, H, cols, D) of the columns that read it, and the sequence
    position of each of those columns; None when no axis order maps batch, heads and head_dim as the op does."""
    Bx, Hx, _, Dx = flat.shape
    b_idx = torch.arange(Bx).view(-1, 1, 1, 1)
    d_idx = torch.arange(Dx).view(1, 1, 1, -1)
    for shape, (kv, b, s, h, d) in _read_shapes(tuple(example(leaf).shape), Dx, Bx):
        if shape[b] != Bx or shape[d] != Dx:
            continue
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        coords = [(flat // strides[i]) % shape[i] for i in range(len(shape))]
        # GQA: head h reads kv head first + h // rep; a subset (first, count) of the leaf's heads is a Ulysses
        # rank's heads of a replicated tensor (vllm-omni's joint text prefix, sliced by head rank)
        first = int(coords[h].min())
        count = int(coords[h].max()) - first + 1
        if Hx % count:
            continue
        h_idx = (first + torch.arange(Hx) // (Hx // count)).view(1, -1, 1, 1)
        if (
            bool((coords[b] == b_idx).all())
            and bool((coords[h] == h_idx).all())
            and bool((coords[d] == d_idx).all())
            and bool((coords[s] == coords[s][:1, :1, :, :1]).all())
            and (kv is None or bool((coords[kv] == coords[kv].flatten()[0]).all()))
        ):
            kv_index = None if kv is None else int(coords[kv].flatten()[0])
            heads = None if (first, count) == (0, shape[h]) else (first, count)
            return LeafRead(leaf, shape, s, h, kv_index, heads), coords[s][0, 0, :, 0].tolist()
    return None


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
