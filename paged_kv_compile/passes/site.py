"""An attention site read structurally: what its query, keys and values are made of.

`analyze` turns one SDPA node into a `Site` (or says why it cannot be read): the keys split into a
run of history columns from a cache stand-in followed by the freshly computed tokens, the values
alike, the query made of the same new tokens, and any store of those keys into a stand-in.
The idioms (`passes/idioms/`) decide from a `Site` whether it is theirs (`Match`).

A `Site` holds a few records of one meaning each (the new tokens, the key columns, the cache read, the cache
writes); a new idiom reads them, and what it needs beyond them belongs in one of them, not in a new field of
`Site` per idiom.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from .graph import ancestors, example, find_parameter, sdpa_args
from .provenance import LeafRead, Provenance, joining_columns, provenance
from .tags import CAT_FUNCTIONS, movement_leaves
from .writes import (
    PositionedWrite,
    Writes,
    plan_writes,
    positioned_writes,
    store_problem,
    store_weight,
    stores_read_back,
    writes_back_attended,
)

_INPUTS = ("query", "key", "value")


@dataclass(frozen=True)
class NewSpan:
    """Freshly computed tokens [start, stop) along the sequence axis of one leaf."""

    read: LeafRead
    start: int
    stop: int


@dataclass
class NewTokens:
    """The freshly computed tokens the site attends with, as spans of the leaves they are read from (the rewrite
    hands these to the op)."""

    query: list[NewSpan]
    key: list[NewSpan]
    value: list[NewSpan]


@dataclass
class KeyColumns:
    """The site's key columns in order: history columns read from a cache stand-in, then the new tokens. The
    values' columns are the same (checked)."""

    #: the cache position each history column reads; after writes at constant slices (`CacheWrites.read_back`)
    #: the slot as it was BEFORE the forward (followed through the writes and eviction shifts on tags)
    history: list[int]
    #: the new key spans' lengths, in column order
    new_sizes: list[int]
    #: how many of the new tokens (the leading ones) join the cache history in a cache concatenation, i.e. what
    #: the model's cache keeps; None when the keys have no cache concatenation (`provenance.joining_columns`)
    joining: int | None = None


@dataclass
class CacheRead:
    """The cache stand-in the keys and values read their history from (ndim 0 when they read none)."""

    ndim: int = 0
    length: int = 0  # its sequence length
    key_half: int | None = None  # a stand-in with a leading K/V axis ((2, B, L, H, D)): the half the keys read
    value_half: int | None = None  # ... and the half the values read


@dataclass
class CacheWrites:
    """The site's in-place stores into cache stand-ins (the rewrite drops them: the op writes the pool)."""

    stores: list[fx.Node] = field(default_factory=list)
    length: int = 0  # the sequence length (axis 1) of the first store's destination; 0 without stores
    #: stores at positions that are data which the keys/values read back (`index_copy_` at `position_ids`,
    #: Tencent's HunyuanStaticCache): the history columns are then the cache columns the new tokens did not
    #: overwrite; the runtime checks the positions against the rows' layouts at every call
    positioned: list[PositionedWrite] = field(default_factory=list)
    #: keys/values read back after writes at constant slices (a preallocated rolling cache with static indices,
    #: Self-Forcing's): `KeyColumns.history` are then slots before the forward
    read_back: bool = False
    #: with `read_back`: the cache slots the keys read, in the cache as it is AFTER this graph's writes
    read_slots: list[int] = field(default_factory=list)
    #: every store copies the attended keys/values back whole into the cache they were read from, after the
    #: attention's inputs were copied out of it (`writes.writes_back_attended`): the forward keeps its K/V
    written_back: bool = False


@dataclass
class Site:
    node: fx.Node
    args: dict  # the SDPA call's arguments by name (`graph.sdpa_args`)
    new: NewTokens
    keys: KeyColumns
    cache: CacheRead
    writes: CacheWrites


@dataclass
class _Reads:
    """What the site's query, keys and values read, with the in-place writes they read back followed."""

    provs: dict[str, Provenance]
    written: list[fx.Node]  # stores whose effect the keys/values read back
    positioned: list[PositionedWrite]
    read_slots: list[int]


def _read_after_write_refusal(stores: list[fx.Node], why: str) -> str:
    return (
        f"its keys/values are read back from a cache stand-in after an in-place write into it ({stores[0].name}) "
        f"that the pass cannot follow: {why}. A preallocated rolling cache written at [start:end] (CausVid / "
        "Self-Forcing) pages when its indices are a fill state the compiled frame is specialized on (local_end_index "
        "a Python int, a new_block flag instead of absolute indices: docs/models.md), or written as the window "
        "idiom: new_k = cat([cache_k, k], 1)[:, -window:] (same for v), attend over it and return "
        "stack([new_k, new_v]); eviction and write positions are then the runtime's (docs/models.md)"
    )


