"""Small helpers over dynamo's FX graph that every pass module reads: example values, SDPA calls, weights."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}

_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def example(node: fx.Node):
    """Dynamo's example value of `node` (a fake tensor for tensors)."""
    return node.meta.get("example_value")


def is_tensor_node(node: object) -> bool:
    return isinstance(node, fx.Node) and isinstance(example(node), torch.Tensor)


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's position in the graph (topological order)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def sdpa_args(node: fx.Node) -> dict:
    """An SDPA call's arguments by name, defaults filled in."""
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    out = dict(_SDPA_DEFAULTS)
    out.update(zip(names, node.args))
    out.update(node.kwargs)
    return out


def find_parameter(start: list[fx.Node], params: set[fx.Node], *, through_index_writes: bool = False
                   ) -> fx.Node | None:
    """Nearest 2-D parameter placeholder upstream of `start` (breadth-first): the site's layer key.

    through_index_writes: when none is upstream, search again following what was written by index into a buffer
    upstream (``out = zeros(...); out[idx] = linear(x[idx], w)``, BAGEL's MoT projection): the written values
    feed the buffer. Only for naming a rewritten site's layer (binding then checks the weight is one layer's)."""
    found = _nearest_parameter(start, params, writes=False)
    if found is None and through_index_writes:
        found = _nearest_parameter(start, params, writes=True)
    return found


def _nearest_parameter(start: list[fx.Node], params: set[fx.Node], *, writes: bool) -> fx.Node | None:
    frontier, seen = list(start), set(start)
    while frontier:
        nxt = []
        for n in frontier:
            written = [u.args[2] for u in n.users if writes and u.op == "call_function" and u.target is operator.setitem
                       and u.args[0] is n and isinstance(u.args[2], fx.Node)]
            for a in [*n.all_input_nodes, *written]:
                if a in seen:
                    continue
                seen.add(a)
                if a in params:
                    return a
                nxt.append(a)
        frontier = nxt
    return None


def ancestors(node: fx.Node) -> set[fx.Node]:
    """Every node `node` depends on (not `node` itself)."""
    out, stack = set(), [node]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in out:
                out.add(a)
                stack.append(a)
    return out


def source_name(node: fx.Node) -> str:
    """The name dynamo's source gives a placeholder (a weight's module path), else the node's name."""
    src = getattr(node, "_dynamo_source", None)
    return src.name if src is not None and hasattr(src, "name") else node.name
