"""Structural matching helpers shared by the family passes.

The key idea: instead of matching text (``torch.cat`` vs ``torch.concat``, ``repeat_interleave`` vs
``expand``+``reshape``), the chain of pure data-movement ops that feeds an attention input is
*executed* on integer tag tensors, one unique tag per element of each leaf. The result says, for each
element the attention reads, which leaf element it is. From that we read off, per key column, which
tensor (a cache stand-in or a freshly computed K/V) and which sequence position it comes from, and
verify that batch, heads (with GQA replication) and head_dim map exactly as the paged op assumes.
Any idiom that computes the same layout is accepted; anything else is refused with a reason.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}

_MOVE_FUNCTIONS = {
    torch.cat, torch.concat, torch.concatenate, torch.stack, torch.transpose, torch.permute, torch.reshape,
    torch.flatten, torch.unsqueeze, torch.squeeze, torch.repeat_interleave, torch.select, torch.narrow,
    torch.swapaxes, torch.movedim, torch.clone, torch.tile, torch.unflatten,
}
_MOVE_METHODS = {
    "transpose", "permute", "view", "reshape", "expand", "contiguous", "flatten", "unsqueeze", "squeeze",
    "repeat_interleave", "repeat", "tile", "narrow", "select", "clone", "swapaxes", "movedim", "__getitem__",
    "unflatten",
}
_TAG_SHIFT = 40
_TAG_MASK = (1 << _TAG_SHIFT) - 1


def example(node: fx.Node):
    return node.meta.get("example_value")


def is_tensor_node(node: object) -> bool:
    return isinstance(node, fx.Node) and isinstance(example(node), torch.Tensor)


def is_movement(node: fx.Node) -> bool:
    """A node that only rearranges elements of tensors (no arithmetic)."""
    if node.op == "call_function":
        if node.target is operator.getitem:
            return is_tensor_node(node.args[0])  # getitem on a tuple (unbind/split) is a leaf boundary
        return node.target in _MOVE_FUNCTIONS
    if node.op == "call_method":
        return node.target in _MOVE_METHODS
    return False


def movement_leaves(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(leaves, movement nodes in topological order) of the data-movement subgraph ending at `node`."""
    leaves: list[fx.Node] = []
    moves: set[fx.Node] = set()
    stack = [node]
    seen: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_movement(n):
            moves.add(n)
            stack.extend(a for a in n.all_input_nodes)
        else:
            leaves.append(n)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(leaves, key=order.__getitem__), sorted(moves, key=order.__getitem__)


def leaf_offsets(node: fx.Node) -> tuple[fx.Node, torch.Tensor] | None:
    """For `node`, pure data movement of ONE graph tensor: (that leaf, each element's flat index in it), read by
    running the movement on tags; None when it reads several tensors or cannot be evaluated at static shapes."""
    leaves, moves = movement_leaves(node)
    if len(leaves) != 1:
        return None
    values = _evaluate(node, leaves, moves)
    if values is None:
        return None
    return leaves[0], values[node] & _TAG_MASK


def _evaluate(node: fx.Node, leaves: list[fx.Node], moves: list[fx.Node],
              writes: "Writes | None" = None) -> dict[fx.Node, object] | None:
    """Run the movement subgraph on tag tensors: every node's tags; None when it cannot be evaluated statically.

    With `writes`, its in-place stores run too, in graph order among the movement nodes, on the same tag
    tensors (views alias as in the real program), with each data-dependent write position replaced by its probe.
    """
    values: dict[fx.Node, object] = {}
    if writes is not None:
        leaves, moves = writes.leaves, writes.steps
    for i, leaf in enumerate(leaves):
        ex = example(leaf)
        if not isinstance(ex, torch.Tensor) or any(not isinstance(s, int) for s in ex.shape):
            return None
        tags = torch.arange(ex.numel(), dtype=torch.int64).view(tuple(ex.shape)) + ((i + 1) << _TAG_SHIFT)
        values[leaf] = tags

    def sub(a):
        if isinstance(a, fx.Node):
            if a not in values:
                raise KeyError(a)
            return values[a]
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        if isinstance(a, slice):
            return slice(sub(a.start), sub(a.stop), sub(a.step))
        return a

    try:
        for n in moves:
            if writes is not None and n in writes.probes:
                _store(n, sub, writes.probes[n])
                continue
            args, kwargs = sub(n.args), sub(n.kwargs)
            if n.op == "call_function":
                values[n] = n.target(*args, **kwargs)
            else:
                method = "reshape" if n.target == "view" else n.target
                values[n] = getattr(args[0], method)(*args[1:], **kwargs)
    except (KeyError, RuntimeError, TypeError, IndexError, ValueError):
        return None
    return values if isinstance(values.get(node), torch.Tensor) else None


