"""Rewrite every KV-cache attention site of a dynamo graph into one paged op call.

Runs on a copy of dynamo's graph. For each SDPA node whose keys read a cache stand-in (or whose keys
are stored into one), exactly one idiom a registered family accepts must match (`match.py`); the site becomes
``write_attend`` with the pool and metadata added as extra inputs (`extra_inputs.py`: which, in which order,
described once for the pass and the backend; the pool's scales among them when it stores FP8). A site whose keys
and values are a region stand-in (a shared write-once region, `region.py`: DreamZero's cross-attention) becomes
``attend``, the read-only op (`insert.py`). Returned caches become stand-ins again, and a graph that still reads a
stand-in afterwards is an error: it would compute on zeros.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..errors import PassError
from .extra_inputs import extra_inputs
from .graph import SDPA_TARGETS, example, find_parameter, sdpa_args, source_name
from .handwritten import canonicalize
from .idioms import Match
from .insert import add_inputs, insert_attend, insert_write_attend
from .match import AcceptedIdioms, match_site
from .region import region_source
from .result import PassResult, RewrittenSite, SiteReport
from .site import Site, analyze
from .tags import movement_leaves, movement_replay
from .writes import store_nodes

@dataclass
class _Inputs:
    """The graph's placeholders and what the pass needs to know of them."""

    placeholders: list[fx.Node]
    standins: set[fx.Node]  # every cache stand-in, region stand-ins included
    regions: set[fx.Node]  # shared write-once regions: read with `attend`
    params: set[fx.Node]  # 2-D parameters: the candidate layer keys

    @classmethod
    def read(cls, graph: fx.Graph, example_inputs: list, is_standin, is_region) -> "_Inputs":
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        values = dict(zip(placeholders, example_inputs))
        standins = {n for n, v in values.items() if is_standin(v)}
        regions = {n for n in standins if is_region(values[n])}
        params = {n for n, v in values.items() if isinstance(v, torch.nn.Parameter) and v.dim() == 2}
        return cls(placeholders, standins, regions, params)


@dataclass
class _Found:
    """The sites of a graph, as the pass read them."""

    reports: list[SiteReport] = field(default_factory=list)
    #: sites that read a KV-cache stand-in, whatever their idiom (window, rolling cache, prefix):
    #: (site, idiom match, layer weight)
    cache_sites: list[tuple[Site, Match, fx.Node]] = field(default_factory=list)
    regions: list[tuple[fx.Node, fx.Node, fx.Node]] = field(default_factory=list)  # (sdpa, region stand-in, weight)


def _refuse(found: _Found, node: fx.Node, reads: str, why: str, strict: bool) -> None:
    found.reports.append(SiteReport(node.name, "?", None, "refused", why))
    msg = f"attention site {node.name} reads a {reads} but cannot be rewritten: {why}"
    if strict:
        raise PassError(msg)
    warnings.warn(msg + " (the graph will be rejected: a stand-in holds no data)", stacklevel=4)


def _region_site(found: _Found, node: fx.Node, source: fx.Node | str, inputs: _Inputs, strict: bool) -> None:
    weight = find_parameter([sdpa_args(node)["query"]], inputs.params) if isinstance(source, fx.Node) else None
    why = source if isinstance(source, str) else (
        "" if weight is not None else "no per-layer 2-D weight feeds its query: the layer cannot be identified")
    if why:
        return _refuse(found, node, "shared-region stand-in", why, strict)
    found.regions.append((node, source, weight))
    found.reports.append(SiteReport(node.name, "shared-region", source_name(weight), "rewritten"))


def _cache_site(found: _Found, node: fx.Node, inputs: _Inputs, stores: list[fx.Node], strict: bool,
                 idioms: AcceptedIdioms) -> None:
    site = analyze(node, inputs.standins - inputs.regions, stores, inputs.params)
    if site is None:
        found.reports.append(SiteReport(node.name, "-", None, "dense", "reads no cache stand-in (e.g. cross-attention)"))
        return
    got = site if isinstance(site, str) else match_site(site, idioms)
    if not isinstance(got, Match):
        return _refuse(found, node, "KV-cache stand-in", got, strict)
    weight = find_parameter([span.read.node for span in site.new.key], inputs.params, through_index_writes=True)
    if weight is None:
        why = "no per-layer 2-D weight feeds its keys, so the layer cannot be identified at run time"
        return _refuse(found, node, "KV-cache stand-in", why, strict)
    found.cache_sites.append((site, got, weight))
    found.reports.append(SiteReport(node.name, got.pattern, source_name(weight), "rewritten"))


def _refuse_dynamic_shapes(placeholders: list[fx.Node]) -> None:
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


