"""An attention site read structurally: what its query, keys and values are made of.

`analyze` turns one SDPA node into a `Site` (or says why it cannot be read): the keys split into a
run of history columns from a cache stand-in followed by the freshly computed tokens, the values
alike, the query made of the same new tokens, and any store of those keys into a stand-in.
The idioms (`passes/idioms/`) decide from a `Site` whether it is theirs (`Match`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .common import (
    STORE_VALUE_ARG,
    LeafUse,
    Provenance,
    Writes,
    ancestors,
    example,
    find_parameter,
    movement_leaves,
    plan_writes,
    provenance,
    write_rows,
    sdpa_args,
    store_name,
    windowed_columns,
)

STORE_METHODS = {"copy_", "__setitem__", "index_put_", "index_copy_", "fill_", "zero_", "masked_fill_"}


@dataclass
class NewSpan:
    """Freshly computed tokens [start, stop) along the sequence axis of one leaf."""

    use: LeafUse
    start: int
    stop: int


@dataclass
class Site:
    node: fx.Node
    args: dict
    q_new: list[NewSpan]
    k_new: list[NewSpan]
    v_new: list[NewSpan]
    new_sizes: list[int]
    history_positions: list[int]
    k_kv_index: int | None
    v_kv_index: int | None
    standin_ndim: int
    standin_seq_len: int
    stores: list[fx.Node] = field(default_factory=list)
    store_seq_len: int = 0
    #: how many of the new tokens (the leading ones) join the cache history in a cache concatenation, i.e. what
    #: the model's cache keeps; None when the keys have no cache concatenation (see common.windowed_columns)
    window_new_tokens: int | None = None
    #: keys/values read back from a stand-in after this graph wrote the new tokens into it at positions that
    #: are data (`index_copy_` at `position_ids`, Tencent's HunyuanStaticCache): (index node, row it writes or
    #: None for every row, cache length) per store. The history columns are then the cache columns the new
    #: tokens did not overwrite; the runtime checks the positions against its layout at every call.
    write_indices: list[tuple[fx.Node, int | None, int]] = field(default_factory=list)
    #: the length of the cache axis such writes address (0 without them)
    written_cache_len: int = 0
    #: keys/values read back from a stand-in after this graph wrote into it at constant slices (a preallocated
    #: rolling cache with static indices, Self-Forcing's): `history_positions` are then the cache slots as they
    #: were BEFORE the forward (followed through the writes and eviction shifts on tags, common.plan_writes)
    read_back: bool = False
    #: with `read_back`: the cache slots the keys read, in the cache as it is AFTER this graph's writes
    read_slots: list[int] = field(default_factory=list)


def store_nodes(graph: fx.Graph, standins: set[fx.Node]) -> list[fx.Node]:
    """In-place writes whose destination is (a view of) a cache stand-in."""
    out = []
    for n in graph.nodes:
        is_store = (n.op == "call_method" and n.target in STORE_METHODS) or (
            n.op == "call_function" and getattr(n.target, "__name__", "") in {"setitem", "copy_", "index_put_"}
        )
        if is_store and n.args and isinstance(n.args[0], fx.Node):
            leaves, _ = movement_leaves(n.args[0])
            if any(leaf in standins for leaf in leaves):
                out.append(n)
    return out


def _split(prov: Provenance, standins: set[fx.Node]) -> tuple[list[int], list[tuple[fx.Node, list[int]]], str]:
    """History positions (stand-in columns first) and the runs of new tokens after them."""
    runs = prov.runs()
    history: list[int] = []
    new: list[tuple[fx.Node, list[int]]] = []
    for leaf, positions in runs:
        if leaf in standins:
            if new:
                return [], [], "cache history columns come after new tokens"
            history.extend(positions)
        else:
            new.append((leaf, positions))
    for leaf, positions in new:
        if positions != list(range(positions[0], positions[0] + len(positions))):
            return [], [], f"new tokens of {leaf.name} are not read as one contiguous, ordered span"
    if len({id(leaf) for leaf, _ in new}) != len(new):
        return [], [], "a new key tensor is read in several pieces"
    return history, new, ""


def _store_weight(store: fx.Node, params: set[fx.Node]) -> fx.Node | None:
    """The layer weight behind the value a store writes (everything but its destination)."""
    sources = [a for a in store.all_input_nodes if a is not store.args[0]]
    return find_parameter(sources, params) if sources else None


def _store_problem(store: fx.Node, new_leaves: set[fx.Node], followed: set[fx.Node] = frozenset(),
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


def _written_before(node: fx.Node, args: dict, standins: set[fx.Node], stores: list[fx.Node]) -> list[fx.Node]:
    """Stores (in graph order) into a stand-in that the site's keys/values read back after the write."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    read = set()
    for name in ("key", "value"):
        leaves, _ = movement_leaves(args[name])
        read |= {leaf for leaf in leaves if leaf in standins}
    written = {leaf for s in stores if order[s] < order[node] for leaf in movement_leaves(s.args[0])[0]}
    if not read & written:
        return []
    return [s for s in stores if order[s] < order[node] and set(movement_leaves(s.args[0])[0]) & read]


def _read_after_write_refusal(stores: list[fx.Node], why: str) -> str:
    return (
        f"its keys/values are read back from a cache stand-in after an in-place write into it ({stores[0].name}) "
        f"that the pass cannot follow: {why}. A preallocated rolling cache written at [start:end] (CausVid / "
        "Self-Forcing) pages when its indices are a fill state the compiled frame is specialized on (local_end_index "
        "a Python int, a new_block flag instead of absolute indices: docs/models.md), or written as the window "
        "idiom: new_k = cat([cache_k, k], 1)[:, -window:] (same for v), attend over it and return "
        "stack([new_k, new_v]); eviction and write positions are then the runtime's (docs/models.md)"
    )