def store_name(store: fx.Node) -> str:
    """`index_copy_`, `copy_`, `setitem`, ...: the in-place operation a store node performs."""
    return store.target if store.op == "call_method" else getattr(store.target, "__name__", str(store.target))


#: where a store's written value sits among its arguments (the rest are the destination, indices or masks)
STORE_VALUE_ARG = {"copy_": 1, "setitem": 2, "__setitem__": 2, "index_put_": 2, "index_copy_": 3}


def _store(n: fx.Node, sub, probe: torch.Tensor | None) -> None:
    """Perform store `n` on tag tensors (`probe`: the positions an index_copy_ writes at, when they are data)."""
    name = store_name(n)
    if name == "index_copy_":
        dest, dim, value = sub(n.args[0]), n.args[1], sub(n.args[3])
        dest.index_copy_(dim, probe, value)
    elif name in ("setitem", "__setitem__"):
        dest, index, value = sub(n.args[:3])
        dest[index] = value
    elif name == "copy_":
        sub(n.args[0]).copy_(sub(n.args[1]))
    else:
        raise TypeError(name)


@dataclass
class Writes:
    """In-place stores into cache stand-ins that an attention input reads back, made evaluable on tags.

    probes: per `index_copy_` store, the positions used for its data-dependent index (the last positions of
    the written axis: the new tokens land after everything the cache held, as a `cat([cache, new])` would
    put them); a store with constant indices (slices of Python ints) needs none.
    index_nodes: per probed store, its index node, the destination row it writes (None: every row) and the
    length of the written axis.
    """

    leaves: list[fx.Node]
    steps: list[fx.Node]
    probes: dict[fx.Node, torch.Tensor | None]
    index_nodes: list[tuple[fx.Node, int | None, int]]


def _static(a) -> bool:
    if isinstance(a, fx.Node):
        return False
    if isinstance(a, (list, tuple)):
        return all(_static(x) for x in a)
    if isinstance(a, slice):
        return all(_static(x) for x in (a.start, a.stop, a.step))
    return True


def plan_writes(node: fx.Node, stores: list[fx.Node]) -> tuple[Writes | None, str]:
    """The in-place `stores` (before `node`, in graph order) made evaluable with `node`'s movement chain.

    Supported: `index_copy_(dim, index, value)` where `index` is data (its positions are checked against the
    runtime's layout at run time), and `dest[constant slices] = value` / `dest.copy_(value)`. Anything else
    (indices computed from `.item()`, masks) is refused with the reason.
    """
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    leaves, moves = movement_leaves(node)
    all_leaves, all_moves = set(leaves), set(moves)
    probes: dict[fx.Node, torch.Tensor | None] = {}
    index_nodes: list[tuple[fx.Node, int | None, int]] = []
    for store in stores:
        name = store_name(store)
        value_at = STORE_VALUE_ARG.get(name)
        if value_at is None or len(store.args) <= value_at or not isinstance(store.args[value_at], fx.Node):
            return None, f"{store.name} writes the cache with {name}, which the pass cannot follow"
        dest, value = store.args[0], store.args[value_at]
        for chain in (dest, value):
            lv, mv = movement_leaves(chain)
            all_leaves.update(lv)
            all_moves.update(mv)
        if name == "index_copy_":
            dim, index = store.args[1], store.args[2]
            ex_dest, ex_value = example(dest), example(value)
            if not isinstance(dim, int) or not isinstance(index, fx.Node) or ex_dest is None or ex_value is None:
                return None, f"{store.name}: index_copy_ with a computed dimension"
            length, n = int(ex_dest.shape[dim]), int(ex_value.shape[dim])
            probes[store] = torch.arange(length - n, length, dtype=torch.int64)
            index_nodes.append((index, None, length))
        elif name in ("setitem", "__setitem__"):
            if not _static(store.args[1]):
                return None, (
                    f"{store.name} writes the cache at positions computed in the graph (e.g. from .item()), which "
                    "the pass cannot follow"
                )
            probes[store] = None
        else:
            probes[store] = None
    steps = sorted(all_moves | set(probes), key=order.__getitem__)
    return Writes(sorted(all_leaves, key=order.__getitem__), steps, probes, index_nodes), ""