def _provenances(args: dict, written: list[fx.Node]) -> tuple[dict[str, Provenance], dict[str, Writes]] | str:
    """Each input's provenance, the keys' and values' through the `written` stores they read back."""
    plans: dict[str, Writes] = {}
    for name in ("key", "value") if written else ():
        plan, why = plan_writes(args[name], written)
        if plan is None:
            return _read_after_write_refusal(written, why)
        plans[name] = plan
    provs = {}
    for name in _INPUTS:
        prov, why = provenance(args[name], plans.get(name))
        if prov is None:
            return _read_after_write_refusal(written, f"{name}: {why}") if name in plans else f"{name}: {why}"
        provs[name] = prov
    return provs, plans


def _reads(node: fx.Node, args: dict, standins: set[fx.Node], stores: list[fx.Node]) -> _Reads | str:
    """The site's inputs read structurally; a store they read back is followed (`plan_writes`): at data positions
    the positions are recorded for the runtime's checks, at constant slices the slots read after the writes."""
    written = stores_read_back(node, args, standins, stores)
    got = _provenances(args, written)
    if isinstance(got, str):
        return got
    provs, plans = got
    positioned: list[PositionedWrite] = []
    for name, plan in plans.items():
        found = positioned_writes(plan, written, provs[name])
        if isinstance(found, str):
            return _read_after_write_refusal(written, found)
        positioned += [w for w in found if w not in positioned]
    read_slots: list[int] = []
    if written and not positioned:
        slots, why = provenance(args["key"])  # the same read, before following the writes: which slots it reads
        if slots is None or any(leaf not in standins for leaf, _ in slots.columns):
            return _read_after_write_refusal(written, f"key: the slots it reads could not be followed ({why})")
        read_slots = [pos for _, pos in slots.columns]
    return _Reads(provs, written, positioned, read_slots)


def _split(prov: Provenance, standins: set[fx.Node]) -> tuple[list[int], list[tuple[fx.Node, list[int]]], str]:
    """History positions (stand-in columns first) and the runs of new tokens after them."""
    history: list[int] = []
    new: list[tuple[fx.Node, list[int]]] = []
    for leaf, positions in prov.runs():
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


def _computed_after_concatenation(args: dict, standins: set[fx.Node], history: dict[str, list[int]]) -> str:
    """Where keys/values read a stand-in through computation applied after it is concatenated with new tokens
    (LongCat-Video-Avatar's RoPE over ``cat([k_cache, k])``, its cache holding keys before RoPE): the refusal's
    explanation and fix ("" when that is not the case). `history`: the cache columns each input reads as data."""
    for name in ("key", "value"):
        if history[name]:
            continue
        for node in sorted(ancestors(args[name]), key=lambda n: n.name):
            if (node.op != "call_function" or node.target not in CAT_FUNCTIONS
                    or not isinstance(node.args[0], (list, tuple))):
                continue
            parts = [set(movement_leaves(p)[0]) if isinstance(p, fx.Node) else set() for p in node.args[0]]
            if any(p and p <= standins for p in parts) and any(p and not p & standins for p in parts):
                return (f": the {name}s are computed from the concatenation {node.name} of cached and new tokens "
                        "(e.g. RoPE applied after cat([k_cache, k]), the cache holding keys before RoPE), and the "
                        "paged op can only keep the keys it attends with. Fix: apply the computation (RoPE at each "
                        "token's position) to the new keys before the concatenation, so that the cache holds the "
                        "keys as attended; cached tokens keep their positions, so this computes the same")
    return ""


def _columns(provs: dict[str, Provenance], standins: set[fx.Node],
             stores: list[fx.Node], args: dict) -> tuple[KeyColumns, NewTokens] | str:
    """The key columns (history then new tokens) and the new tokens of query, keys and values, checked to agree."""
    split = {name: _split(provs[name], standins) for name in _INPUTS}
    why = next((split[name][2] for name in ("key", "value", "query") if split[name][2]), "")
    if why:
        return why
    (k_hist, k_new, _), (v_hist, v_new, _), (q_hist, q_new, _) = (split[name] for name in ("key", "value", "query"))
    if q_hist:
        return "the query reads a cache stand-in"
    computed = _computed_after_concatenation(args, standins, {"key": k_hist, "value": v_hist})
    if computed:
        return "a cache stand-in feeds its keys/values through computation, not only data movement" + computed
    if not (k_hist or v_hist or stores):
        return "a cache stand-in feeds its keys/values through computation, not only data movement"
    sizes = [len(p) for _, p in k_new]
    if not sizes:
        return "the keys contain no newly computed tokens"
    if sum(len(p) for _, p in v_new) != sum(sizes) or sum(len(p) for _, p in q_new) != sum(sizes):
        return "query, keys and values do not carry the same number of new tokens"
    if k_hist != v_hist:
        return "keys and values read different history positions"
    spans = {name: [NewSpan(provs[name].reads[leaf], p[0], p[-1] + 1) for leaf, p in split[name][1]]
             for name in _INPUTS}
    return KeyColumns(k_hist, sizes), NewTokens(spans["query"], spans["key"], spans["value"])