def analyze(node: fx.Node, standins: set[fx.Node], stores: list[fx.Node], params: set[fx.Node]) -> Site | str | None:
    """A `Site`; a refusal reason (str); or None when the site touches no cache at all.

    A site touches the cache when a stand-in is upstream of its keys or values, or when a store into a
    stand-in is fed by the same layer weight as its keys (HunyuanImage-3's step 0).
    """
    args = sdpa_args(node)
    weight = find_parameter([args["key"]], params)
    my_stores = [s for s in stores if weight is not None and _store_weight(s, params) is weight]
    upstream = ancestors(args["key"]) | ancestors(args["value"]) | {args["key"], args["value"]}
    if not (standins & upstream) and not my_stores:
        return None
    if args["dropout_p"] not in (0, 0.0):
        return "attention dropout is not supported by the paged op"
    written = _written_before(node, args, standins, stores)
    write_plans: dict[str, Writes | None] = {"query": None, "key": None, "value": None}
    if written:
        for name in ("key", "value"):
            plan, why = plan_writes(args[name], written)
            if plan is None:
                return _read_after_write_refusal(written, why)
            write_plans[name] = plan
    provs = {}
    for name in ("query", "key", "value"):
        prov, why = provenance(args[name], write_plans[name])
        if prov is None:
            return (_read_after_write_refusal(written, f"{name}: {why}") if write_plans[name] is not None
                    else f"{name}: {why}")
        provs[name] = prov
    write_indices: list[tuple[fx.Node, int | None, int]] = []
    for name in ("key", "value"):
        if write_plans[name] is not None:
            got = write_rows(write_plans[name], written, provs[name])
            if isinstance(got, str):
                return _read_after_write_refusal(written, got)
            write_indices += [w for w in got if w not in write_indices]
    read_slots: list[int] = []
    if written and not write_indices:
        slots, why = provenance(args["key"])  # the same read, before following the writes: which slots it reads
        if slots is None or any(leaf not in standins for leaf, _ in slots.columns):
            return _read_after_write_refusal(written, f"key: the slots it reads could not be followed ({why})")
        read_slots = [pos for _, pos in slots.columns]
    if written:
        my_stores = list(dict.fromkeys(my_stores + written))
    k_hist, k_new, why_k = _split(provs["key"], standins)
    v_hist, v_new, why_v = _split(provs["value"], standins)
    q_hist, q_new, why_q = _split(provs["query"], standins)
    for why in (why_k, why_v, why_q):
        if why:
            return why
    if q_hist:
        return "the query reads a cache stand-in"
    if not (k_hist or v_hist or my_stores):
        return "a cache stand-in feeds its keys/values through computation, not only data movement"
    sizes = [len(p) for _, p in k_new]
    if not sizes:
        return "the keys contain no newly computed tokens"
    if sum(len(p) for _, p in v_new) != sum(sizes) or sum(len(p) for _, p in q_new) != sum(sizes):
        return "query, keys and values do not carry the same number of new tokens"
    if k_hist != v_hist:
        return "keys and values read different history positions"
    new_leaves = {leaf for leaf, _ in k_new} | {leaf for leaf, _ in v_new}
    for store in my_stores:
        why = _store_problem(store, new_leaves, set(written), standins)
        if why:
            return why
    window_new: list[int | None] = []
    for name, hist in (("key", k_hist), ("value", v_hist)):
        cols = windowed_columns(provs[name], standins)
        if cols is None:
            window_new.append(None)
            continue
        new_cols = list(range(len(hist), len(provs[name].columns)))
        passed = [c for c in new_cols if c in cols]
        if passed != new_cols[: len(passed)]:
            return (f"the {name} tokens that join the cache history are not the leading new tokens: the cache "
                    "would keep tokens in another order than the attention reads them")
        window_new.append(len(passed))
    if window_new[0] != window_new[1]:
        return f"keys and values join the cache history differently ({window_new[0]} vs {window_new[1]} new tokens)"
    standin_leaves = {leaf for leaf, _ in provs["key"].columns if leaf in standins}
    standin = next(iter(standin_leaves), None)
    k_kv = provs["key"].uses[standin].kv_index if standin is not None else None
    v_standins = {leaf for leaf, _ in provs["value"].columns if leaf in standins}
    v_kv = provs["value"].uses[next(iter(v_standins))].kv_index if v_standins else None
    ndim = example(standin).dim() if standin is not None else 0
    seq_len = example(standin).shape[provs["key"].uses[standin].seq_dim] if standin is not None else 0
    store_len = 0
    if my_stores:
        dest = example(my_stores[0].args[0])
        store_len = dest.shape[1] if dest is not None and dest.dim() >= 2 else 0
    return Site(
        node=node,
        args=args,
        q_new=[NewSpan(provs["query"].uses[leaf], p[0], p[-1] + 1) for leaf, p in q_new],
        k_new=[NewSpan(provs["key"].uses[leaf], p[0], p[-1] + 1) for leaf, p in k_new],
        v_new=[NewSpan(provs["value"].uses[leaf], p[0], p[-1] + 1) for leaf, p in v_new],
        new_sizes=sizes,
        history_positions=k_hist,
        k_kv_index=k_kv,
        v_kv_index=v_kv,
        standin_ndim=ndim,
        standin_seq_len=seq_len,
        stores=my_stores,
        store_seq_len=store_len,
        window_new_tokens=window_new[0],
        write_indices=write_indices,
        written_cache_len=max((length for _, _, length in write_indices), default=0),
        read_back=bool(written) and not write_indices,
        read_slots=read_slots,
    )