def movement_replay(node: fx.Node, placeholders: list[fx.Node]):
    """(input index, fn) such that fn(inputs[index]) recomputes `node` when it is pure data movement
    (`.contiguous()`, slicing, views) of one graph input; None otherwise. For host-side checks of an input
    as an op sees it (the check_mask option)."""
    leaves, moves = movement_leaves(node)
    if len(leaves) != 1 or leaves[0] not in placeholders:
        return None
    leaf = leaves[0]
    # Snapshot the chain now: the rewrite erases these nodes (and fx clears an erased node's args).
    graph = fx.Graph()
    copies = {leaf: graph.placeholder("value")}
    for n in moves:
        copies[n] = graph.node_copy(n, lambda a: copies[a])
    graph.output(copies[node])
    replay = fx.GraphModule(torch.nn.Module(), graph)
    return placeholders.index(leaf), replay


@dataclass
class LeafUse:
    """How one leaf feeds an attention input: its layout and the sequence positions read."""

    node: fx.Node
    shape: tuple[int, ...]  # the leaf read with heads split out, e.g. (B, S, H*D) read as (B, S, H, D)
    seq_dim: int  # which dim of `shape` is the sequence
    head_dim_index: int  # which dim is the head axis
    kv_index: int | None  # for a leaf with a leading K/V axis (a (2, B, L, H, D) cache): which half


@dataclass
class Provenance:
    """Per column of an attention input (B, H, L, D): the leaf and sequence position it reads."""

    columns: list[tuple[fx.Node, int]]
    uses: dict[fx.Node, LeafUse] = field(default_factory=dict)
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


def _layouts(ndim: int) -> list[tuple[int | None, int, int, int, int]]:
    """Candidate (kv, batch, seq, head, dim) axes of a leaf."""
    if ndim == 4:
        return [(None, 0, 1, 2, 3), (None, 0, 2, 1, 3)]
    if ndim == 5:
        return [(0, 1, 2, 3, 4), (0, 1, 3, 2, 4)]
    return []