def _joining(provs: dict[str, Provenance], history: int, standins: set[fx.Node]) -> int | None | str:
    """How many leading new tokens join the cache history (the same for keys and values), or why not consistent."""
    joining: list[int | None] = []
    for name in ("key", "value"):
        cols = joining_columns(provs[name], standins)
        if cols is None:
            joining.append(None)
            continue
        new_cols = list(range(history, len(provs[name].columns)))
        passed = [c for c in new_cols if c in cols]
        if passed != new_cols[: len(passed)]:
            return (f"the {name} tokens that join the cache history are not the leading new tokens: the cache "
                    "would keep tokens in another order than the attention reads them")
        joining.append(len(passed))
    if joining[0] != joining[1]:
        return f"keys and values join the cache history differently ({joining[0]} vs {joining[1]} new tokens)"
    return joining[0]


def _cache_read(provs: dict[str, Provenance], standins: set[fx.Node]) -> CacheRead | str:
    """Which stand-in the keys read their history from (the first such), and which K/V halves they read."""
    halves = []
    for name in ("key", "value"):
        leaf = next((leaf for leaf, _ in provs[name].columns if leaf in standins), None)
        halves.append(None if leaf is None else provs[name].reads[leaf])
        read = halves[-1]
        if read is not None and read.select_dim is not None and (
                read.select_dim != 0 or read.shape != tuple(example(leaf).shape)):
            return (f"its {name}s read the cache stand-in {leaf.name} {tuple(example(leaf).shape)} as {read.shape} "
                    f"through a selector on axis {read.select_dim}: a cache with a K/V axis must be (2, B, L, H, D) "
                    "with that axis leading")
    key, value = halves
    if key is None:
        return CacheRead(value_half=value.kv_index if value is not None else None)
    # the length along the sequence axis of the shape the stand-in is READ as (a packed (P, H, D) one read as
    # (1, P, H, D): its axis 1 is not the stand-in's own axis 1)
    return CacheRead(example(key.node).dim(), key.shape[key.seq_dim], key.kv_index,
                     value.kv_index if value is not None else None)


def _cache_writes(stores: list[fx.Node], reads: _Reads) -> CacheWrites:
    dest = example(stores[0].args[0]) if stores else None
    length = dest.shape[1] if dest is not None and dest.dim() >= 2 else 0
    return CacheWrites(stores, length, reads.positioned, bool(reads.written) and not reads.positioned,
                       reads.read_slots)


def analyze(node: fx.Node, standins: set[fx.Node], stores: list[fx.Node], params: set[fx.Node]) -> Site | str | None:
    """A `Site`; a refusal reason (str); or None when the site touches no cache at all.

    A site touches the cache when a stand-in is upstream of its keys or values, or when a store into a
    stand-in is fed by the same layer weight as its keys (HunyuanImage-3's step 0).
    """
    args = sdpa_args(node)
    weight = find_parameter([args["key"]], params)
    mine = [s for s in stores if weight is not None and store_weight(s, params) is weight]
    upstream = ancestors(args["key"]) | ancestors(args["value"]) | {args["key"], args["value"]}
    if not (standins & upstream) and not mine:
        return None
    if args["dropout_p"] not in (0, 0.0):
        return "attention dropout is not supported by the paged op"
    reads = _reads(node, args, standins, stores)
    if isinstance(reads, str):
        return reads
    mine = list(dict.fromkeys(mine + reads.written))
    got = _columns(reads.provs, standins, mine, args)
    if isinstance(got, str):
        return got
    keys, new = got
    new_leaves = {span.read.node for span in new.key + new.value}
    attended = {name: args[name] for name in ("key", "value")}
    values = {name: reads.provs[name].values for name in ("key", "value")}
    back = [s for s in mine if s not in reads.written and writes_back_attended(s, attended, values)]
    why = next((w for w in (store_problem(s, new_leaves, set(reads.written), standins) for s in mine if s not in back)
                if w), "")
    if why:
        return why
    joining = _joining(reads.provs, len(keys.history), standins)
    if isinstance(joining, str):
        return joining
    keys.joining = joining
    if any(reads.provs[n].reads[leaf].heads is not None for n in ("key", "value")
           for leaf, _ in reads.provs[n].columns if leaf in standins):
        return "the keys/values read only some heads of a cache stand-in (its stand-in must hold the heads read)"
    cache = _cache_read(reads.provs, standins)
    if isinstance(cache, str):
        return cache
    writes = _cache_writes(mine, reads)
    writes.written_back = bool(mine) and len(back) == len(mine)
    return Site(node, args, new, keys, cache, writes)
