"""Writes into cache stand-ins: finding them, following them on tags, and checking what they write.

A model may store its new keys/values into its dense cache in place (HunyuanImage-3's prefill, Tencent's static
cache, Self-Forcing's rolling cache). The rewrite drops such stores (the op writes the pool), which is only right
when a store writes exactly the keys/values the attention reads (`store_problem`). When the attention reads the
cache back after the store, the store is run on tags with the movement around it (`plan_writes`), so that which
cache slot or new token each key column is stays structural.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.fx as fx

from .graph import example, find_parameter, node_order
from .provenance import Provenance
from .tags import evaluate, leaf_index, movement_leaves, offset

STORE_METHODS = {"copy_", "__setitem__", "index_put_", "index_copy_", "fill_", "zero_", "masked_fill_"}
_STORE_FUNCTIONS = {"setitem", "copy_", "index_put_"}

#: where a store's written value sits among its arguments (the rest are the destination, indices or masks)
STORE_VALUE_ARG = {"copy_": 1, "setitem": 2, "__setitem__": 2, "index_put_": 2, "index_copy_": 3}


def store_name(store: fx.Node) -> str:
    """`index_copy_`, `copy_`, `setitem`, ...: the in-place operation a store node performs."""
    return store.target if store.op == "call_method" else getattr(store.target, "__name__", str(store.target))


def store_nodes(graph: fx.Graph, standins: set[fx.Node]) -> list[fx.Node]:
    """In-place writes whose destination is (a view of) a cache stand-in."""
    out = []
    for n in graph.nodes:
        is_store = (n.op == "call_method" and n.target in STORE_METHODS) or (
            n.op == "call_function" and getattr(n.target, "__name__", "") in _STORE_FUNCTIONS
        )
        if is_store and n.args and isinstance(n.args[0], fx.Node):
            leaves, _ = movement_leaves(n.args[0])
            if any(leaf in standins for leaf in leaves):
                out.append(n)
    return out


def store_weight(store: fx.Node, params: set[fx.Node]) -> fx.Node | None:
    """The layer weight behind the value a store writes (everything but its destination)."""
    sources = [a for a in store.all_input_nodes if a is not store.args[0]]
    return find_parameter(sources, params) if sources else None


#: movement that materializes its result (a new tensor): reading from it after a store does not see the store
_MATERIALIZING = {"cat", "concat", "concatenate", "stack", "clone"}


def _materializes(node: fx.Node) -> bool:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name in _MATERIALIZING


def _reads_after(store: fx.Node, chain: fx.Node, standins: set[fx.Node], order: dict) -> bool:
    """Whether the movement chain ending at `chain` reads stand-in memory after `store` ran: a node of it later in
    the graph than the store takes a stand-in or a view of one (anything but a materializing copy of it) as input.
    A chain that copied the cache out before the store (LingBot-World's ``cat`` before its ``copy_`` write-back)
    attends over the cache as it was, not as written."""
    leaves, moves = movement_leaves(chain)
    aliases = {leaf for leaf in leaves if leaf in standins}
    for n in sorted(moves, key=order.__getitem__):
        inputs = set(n.all_input_nodes)
        if order[n] > order[store] and inputs & aliases:
            return True
        if not _materializes(n) and inputs & aliases:
            aliases.add(n)
    return False


def stores_read_back(node: fx.Node, args: dict, standins: set[fx.Node], stores: list[fx.Node]) -> list[fx.Node]:
    """Stores (in graph order) into a stand-in that the site `node`'s keys/values read back after the write."""
    order = node_order(node.graph)
    read = set()
    for name in ("key", "value"):
        leaves, _ = movement_leaves(args[name])
        read |= {leaf for leaf in leaves if leaf in standins}
    before = [s for s in stores if order[s] < order[node]]
    return [s for s in before if set(movement_leaves(s.args[0])[0]) & read
            and any(_reads_after(s, args[name], standins, order) for name in ("key", "value"))]


def writes_back_attended(store: fx.Node, attended: dict, prov_values: dict) -> bool:
    """Whether `store` writes exactly the keys (or values) the attention reads, all of them, into the cache it
    read them from: the model's cache then holds the attended history plus the new tokens, which is what a
    committing forward of the paged op keeps (LingBot-World's ``cache.key[:, :end].copy_(cat(history, new))``).

    `attended`: "key"/"value" -> the SDPA input; `prov_values`: "key"/"value" -> the tags of that input's chain.
    Compared on tags: the written value must be a movement ancestor of the attended input holding the same
    elements (the attended input is a rearrangement of it)."""
    value = store.args[STORE_VALUE_ARG["copy_"]] if store_name(store) == "copy_" and len(store.args) > 1 else None
    if not isinstance(value, fx.Node) or not set(movement_leaves(store.args[0])[0]) & set(movement_leaves(value)[0]):
        return False  # not a copy, or into another tensor than the cache the value reads
    if not _writes_a_prefix(store.args[0], example(value)):
        return False
    for name, node in attended.items():
        tags = prov_values[name]
        if value not in tags or not isinstance(tags.get(node), torch.Tensor):
            continue
        got, want = tags[value].flatten(), tags[node].flatten()
        if got.numel() == want.numel() and torch.equal(got.sort().values, want.sort().values):
            return True
    return False


def _writes_a_prefix(dest: fx.Node, value: torch.Tensor | None) -> bool:
    """Whether `dest` is the first `value.shape[1]` slots (axis 1) of one (B, L, H, D) cache, in order: what the
    cache's next forward reads as its history then starts from slot 0 (read on tags)."""
    leaves, moves = movement_leaves(dest)
    ex = example(leaves[0]) if len(leaves) == 1 else None
    if value is None or ex is None or ex.dim() != 4 or value.dim() != 4:
        return False
    values = evaluate(dest, leaves, moves)
    tags = values.get(dest) if values is not None else None
    if not isinstance(tags, torch.Tensor) or tuple(tags.shape) != tuple(value.shape):
        return False
    B, L, H, D = ex.shape
    want = torch.arange(B * L * H * D).view(B, L, H, D)[:, : value.shape[1]]
    return torch.equal(offset(tags), want)


def store_problem(store: fx.Node, new_leaves: set[fx.Node], followed: set[fx.Node] = frozenset(),
                  standins: set[fx.Node] = frozenset()) -> str:
    """Why a store into a stand-in is not a plain copy of the site's new keys/values ("" when it is).

    The pass drops such stores and the op writes the keys/values the attention reads instead, which is only
    the same when the store writes exactly those tensors (through data movement, optionally zeroed where a
    row is padding: ``torch.where(valid, key[:, :P], 0)``, as HunyuanImage-3 does). A store in `followed`
    (its effect on what the attention reads was followed on tags) may also move stand-in data within the cache
    (a rolling cache's eviction shift): the history it produces is what the runtime's window supplies.
    """
    name = store_name(store)
    index = STORE_VALUE_ARG.get(name)
    value = store.args[index] if index is not None and len(store.args) > index else None
    if not isinstance(value, fx.Node):
        return f"it writes the cache with {name}, which the pass cannot verify"
    if (value.op == "call_function" and value.target is torch.where and len(value.args) == 3
            and isinstance(value.args[1], fx.Node) and value.args[2] in (0, 0.0)):
        value = value.args[1]  # zeroing padded positions: they are never read
    leaves, _ = movement_leaves(value)
    if store in followed and leaves and all(leaf in standins for leaf in leaves):
        return ""  # an eviction shift inside the cache, read structurally
    if len(leaves) != 1 or leaves[0] not in new_leaves:
        return (
            "it stores something else into the cache than the keys/values it attends with (arithmetic or another "
            "tensor): the paged op can only keep what the attention reads"
        )
    return ""


class PositionedWrite(NamedTuple):
    """A store at positions that are data (`index_copy_` at `position_ids`, Tencent's HunyuanStaticCache)."""

    index: fx.Node  # the positions it writes at
    row: int | None  # the batch row whose value it writes (None: every row)
    cache_length: int  # the length of the cache axis it addresses


@dataclass
class Writes:
    """In-place stores into cache stand-ins that an attention input reads back, made evaluable on tags
    (a `tags.InPlaceSteps`).

    probes: per `index_copy_` store, the positions used for its data-dependent index (the last positions of
    the written axis: the new tokens land after everything the cache held, as a `cat([cache, new])` would
    put them); a store with constant indices (slices of Python ints) has None.
    positioned: per probed store, in order: its index node and the length of the written axis (the row is
    read later, from the provenance: `positioned_writes`).
    """

    leaves: list[fx.Node]
    steps: list[fx.Node]
    probes: dict[fx.Node, torch.Tensor | None]
    positioned: list[PositionedWrite]

    def performs(self, node: fx.Node) -> bool:
        return node in self.probes

    def perform(self, node: fx.Node, value_of: Callable) -> None:
        """Perform store `node` on tag tensors (its probe: the positions an index_copy_ writes at)."""
        name = store_name(node)
        if name == "index_copy_":
            dest, dim, value = value_of(node.args[0]), node.args[1], value_of(node.args[3])
            dest.index_copy_(dim, self.probes[node], value)
        elif name in ("setitem", "__setitem__"):
            dest, index, value = value_of(node.args[:3])
            dest[index] = value
        elif name == "copy_":
            value_of(node.args[0]).copy_(value_of(node.args[1]))
        else:
            raise TypeError(name)


def _static(a) -> bool:
    if isinstance(a, fx.Node):
        return False
    if isinstance(a, (list, tuple)):
        return all(_static(x) for x in a)
    if isinstance(a, slice):
        return all(_static(x) for x in (a.start, a.stop, a.step))
    return True


def _probe(store: fx.Node) -> tuple[torch.Tensor | None, PositionedWrite | None, str]:
    """(probe, positioned write or None, "") for one store, or (None, None, why) when it cannot be followed."""
    name = store_name(store)
    if name == "index_copy_":
        dim, index = store.args[1], store.args[2]
        ex_dest, ex_value = example(store.args[0]), example(store.args[3])
        if not isinstance(dim, int) or not isinstance(index, fx.Node) or ex_dest is None or ex_value is None:
            return None, None, f"{store.name}: index_copy_ with a computed dimension"
        length, n = int(ex_dest.shape[dim]), int(ex_value.shape[dim])
        return torch.arange(length - n, length, dtype=torch.int64), PositionedWrite(index, None, length), ""
    if name in ("setitem", "__setitem__") and not _static(store.args[1]):
        return None, None, (f"{store.name} writes the cache at positions computed in the graph (e.g. from .item()), "
                            "which the pass cannot follow")
    return None, None, ""


def plan_writes(node: fx.Node, stores: list[fx.Node]) -> tuple[Writes | None, str]:
    """The in-place `stores` (before `node`, in graph order) made evaluable with `node`'s movement chain.

    Supported: `index_copy_(dim, index, value)` where `index` is data (its positions are checked against the
    rows' layouts at run time), and `dest[constant slices] = value` / `dest.copy_(value)`. Anything else
    (indices computed from `.item()`, masks) is refused with the reason.
    """
    leaves, moves = movement_leaves(node)
    all_leaves, all_moves = set(leaves), set(moves)
    probes: dict[fx.Node, torch.Tensor | None] = {}
    positioned: list[PositionedWrite] = []
    for store in stores:
        name = store_name(store)
        value_at = STORE_VALUE_ARG.get(name)
        if value_at is None or len(store.args) <= value_at or not isinstance(store.args[value_at], fx.Node):
            return None, f"{store.name} writes the cache with {name}, which the pass cannot follow"
        for chain in (store.args[0], store.args[value_at]):
            lv, mv = movement_leaves(chain)
            all_leaves.update(lv)
            all_moves.update(mv)
        probes[store], write, why = _probe(store)
        if why:
            return None, why
        if write is not None:
            positioned.append(write)
    order = node_order(node.graph)
    steps = sorted(all_moves | set(probes), key=order.__getitem__)
    return Writes(sorted(all_leaves, key=order.__getitem__), steps, probes, positioned), ""


def positioned_writes(writes: Writes, stores: list[fx.Node], prov: Provenance) -> list[PositionedWrite] | str:
    """Per data-positioned store: its positions, the row its value comes from (None for all rows), cache length.

    The positions must be data movement of one graph input (the runtime checks their values at every call)."""
    out: list[PositionedWrite] = []
    probed = [s for s in stores if writes.probes.get(s) is not None]
    for store, write in zip(probed, writes.positioned):
        leaves, _ = movement_leaves(write.index)
        if len(leaves) != 1 or leaves[0].op != "placeholder":
            return (f"{store.name} writes the cache at positions computed inside the graph; pass them in (e.g. "
                    "position_ids) so that the runtime can check them against the rows' layouts")
        tags = prov.values.get(store.args[STORE_VALUE_ARG["index_copy_"]])
        if not isinstance(tags, torch.Tensor):
            return f"{store.name}: its written value could not be followed"
        sources = torch.unique(leaf_index(tags)).tolist()
        if len(sources) != 1:
            return f"{store.name} writes several tensors at once"
        shape = tuple(example(prov.leaves[sources[0]]).shape)
        rows = torch.unique(offset(tags) // (int(torch.Size(shape).numel()) // shape[0])).tolist()
        every_row = len(rows) == shape[0] and tags.dim() == len(shape)
        if len(rows) != 1 and not every_row:
            return f"{store.name} writes part of several rows"
        out.append(write._replace(row=None if every_row else rows[0]))
    return out