def _graph_shape(result: PassResult, found: _Found) -> None:
    """The one expectation and (rows, tokens, context) every cache site of the graph shares, and the region
    length its region sites share (else refused: such a graph cannot be one bucket's)."""
    shapes = set()
    for site, match, _ in found.cache_sites:
        q = example(site.node)  # (B, H, T, D)
        shapes.add((q.shape[0], q.shape[2], match.expect.context))
        if result.expect is not None and result.expect != match.expect:
            raise PassError(f"sites of one graph disagree on their expectation: {result.expect} vs {match.expect}")
        result.expect, result.idiom = match.expect, match.idiom
    if len(shapes) != 1:
        raise PassError(f"sites of one graph have different shapes {sorted(shapes)}; compile blocks separately")
    result.shape = shapes.pop()
    for node, source, _ in found.regions:
        q, standin = example(sdpa_args(node)["query"]), example(source)
        if (q.shape[0], q.shape[2]) != result.shape[:2]:
            raise PassError(f"the region site {node.name} computes {tuple(q.shape)} queries, not the "
                            f"(rows, tokens) = {result.shape[:2]} of the graph's cache sites")
        if result.region_tokens not in (None, standin.shape[2]):
            raise PassError(f"region sites of one graph read regions of {result.region_tokens} and "
                            f"{standin.shape[2]} tokens; compile blocks separately")
        result.region_tokens = standin.shape[2]


def _host_checks(site: Site, weight: fx.Node, placeholders: list[fx.Node]) -> RewrittenSite:
    """What the compiled function checks of a cache site's inputs at every call: its mask, its write positions."""
    mask = site.args["attn_mask"]
    replay = movement_replay(mask, placeholders) if isinstance(mask, fx.Node) else None
    writes = []
    for write in site.writes.positioned:
        got = movement_replay(write.index, placeholders)
        if got is None:  # site.analyze already required one input; kept as a guard against a wrong answer
            raise PassError(f"the write positions of {site.node.name} are not an input of the graph; cannot check them")
        writes.append((*got, write.row))
    return RewrittenSite(placeholders.index(weight), source_name(weight), *(replay or (None, None)), writes)


def _insert(graph: fx.Graph, found: _Found, placeholders: list[fx.Node], kernel: str, result: PassResult,
            kv_scales: bool, kv_gaps: bool) -> None:
    """Add the extra inputs (`result.inputs`) and replace every matched site by its op, cache sites first."""
    result.inputs = extra_inputs(fp8=kv_scales, gaps=kv_gaps, regions=bool(found.regions),
                                 sites=len(found.cache_sites) + len(found.regions))
    nodes = add_inputs(graph, result.inputs)
    for index, (site, match, weight) in enumerate(found.cache_sites):
        result.sites.append(_host_checks(site, weight, placeholders))
        insert_write_attend(graph, site, match, nodes, index, kernel)
    for index, (node, _, weight) in enumerate(found.regions, start=len(found.cache_sites)):
        insert_attend(graph, node, nodes, index, kernel)
        result.sites.append(RewrittenSite(placeholders.index(weight), source_name(weight)))


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


def _refuse_leftovers(graph: fx.Graph, standins: set[fx.Node], stores: list[fx.Node]) -> None:
    """Raise when the rewritten graph still reads a stand-in or stores into one (after dead-code elimination)."""
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


def rewrite(
    gm: fx.GraphModule,
    example_inputs: list,
    *,
    is_standin,
    kernel: str = "auto",
    strict: bool = False,
    kv_scales: bool = False,
    kv_gaps: bool = True,
    is_region=lambda value: False,
    idioms: AcceptedIdioms = (),
) -> PassResult:
    """Rewrite `gm` (a copy the caller owns) in place; returns the report and the added inputs (`result.inputs`).

    `kv_scales`: the pool stores FP8, and its scales come as one more input (`extra_inputs.KV_SCALES`).
    `kv_gaps`: the runtime's rows may hide keys inside their tables; False leaves the op's `kv_gap` out.
    `idioms`: what a KV-cache site may be, each idiom with the families that accept it (`match.match_site`).
    """
    graph = gm.graph
    inputs = _Inputs.read(graph, example_inputs, is_standin, is_region)
    sdpa_nodes = [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
    if not inputs.standins:
        return PassResult(gm, [SiteReport(n.name, "-", None, "dense", "no cache stand-in among the inputs")
                               for n in sdpa_nodes])
    _refuse_dynamic_shapes(inputs.placeholders)
    stores = store_nodes(graph, inputs.standins)
    found = _Found()
    for node, why in canonicalize(graph, inputs.standins, stores, inputs.params):  # hand-written: SDPA if proven
        _refuse(found, node, "KV-cache stand-in", why, strict)
    sdpa_nodes = [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
    for node in sdpa_nodes:
        source = region_source(node, inputs.regions) if inputs.regions else None
        if source is not None:
            _region_site(found, node, source, inputs, strict)
        else:
            _cache_site(found, node, inputs, stores, strict, idioms)
    result = PassResult(gm, found.reports)
    if found.regions and not found.cache_sites:
        raise PassError(
            "this graph reads a shared region (a region stand-in) but has no KV-cache window site to give it a shape "
            "bucket: compile the block that holds the self-attention too (DreamZero: the whole CausalWanBlock)")
    if found.cache_sites:
        _graph_shape(result, found)
        _insert(graph, found, inputs.placeholders, kernel, result, kv_scales, kv_gaps)
    _refuse_leftovers(graph, inputs.standins, stores)
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