def _candidates(shape: tuple[int, ...], head_dim: int, batch: int):
    """(shape to read the leaf as, axes) pairs: as is; with a fused H*D last axis split in two; and with a
    leading flattened token axis (vLLM's (num_tokens, H, D) or (num_tokens, H*D)) split into (batch, seq).
    Splits keep row-major order, so every candidate is verified element by element by the caller."""
    shapes = [shape]
    if shape and shape[-1] % head_dim == 0 and shape[-1] != head_dim:
        shapes.append(shape[:-1] + (shape[-1] // head_dim, head_dim))
    for s in list(shapes):
        if len(s) == 3 and batch > 0 and s[0] % batch == 0:
            shapes.append((batch, s[0] // batch) + s[1:])
    return [(s, axes) for s in shapes for axes in _layouts(len(s))]


def provenance(node: fx.Node, writes: Writes | None = None) -> tuple[Provenance | None, str]:
    """Where each column of the attention input `node` ((B, H, L, D)) comes from, or a refusal reason.

    `writes`: in-place stores into stand-ins that `node` reads back (`plan_writes`), followed on the tags.
    """
    leaves, moves = movement_leaves(node)
    if writes is not None:
        leaves, moves = writes.leaves, [n for n in writes.steps if n not in writes.probes]
    values = _evaluate(node, leaves, moves, writes)
    if values is None:
        return None, "its data-movement chain could not be evaluated at static shapes"
    tags = values[node]
    if tags.dim() != 4:
        return None, f"attention input has {tags.dim()} dims, expected (batch, heads, seq, head_dim)"
    Bx, Hx, Lx, Dx = tags.shape
    leaf_ids = tags >> _TAG_SHIFT
    flat = tags & _TAG_MASK
    if not bool((leaf_ids == leaf_ids[:1, :1, :, :1]).all()):
        return None, "a key/value column mixes several tensors"
    col_leaf = leaf_ids[0, 0, :, 0]
    columns: list[tuple[fx.Node, int] | None] = [None] * Lx
    uses: dict[fx.Node, LeafUse] = {}
    b_idx = torch.arange(Bx).view(-1, 1, 1, 1)
    d_idx = torch.arange(Dx).view(1, 1, 1, -1)
    for lid in torch.unique(col_leaf).tolist():
        leaf = leaves[lid - 1]
        cols = torch.nonzero(col_leaf == lid).flatten()
        sub = flat[:, :, cols, :]
        found = None
        for shape, (kv, b, s, h, d) in _candidates(tuple(example(leaf).shape), Dx, Bx):
            if shape[b] != Bx or shape[d] != Dx or Hx % shape[h]:
                continue
            strides = [1] * len(shape)
            for i in range(len(shape) - 2, -1, -1):
                strides[i] = strides[i + 1] * shape[i + 1]
            coords = [(sub // strides[i]) % shape[i] for i in range(len(shape))]
            rep = Hx // shape[h]
            h_idx = (torch.arange(Hx) // rep).view(1, -1, 1, 1)
            ok = (
                bool((coords[b] == b_idx).all())
                and bool((coords[h] == h_idx).all())
                and bool((coords[d] == d_idx).all())
                and bool((coords[s] == coords[s][:1, :1, :, :1]).all())
                and (kv is None or bool((coords[kv] == coords[kv].flatten()[0]).all()))
            )
            if ok:
                kv_index = None if kv is None else int(coords[kv].flatten()[0])
                found = LeafUse(leaf, shape, s, h, kv_index)
                for j, c in enumerate(cols.tolist()):
                    columns[c] = (leaf, int(coords[s][0, 0, j, 0]))
                break
        if found is None:
            return None, (
                f"{leaf.name} does not map batch/heads/head_dim the way the paged op reads them "
                "(expected (B, S, H, D) or (B, H, S, D) leaves, GQA as head h -> kv head h // rep)"
            )
        uses[leaf] = found
    return Provenance(columns, uses, leaves, moves, values, tags[0, 0, :, 0].tolist()), ""


_CAT_FUNCTIONS = {torch.cat, torch.concat, torch.concatenate}


def windowed_columns(prov: Provenance, standins: set[fx.Node]) -> set[int] | None:
    """Columns of an attention input whose new (non-stand-in) token joins the cache history: the window's tokens.

    The cache concatenation is a concatenation whose inputs are cache history (stand-in data only) and new
    tokens (no stand-in data), none of them both: ``cat([cache, new])`` before a window slice
    (``[:, -window:]``), or ``cat([cache[:, :sink], cache[:, sink + chunk:], new])``. The new tokens it joins
    are what the model's cache carries forward; tokens appended later to the joined tensor (DreamZero's
    action registers, even when they are slices of the same roped tensor as the video keys) are not. Read
    from the tags each movement node carries, not from which leaf a token comes from. None when the chain
    has no cache concatenation.
    """
    standin_ids = torch.tensor([i + 1 for i, leaf in enumerate(prov.leaves) if leaf in standins], dtype=torch.int64)
    if not len(standin_ids):
        return None
    joined: list[torch.Tensor] = []
    for n in prov.moves:
        if n.op != "call_function" or n.target not in _CAT_FUNCTIONS or not isinstance(n.args[0], (list, tuple)):
            continue
        kinds = set()
        for part in n.args[0]:
            tags = prov.values.get(part) if isinstance(part, fx.Node) else None
            if not isinstance(tags, torch.Tensor) or not tags.numel():
                continue
            cache = torch.isin(tags >> _TAG_SHIFT, standin_ids)
            kinds.add("mixed" if bool(cache.any()) and not bool(cache.all()) else "cache" if bool(cache.all()) else "new")
        if kinds != {"cache", "new"}:
            continue  # not where history and new tokens first meet
        out = prov.values[n]
        joined.append(out[~torch.isin(out >> _TAG_SHIFT, standin_ids)].flatten())
    if not joined:
        return None
    cols = torch.tensor(prov.column_tags, dtype=torch.int64)
    return set(torch.nonzero(torch.isin(cols, torch.cat(joined))).flatten().tolist())


def sdpa_args(node: fx.Node) -> dict:
    """Normalize an SDPA call's arguments by name."""
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    out = dict(zip(names, node.args))
    out.update(node.kwargs)
    out.setdefault("attn_mask", None)
    out.setdefault("dropout_p", 0.0)
    out.setdefault("is_causal", False)
    out.setdefault("scale", None)
    out.setdefault("enable_gqa", False)
    return out


def find_parameter(start: list[fx.Node], params: set[fx.Node]) -> fx.Node | None:
    """Nearest 2-D parameter placeholder upstream of `start` (breadth-first): the site's layer key."""
    frontier, seen = list(start), set(start)
    while frontier:
        nxt = []
        for n in frontier:
            for a in n.all_input_nodes:
                if a in seen:
                    continue
                seen.add(a)
                if a in params:
                    return a
                nxt.append(a)
        frontier = nxt
    return None


def ancestors(node: fx.Node) -> set[fx.Node]:
    out, stack = set(), [node]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in out:
                out.add(a)
                stack.append(a)
    return out


def to_bshd(graph: fx.Graph, use: LeafUse, start: int, stop: int) -> fx.Node:
    """Insert (at the current insertion point) a (B, S, H, D) view of tokens [start, stop) of a leaf."""
    node = use.node
    if tuple(example(node).shape) != use.shape:
        node = graph.call_method("reshape", (node, *use.shape))
    if use.seq_dim == 2 and use.head_dim_index == 1:
        node = graph.call_method("transpose", (node, 1, 2))
    if (start, stop) != (0, use.shape[use.seq_dim]):
        node = graph.call_function(operator.getitem, (node, (slice(None), slice(start, stop))))
    return node


def write_rows(writes: Writes, stores: list[fx.Node], prov: Provenance) -> list[tuple[fx.Node, int | None, int]] | str:
    """Per data-positioned store: (index node, the row its value comes from or None for all rows, cache length).

    The index must be data movement of one graph input (the runtime checks its values at every call)."""
    out = []
    probed = [s for s in stores if writes.probes.get(s) is not None]
    for store, (index, _, length) in zip(probed, writes.index_nodes):
        leaves, _ = movement_leaves(index)
        if len(leaves) != 1 or leaves[0].op != "placeholder":
            return (f"{store.name} writes the cache at positions computed inside the graph; pass them in (e.g. "
                    "position_ids) so that the runtime can check them against its layout")
        value = store.args[STORE_VALUE_ARG["index_copy_"]]
        tags = prov.values.get(value)
        if not isinstance(tags, torch.Tensor):
            return f"{store.name}: its written value could not be followed"
        leaf_ids = torch.unique(tags >> _TAG_SHIFT).tolist()
        if len(leaf_ids) != 1:
            return f"{store.name} writes several tensors at once"
        shape = tuple(example(prov.leaves[leaf_ids[0] - 1]).shape)
        rows = torch.unique((tags & _TAG_MASK) // (int(torch.Size(shape).numel()) // shape[0])).tolist()
        out.append((index, None if len(rows) == shape[0] and tags.dim() == len(shape) else rows[0], length))
        if len(rows) != 1 and out[-1][1] is not None:
            return f"{store.name} writes part of several rows"
    return out
