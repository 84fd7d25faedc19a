"""Tag execution: run a chain of pure data-movement ops on integer tags to learn which element each output reads.

Instead of matching text (``torch.cat`` vs ``torch.concat``, ``repeat_interleave`` vs ``expand`` + ``reshape``),
the data-movement nodes that feed a tensor are *executed* on integer tag tensors, one unique tag per element of
each leaf (the first non-movement tensor upstream). Each output element's tag says which leaf it comes from
(`leaf_index`) and which element of it (`offset`). Any spelling that moves the same elements reads the same.
"""

from __future__ import annotations

import operator
from typing import Callable, Protocol

import torch
import torch.fx as fx

from .graph import example, is_tensor_node, node_order

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
#: conversions that move no element when they change neither dtype nor device: on a graph input (``k_cache.to(k.dtype)``
#: on a cache handed in already in that dtype, as pi0 and LongCat-Video-Avatar write before concatenating it) they are
#: the identity on tags
_CONVERSION_METHODS = {"to", "type_as", "float", "double", "half", "bfloat16"}
CAT_FUNCTIONS = {torch.cat, torch.concat, torch.concatenate}
_TAG_SHIFT = 40
_TAG_MASK = (1 << _TAG_SHIFT) - 1


def leaf_index(tags: torch.Tensor) -> torch.Tensor:
    """Per element: the index of the leaf it comes from (in the leaf list the tags were made for)."""
    return (tags >> _TAG_SHIFT) - 1


def offset(tags: torch.Tensor) -> torch.Tensor:
    """Per element: its flat index in its leaf."""
    return tags & _TAG_MASK


def is_movement(node: fx.Node) -> bool:
    """A node that only rearranges elements of tensors (no arithmetic)."""
    if node.op == "call_function":
        if node.target is operator.getitem:
            return is_tensor_node(node.args[0])  # getitem on a tuple (unbind/split) is a leaf boundary
        return node.target in _MOVE_FUNCTIONS
    if node.op == "call_method":
        return node.target in _MOVE_METHODS or is_identity_conversion(node)
    return False


def is_identity_conversion(node: fx.Node) -> bool:
    """A `.to(...)`-like conversion of a graph input whose result has the input's dtype, device and shape: it moves
    nothing. Only of a graph input: a no-op conversion inside a computation (RoPE's ``.to(x.dtype)``) stays the leaf
    the passes read that computation's result from."""
    if (node.op != "call_method" or node.target not in _CONVERSION_METHODS or not is_tensor_node(node.args[0])
            or node.args[0].op != "placeholder"):
        return False
    src, out = example(node.args[0]), example(node)
    return (isinstance(out, torch.Tensor) and out.dtype == src.dtype and out.device == src.device
            and tuple(out.shape) == tuple(src.shape))


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
    order = node_order(node.graph)
    return sorted(leaves, key=order.__getitem__), sorted(moves, key=order.__getitem__)


class InPlaceSteps(Protocol):
    """In-place stores into leaves, evaluated with the movement steps around them (`writes.Writes`).

    leaves: every leaf the stores and the movement read; steps: the movement nodes and the stores, in graph order.
    """

    leaves: list[fx.Node]
    steps: list[fx.Node]

    def performs(self, node: fx.Node) -> bool: ...

    def perform(self, node: fx.Node, value_of: Callable) -> None: ...


def evaluate(target: fx.Node, leaves: list[fx.Node], steps: list[fx.Node],
             in_place: InPlaceSteps | None = None) -> dict[fx.Node, object] | None:
    """Run `steps` (graph order) on tag tensors made for `leaves`: every node's tags; None when `target` cannot
    be evaluated at static shapes.

    With `in_place`, the steps it performs are stores: they write the tag tensors in place (views alias as in the
    real program), so what is read back after them is followed too.
    """
    values: dict[fx.Node, object] = {}
    for i, leaf in enumerate(leaves):
        ex = example(leaf)
        if not isinstance(ex, torch.Tensor) or any(not isinstance(s, int) for s in ex.shape):
            return None
        values[leaf] = torch.arange(ex.numel(), dtype=torch.int64).view(tuple(ex.shape)) + ((i + 1) << _TAG_SHIFT)

    def value_of(a):
        if isinstance(a, fx.Node):
            if a not in values:
                raise KeyError(a)
            return values[a]
        if isinstance(a, (list, tuple)):
            return type(a)(value_of(x) for x in a)
        if isinstance(a, slice):
            return slice(value_of(a.start), value_of(a.stop), value_of(a.step))
        return a

    try:
        for n in steps:
            if in_place is not None and in_place.performs(n):
                in_place.perform(n, value_of)
                continue
            args, kwargs = value_of(n.args), value_of(n.kwargs)
            if is_identity_conversion(n):
                values[n] = args[0]  # the tags are int64: converting them would change what they say
            elif n.op == "call_function":
                values[n] = n.target(*args, **kwargs)
            else:
                method = "reshape" if n.target == "view" else n.target
                values[n] = getattr(args[0], method)(*args[1:], **kwargs)
    except (KeyError, RuntimeError, TypeError, IndexError, ValueError):
        return None
    return values if isinstance(values.get(target), torch.Tensor) else None


def leaf_offsets(node: fx.Node) -> tuple[fx.Node, torch.Tensor] | None:
    """For `node`, pure data movement of ONE graph tensor: (that leaf, each element's flat index in it), read by
    running the movement on tags; None when it reads several tensors or cannot be evaluated at static shapes."""
    leaves, moves = movement_leaves(node)
    if len(leaves) != 1:
        return None
    values = evaluate(node, leaves, moves)
    if values is None:
        return None
    return leaves[0], offset(values[node])


def movement_replay(node: fx.Node, placeholders: list[fx.Node]) -> tuple[int, Callable] | None:
    """(input index, fn) such that fn(inputs[index]) recomputes `node` when it is pure data movement
    (`.contiguous()`, slicing, views) of one graph input; None otherwise. For host-side checks of an input
    as an op sees it (the check_mask option, static-cache write positions)."""
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
