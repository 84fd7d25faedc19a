"""Rewrite every KV-cache attention site of a dynamo graph into one `paged_kv::write_attend` call.

Runs on a copy of dynamo's graph. For each SDPA node whose keys read a cache stand-in (or whose keys
are stored into one), a family idiom must match; the site becomes ``write_attend(q, k_new, v_new,
pool, slot_mapping, block_table, seq_lens, kv_visible_end)`` with the pool and metadata added as
extra placeholders (and the pool's scales, ``kv_scales=``, when it stores FP8: pool.py); the layer's slot
mapping and block table are computed in the graph from the shared metadata and one per-layer base
(`metadata.py: layer_metadata`). Stores into stand-ins are dropped (the op writes the pool), returned caches
become stand-ins again, and a graph that still reads a stand-in afterwards is an error: it would compute on
zeros. A site whose keys and values are a region stand-in (a shared write-once region, `passes/region.py`:
DreamZero's cross-attention) becomes ``attend(q, pool, region table, ...)``, the read-only op, with the
forward's region table (`metadata.py: layer_block_table`).
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from ..errors import PassError
from ..metadata import layer_block_table, layer_metadata
from .. import families
from .idioms import Expectation, Match
from .common import SDPA_TARGETS, example, find_parameter, movement_leaves, movement_replay, sdpa_args, to_bshd
from .region import region_source
from .site import Site, analyze, store_nodes


@dataclass
class SiteReport:
    """One attention site: what it is, which layer key it binds to, and what happened to it."""

    node: str
    pattern: str
    layer_key: str | None
    status: str  # "rewritten" | "dense" | "refused"
    reason: str = ""


@dataclass
class RewrittenSite:
    weight_input: int  # index of the layer-key parameter among the graph's inputs
    layer_key: str
    mask_input: int | None = None  # index of the dense mask among the inputs (for the check_mask option)
    mask_replay: Callable | None = None  # the input -> the mask the site reads (data movement such as .contiguous())
    #: (input index, input -> write positions, row or None for every row) per store at data positions (Tencent's
    #: index_copy_ at position_ids): checked against the runtime's layout at every call
    write_checks: list[tuple[int, Callable, int | None]] = field(default_factory=list)


@dataclass
class PassResult:
    graph_module: fx.GraphModule
    reports: list[SiteReport]
    sites: list[RewrittenSite] = field(default_factory=list)
    expect: Expectation | None = None  # what every rewritten site of the graph assumes of the forward
    shape: tuple[int, int, int] | None = None  # (rows, tokens, context) the graph was compiled for
    region_tokens: int | None = None  # tokens of the shared region its `attend` sites read (None: no such site)

    @property
    def changed(self) -> bool:
        return bool(self.sites)


def _source_name(node: fx.Node) -> str:
    src = getattr(node, "_dynamo_source", None)
    return src.name if src is not None and hasattr(src, "name") else node.name


def _output_standin_replacements(graph: fx.Graph, standins: set[fx.Node]) -> set[fx.Node]:
    """Graph outputs built from stand-ins (returned dense caches) become zero-stride stand-ins again.

    Returns the nodes it added (a 0-d view of a stand-in, expanded): the only stand-in reads allowed.
    """
    out = next(n for n in graph.nodes if n.op == "output")
    added: set[fx.Node] = set()

    def replace(a):
        if isinstance(a, (list, tuple)):
            return type(a)(replace(x) for x in a)
        if not isinstance(a, fx.Node) or a in standins:
            return a
        leaves, _ = movement_leaves(a)
        hit = next((leaf for leaf in leaves if leaf in standins), None)
        if hit is None:
            return a
        shape = tuple(example(a).shape)
        with graph.inserting_before(out):
            scalar = graph.call_function(operator.getitem, (hit, (0,) * example(hit).dim()))
            expanded = graph.call_method("expand", (scalar, *shape))
        added.update((scalar, expanded))
        return expanded

    out.args = replace(out.args)
    return added


def match_site(site: Site) -> Match | str:
    """The one idiom of the registered families that `site` is, or why it is none of them (or several: a site two
    idioms match is ambiguous and refused, both named, rather than rewritten by whichever is asked first)."""
    hits, reasons = [], []
    for idiom, accepted_by in families.accepted_idioms():
        got = idiom.match(site)
        if isinstance(got, Match):
            hits.append((idiom, accepted_by, got))
        else:
            reasons.append(f"{idiom.name}: {got}")
    if len(hits) == 1:
        return hits[0][2]
    if hits:
        return ("ambiguous: it matches " + " and ".join(
            f"idiom {idiom.name!r} (accepted by {', '.join(by)})" for idiom, by, _ in hits)
            + "; one site must be one idiom: make one family's idiom stricter or do not register both families")
    return "; ".join(reasons) or "no registered family accepts an idiom"


def rewrite(
    gm: fx.GraphModule,
    example_inputs: list,
    *,
    is_standin,
    kernel: str = "auto",
    strict: bool = False,
    kv_scales: bool = False,
    is_region=lambda value: False,
) -> PassResult:
    """Rewrite `gm` (a copy the caller owns) in place; returns the report and the added inputs' roles.

    `kv_scales`: the pool stores FP8, and its scales come as one more input after kv_visible_end.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    values = dict(zip(placeholders, example_inputs))
    standins = {n for n, v in values.items() if is_standin(v)}
    regions = {n for n in standins if is_region(values[n])}  # shared write-once regions: read with `attend`
    params = {n for n, v in values.items() if isinstance(v, torch.nn.Parameter) and v.dim() == 2}
    sdpa_nodes = [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
    reports: list[SiteReport] = []
    if not standins:
        reports = [SiteReport(n.name, "-", None, "dense", "no cache stand-in among the inputs") for n in sdpa_nodes]
        return PassResult(gm, reports)

    # A symbolic int input whose only role is a value (vllm-omni DreamZero's `current_start_frame`, marked
    # dynamic through torch.compiler.config.dynamic_sources so that one graph serves every start frame) is
    # fine; a tensor whose shape is symbolic is not: paged sites are compiled per fixed-shape bucket.
    symbolic = [n.name for n in placeholders
                if isinstance(example(n), torch.Tensor) and any(not isinstance(d, int) for d in example(n).shape)]
    if symbolic:
        raise PassError(
            f"this graph has dynamic shapes ({', '.join(symbolic)}) and reads KV-cache stand-ins: paged sites are "
            "compiled per fixed-shape bucket. Compile with torch.compile(..., dynamic=False)"
        )
    stores = store_nodes(graph, standins)
    matched: list[tuple[Site, Match, fx.Node]] = []
    region_matched: list[tuple[fx.Node, fx.Node, fx.Node]] = []  # (sdpa, region stand-in, layer weight)
    for node in sdpa_nodes:
        source = region_source(node, regions) if regions else None
        if source is not None:
            weight = find_parameter([sdpa_args(node)["query"]], params) if isinstance(source, fx.Node) else None
            why = source if isinstance(source, str) else (
                "" if weight is not None else "no per-layer 2-D weight feeds its query: the layer cannot be identified")
            if why:
                reports.append(SiteReport(node.name, "?", None, "refused", why))
                msg = f"attention site {node.name} reads a shared-region stand-in but cannot be rewritten: {why}"
                if strict:
                    raise PassError(msg)
                warnings.warn(msg + " (the graph will be rejected: a stand-in holds no data)", stacklevel=2)
            else:
                region_matched.append((node, source, weight))
                reports.append(SiteReport(node.name, "shared-region", _source_name(weight), "rewritten"))
            continue
        site = analyze(node, standins - regions, stores, params)
        if site is None:
            reports.append(SiteReport(node.name, "-", None, "dense", "reads no cache stand-in (e.g. cross-attention)"))
            continue
        got = site if isinstance(site, str) else match_site(site)
        match: Match | None = got if isinstance(got, Match) else None
        why = "" if match else got
        weight = find_parameter([span.use.node for span in site.k_new], params) if match else None
        if match and weight is None:
            why = "no per-layer 2-D weight feeds its keys, so the layer cannot be identified at run time"
            match = None
        if match is None:
            reports.append(SiteReport(node.name, "?", None, "refused", why))
            msg = f"attention site {node.name} reads a KV-cache stand-in but cannot be rewritten: {why}"
            if strict:
                raise PassError(msg)
            warnings.warn(msg + " (the graph will be rejected: a stand-in holds no data)", stacklevel=2)
            continue
        matched.append((site, match, weight))
        reports.append(SiteReport(node.name, match.pattern, _source_name(weight), "rewritten"))

    result = PassResult(gm, reports)
    if region_matched and not matched:
        raise PassError(
            "this graph reads a shared region (a region stand-in) but has no KV-cache window site to give it a shape "
            "bucket: compile the block that holds the self-attention too (DreamZero: the whole CausalWanBlock)")
    if matched:
        shapes = set()
        for site, match, _ in matched:
            q = example(site.node)  # (B, H, T, D)
            shapes.add((q.shape[0], q.shape[2], match.expect.context))
            if result.expect is not None and result.expect != match.expect:
                raise PassError(f"sites of one graph disagree on their layout: {result.expect} vs {match.expect}")
            result.expect = match.expect
        if len(shapes) != 1:
            raise PassError(f"sites of one graph have different shapes {sorted(shapes)}; compile blocks separately")
        result.shape = shapes.pop()
        for node, source, _ in region_matched:
            q, standin = example(sdpa_args(node)["query"]), example(source)
            if (q.shape[0], q.shape[2]) != result.shape[:2]:
                raise PassError(f"the region site {node.name} computes {tuple(q.shape)} queries, not the "
                                f"(rows, tokens) = {result.shape[:2]} of the graph's window sites")
            if result.region_tokens not in (None, standin.shape[2]):
                raise PassError(f"region sites of one graph read regions of {result.region_tokens} and "
                                f"{standin.shape[2]} tokens; compile blocks separately")
            result.region_tokens = standin.shape[2]
        _insert_ops(graph, matched, placeholders, kernel, result, kv_scales, region_matched)

    # Stores into a stand-in that no rewritten site took over (its site was refused): dead-code elimination
    # would drop them silently (FX treats in-place methods as pure), and later forwards would read a cache
    # that was never written. Collect them before it runs; they are leftover uses like any read.
    live = set(graph.nodes)
    lost_stores = [n for n in stores if n in live]
    allowed = _output_standin_replacements(graph, standins)
    graph.eliminate_dead_code(is_impure_node=_mutates_or_impure)
    leftovers = list(dict.fromkeys(lost_stores + [u for s in standins for u in s.users if u not in allowed]))
    if leftovers:
        raise PassError(
            "the graph still reads a KV-cache stand-in after rewriting ("
            + ", ".join(f"{u.name}: {u.op} {getattr(u.target, '__name__', u.target)}" for u in leftovers)
            + "); a stand-in holds no data, so this would compute on zeros"
            + (" (and a store into it would be lost: later forwards would read a cache that was never written)"
               if lost_stores else "")
            + ". Use a supported attention idiom (see the pass report) or run this model densely"
        )
    gm.recompile()
    return result


def _mutates_or_impure(node: fx.Node) -> bool:
    """What dead-code elimination must keep: FX's default treats in-place methods as pure and drops one whose result
    is unused, but it writes its input. Dynamo traces a tensor-parallel all-reduce (`dist.all_reduce(x)`, vLLM's
    RowParallelLinear) as `x.copy_(wait_tensor(all_reduce(x)))`: dropping that copy_ loses the reduction."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.op in ("call_method", "call_function") and isinstance(name, str) and name.endswith("_") \
            and not name.endswith("__"):
        return True
    return node.is_impure()


#: Metadata placeholders shared by every site of a graph, after pool, seq_lens, kv_visible_end (and the FP8
#: scales); each site then gets its layer's block base. `backend.py` appends the tensors in this order (metadata.py).
SHARED_METADATA = ("paged_kv_positions", "paged_kv_table0", "paged_kv_table_managed")
#: ...then, in a graph with shared-region sites, the forward's region table (metadata.py: `stage_regions`)
REGION_METADATA = ("paged_kv_region_table0", "paged_kv_region_managed", "paged_kv_region_seq_lens",
                   "paged_kv_region_visible_end")


def _insert_ops(graph: fx.Graph, matched, placeholders, kernel: str, result: PassResult,
                kv_scales: bool = False, region_matched=()) -> None:
    last = placeholders[-1]
    shared = ["paged_kv_pool", "paged_kv_seq_lens", "paged_kv_visible_end"] + (["paged_kv_kv_scales"] if kv_scales else [])
    region_names = list(REGION_METADATA) if region_matched else []
    with graph.inserting_after(last):
        extra_nodes = []
        for name in shared + list(SHARED_METADATA) + region_names + [
            f"paged_kv_block_base_{i}" for i in range(len(matched) + len(region_matched))
        ]:
            extra_nodes.append(graph.placeholder(name))
    # graph.placeholder inserts each after `last` in reverse order: put them in call order.
    for node in extra_nodes:
        node._dynamo_source = None
    for prev, node in zip([last] + extra_nodes[:-1], extra_nodes):
        prev.append(node)
    pool, seq_lens, visible = extra_nodes[:3]
    scales = {"kv_scales": extra_nodes[3]} if kv_scales else {}
    base = len(shared)
    positions, table0, table_managed = extra_nodes[base : base + len(SHARED_METADATA)]
    base += len(SHARED_METADATA)
    region_meta = extra_nodes[base : base + len(region_names)]
    base += len(region_names)
    index_of = {n: i for i, n in enumerate(placeholders)}
    for i, (site, match, weight) in enumerate(matched):
        block_base = extra_nodes[base + i]
        node = site.node
        with graph.inserting_before(node):
            # This layer's slots and block table from the shared metadata and its base: computed here, on the
            # device and inside a captured graph, instead of per layer and per token by the host (metadata.py).
            block_size = graph.call_method("size", (pool, 2))  # the pool is [2, blocks, block_size, H, D]
            meta = graph.call_function(layer_metadata, (positions, table0, table_managed, block_base, block_size))
            slot, table = (graph.call_function(operator.getitem, (meta, j)) for j in range(2))
            q, k, v = (_concat(graph, [to_bshd(graph, s.use, s.start, s.stop) for s in uses]) for uses in (site.q_new, site.k_new, site.v_new))
            d = example(node).shape[-1]
            scale = site.args["scale"] if site.args["scale"] is not None else float(d) ** -0.5
            out = graph.call_function(
                torch.ops.paged_kv.write_attend.default,
                (q, k, v, pool, slot, table, seq_lens, visible, float(scale), kernel, match.visibility),
                scales,
            )
            replacement = graph.call_method("transpose", (out, 1, 2))
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        for store in site.stores:
            if store.graph is graph:
                store.replace_all_uses_with(store.args[0])
                graph.erase_node(store)
        mask = site.args["attn_mask"]
        replay = movement_replay(mask, placeholders) if isinstance(mask, fx.Node) else None
        writes = []
        for index_node, row, _ in site.write_indices:
            got = movement_replay(index_node, placeholders)
            if got is None:  # site.analyze already required one input; kept as a guard against a wrong answer
                raise PassError(f"the write positions of {node.name} are not an input of the graph; cannot check them")
            writes.append((*got, row))
        result.sites.append(RewrittenSite(index_of[weight], _source_name(weight), *(replay or (None, None)), writes))
    for i, (node, _, weight) in enumerate(region_matched, start=len(matched)):
        _insert_region_op(graph, node, pool, scales, region_meta, extra_nodes[base + i], kernel)
        result.sites.append(RewrittenSite(index_of[weight], _source_name(weight)))


def _insert_region_op(graph: fx.Graph, node: fx.Node, pool, scales: dict, region_meta, block_base, kernel: str) -> None:
    """SDPA over a region stand-in -> `attend` over this layer's region table: all of the row's region, no write."""
    table0, managed, seq_lens, visible = region_meta
    args = sdpa_args(node)
    with graph.inserting_before(node):
        table = graph.call_function(layer_block_table, (table0, managed, block_base))
        q = graph.call_method("transpose", (args["query"], 1, 2))  # (B, H, T, D) -> (B, T, H, D)
        d = example(node).shape[-1]
        scale = args["scale"] if args["scale"] is not None else float(d) ** -0.5
        out = graph.call_function(torch.ops.paged_kv.attend.default,
                                  (q, pool, table, seq_lens, visible, float(scale), kernel, "full"), scales)
        replacement = graph.call_method("transpose", (out, 1, 2))
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)


def _concat(graph: fx.Graph, nodes: list[fx.Node]) -> fx.Node:
    return nodes[0] if len(nodes) == 1 else graph.call_function(torch.cat, (nodes, 1))
