"""Graph surgery of the rewrite: add the extra inputs, replace an attention site by the paged op.

A matched KV-cache site becomes ``write_attend(q, k_new, v_new, pool, slot_mapping, block_table, seq_lens,
kv_visible_end, kv_gap=)``, its layer's slot mapping and block table computed in the graph from the shared metadata and
the layer's base (`metadata.py: layer_metadata`), and its stores into stand-ins are dropped (the op writes the
pool). A shared-region site becomes ``attend(q, pool, region table, ...)`` (`metadata.py: layer_block_table`).
The op's tensors are SDPA's inputs in token-major (B, S, H, D) order (`to_bshd`); its output goes back to
SDPA's head-major (B, H, S, D).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..metadata import layer_block_table, layer_metadata
from .extra_inputs import (
    KV_GAP,
    KV_SCALES,
    POOL,
    POSITIONS,
    REGION_MANAGED,
    REGION_SEQ_LENS,
    REGION_TABLE0,
    REGION_VISIBLE_END,
    SEQ_LENS,
    TABLE0,
    TABLE_MANAGED,
    VISIBLE_END,
    ExtraInput,
    block_base,
)
from .graph import example, sdpa_args
from .idioms import Match
from .provenance import LeafRead
from .site import NewSpan, Site

InputNodes = dict[ExtraInput, fx.Node]


def add_inputs(graph: fx.Graph, inputs: tuple[ExtraInput, ...]) -> InputNodes:
    """Append a placeholder per input after the graph's last one, in `inputs` order."""
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        nodes = [graph.placeholder(i.name) for i in inputs]
    # graph.placeholder inserts each right after `last`, so they come out in reverse: put them in call order.
    for prev, node in zip([last] + nodes[:-1], nodes):
        node._dynamo_source = None
        prev.append(node)
    return dict(zip(inputs, nodes))


def to_bshd(graph: fx.Graph, read: LeafRead, start: int, stop: int) -> fx.Node:
    """Insert (at the current insertion point) a token-major (B, S, H, D) view of tokens [start, stop) of a leaf."""
    node = read.node
    if tuple(example(node).shape) != read.shape:
        node = graph.call_method("reshape", (node, *read.shape))
    if read.select_dim is not None:  # a fused projection's q/k/v axis (or a cache's K/V axis): the half read
        node = graph.call_method("select", (node, read.select_dim, read.kv_index))
    axes = read.bshd_axes()
    if axes != (0, 1, 2, 3):
        node = graph.call_method("permute", (node, *axes))
    if (start, stop) != (0, read.shape[read.seq_dim]):
        node = graph.call_function(operator.getitem, (node, (slice(None), slice(start, stop))))
    if read.heads is not None:
        first, count = read.heads
        node = graph.call_function(operator.getitem, (node, (slice(None), slice(None), slice(first, first + count))))
    return node


def _tokens(graph: fx.Graph, spans: list[NewSpan]) -> fx.Node:
    """The new tokens of `spans`, (B, S, H, D), concatenated along the sequence in column order."""
    parts = [to_bshd(graph, s.read, s.start, s.stop) for s in spans]
    return parts[0] if len(parts) == 1 else graph.call_function(torch.cat, (parts, 1))


def _scale(node: fx.Node, args: dict) -> float:
    return float(args["scale"]) if args["scale"] is not None else float(example(node).shape[-1]) ** -0.5


def _replace(graph: fx.Graph, node: fx.Node, out_bshd: fx.Node) -> None:
    """SDPA `node`'s users read the op's (B, S, H, D) output as (B, H, S, D); `node` goes."""
    with graph.inserting_before(node):
        replacement = graph.call_method("transpose", (out_bshd, 1, 2))
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)


def _scales(nodes: InputNodes) -> dict:
    return {"kv_scales": nodes[KV_SCALES]} if KV_SCALES in nodes else {}


def _gap(nodes: InputNodes) -> dict:
    return {"kv_gap": nodes[KV_GAP]} if KV_GAP in nodes else {}


def insert_write_attend(graph: fx.Graph, site: Site, match: Match, nodes: InputNodes, index: int,
                        kernel: str) -> None:
    """Replace KV-cache site number `index` by `write_attend` and drop its stores into stand-ins."""
    node, pool = site.node, nodes[POOL]
    with graph.inserting_before(node):
        # This layer's slots and block table from the shared metadata and its base: computed here, on the
        # device and inside a captured graph, instead of per layer and per token by the host (metadata.py).
        block_size = graph.call_method("size", (pool, 2))  # the pool is [2, blocks, block_size, H, D]
        meta = graph.call_function(layer_metadata, (nodes[POSITIONS], nodes[TABLE0], nodes[TABLE_MANAGED],
                                                    nodes[block_base(index)], block_size))
        slot, table = (graph.call_function(operator.getitem, (meta, j)) for j in range(2))
        q, k, v = (_tokens(graph, spans) for spans in (site.new.query, site.new.key, site.new.value))
        out = graph.call_function(
            torch.ops.paged_kv.write_attend.default,
            (q, k, v, pool, slot, table, nodes[SEQ_LENS], nodes[VISIBLE_END], _scale(node, site.args), kernel,
             match.visibility),
            {**_scales(nodes), **_gap(nodes)},
        )
    _replace(graph, node, out)
    for store in site.writes.stores:
        if store.graph is graph:
            store.replace_all_uses_with(store.args[0])
            graph.erase_node(store)


def insert_attend(graph: fx.Graph, node: fx.Node, nodes: InputNodes, index: int, kernel: str) -> None:
    """Replace region site number `index` (SDPA over a region stand-in) by `attend` over this layer's region
    table: all of the row's region, no write."""
    args = sdpa_args(node)
    with graph.inserting_before(node):
        table = graph.call_function(layer_block_table, (nodes[REGION_TABLE0], nodes[REGION_MANAGED],
                                                        nodes[block_base(index)]))
        q = graph.call_method("transpose", (args["query"], 1, 2))  # (B, H, T, D) -> (B, T, H, D)
        out = graph.call_function(
            torch.ops.paged_kv.attend.default,
            (q, nodes[POOL], table, nodes[REGION_SEQ_LENS], nodes[REGION_VISIBLE_END], _scale(node, args), kernel,
             "full"),
            _scales(nodes),
        )
    _replace(graph, node, out)
