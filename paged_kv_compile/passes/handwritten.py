"""Hand-written attention, read structurally: ``softmax(q @ k^T * scale + mask) @ v`` becomes an SDPA node.

Models that write attention by hand (pi0's ``matmul``, ``softmax``, ``matmul``) have no SDPA for the passes to
find. Before the sites are read, each hand-written attention whose keys or values read a cache stand-in is
replaced by the SDPA call it computes, so that everything after (provenance on tags with the batch / heads / GQA
/ head_dim checks, the idioms, the rewrite) is the one path SDPA sites take. What is accepted, between the two
products: dtype casts (a float32 softmax cast back), a multiplication or division by a constant (the scale, e.g.
``/ math.sqrt(d)``), then one added float mask or ``masked_fill(~mask, -inf)``; ``bmm``/``baddbmm`` over merged
batch*heads are split back into (batch, heads) where the tags show which split the query, keys and values read.
Anything else (a softmax over another axis, a scale that is a tensor, a mask added before the scale, a boolean mask
added as numbers, a cast that narrows the scores, a broadcast batch) is left as written with the reason, which the
pass reports: its stand-in reads then make the graph refused, never computed wrong.
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx
import torch.nn.functional as F

from .graph import ancestors, example, find_parameter
from .provenance import provenance
from .writes import store_weight

_MATMULS = {torch.matmul, operator.matmul}
_SOFTMAX_FUNCTIONS = {torch.softmax, F.softmax, torch.nn.functional.softmax}
_CASTS = {"float", "to", "type_as", "half", "bfloat16", "type"}


def _is(node: object, functions: set, methods: set[str] = frozenset()) -> bool:
    if not isinstance(node, fx.Node):
        return False
    return (node.op == "call_function" and node.target in functions) or (
        node.op == "call_method" and node.target in methods)


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _narrows(node: fx.Node) -> bool:
    """A cast that loses precision (or leaves floating point): SDPA computes the scores at least at q's precision."""
    out, into = example(node), example(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    if not isinstance(out, torch.Tensor) or not isinstance(into, torch.Tensor):
        return True
    return not out.dtype.is_floating_point or out.dtype.itemsize < into.dtype.itemsize


def _strip_casts(node: fx.Node, narrowing: bool = False) -> fx.Node:
    """The tensor under dtype casts (``.float()``, ``.to(torch.float32)``, ``.type_as(q)``); a cast that narrows
    the precision is not stripped (it changes what is computed) unless `narrowing` (the probabilities cast back
    to q's dtype before the product with v, which SDPA does too)."""
    while _is(node, set(), _CASTS) or (node.op == "call_function" and node.target is torch.Tensor.to):
        if not narrowing and _narrows(node):
            break
        node = node.args[0]
    return node


def _einsum_operands(node: fx.Node) -> tuple[str, str, str, list[fx.Node]] | None:
    if not (node.op == "call_function" and node.target is torch.einsum and isinstance(node.args[0], str)):
        return None
    eq = node.args[0].replace(" ", "")
    operands = list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    m = re.fullmatch(r"([a-z]{4}),([a-z]{4})->([a-z]{4})", eq)
    if m is None or len(operands) != 2 or not all(isinstance(o, fx.Node) for o in operands):
        return None
    return m.group(1), m.group(2), m.group(3), operands


class _Built:
    """Nodes inserted before the attention's output product, with their example values (the passes read them)."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph

    def method(self, name: str, *args) -> fx.Node:
        node = self.graph.call_method(name, args)
        values = [example(a) if isinstance(a, fx.Node) else a for a in args]
        node.meta["example_value"] = getattr(values[0], name)(*values[1:])
        return node


def _product(node: fx.Node, built: _Built | None) -> tuple[fx.Node, fx.Node] | str:
    """(left, right) of a 4-D batched product ``left @ right`` (right already the (B, H, D, S) or (B, H, S, D)
    operand as matmul takes it); einsum ``abid,abjd->abij`` style operands are given as matmul operands."""
    if _is(node, _MATMULS | {torch.bmm}, {"matmul", "__matmul__", "bmm"}) or _is(node, {torch.baddbmm}, {"baddbmm"}):
        left, right = node.args[-2:] if node.target in (torch.baddbmm, "baddbmm") else node.args[:2]
        return (left, right) if all(isinstance(x, fx.Node) for x in (left, right)) else "a product with a constant"
    got = _einsum_operands(node)
    if got is None:
        return f"{node.name} is not a matmul, @ or a 4-index einsum"
    a, b, out, (left, right) = got
    # left: (batch..., i, contracted), right: (batch..., contracted, j) after permuting; letters tell which.
    contracted = [c for c in a if c in b and c not in out]
    batch = [c for c in out if c in a and c in b]
    i = [c for c in a if c in out and c not in b]
    j = [c for c in b if c in out and c not in a]
    if not (len(contracted) == 1 and len(batch) == 2 and len(i) == 1 and len(j) == 1 and out == "".join(batch + i + j)):
        return f"einsum {node.args[0]!r} is not a batched product over two batch axes"
    if built is None:
        return left, right
    want_left, want_right = batch + i + contracted, batch + contracted + j
    if list(a) != want_left:
        left = built.method("permute", left, *[a.index(c) for c in want_left])
    if list(b) != want_right:
        right = built.method("permute", right, *[b.index(c) for c in want_right])
    return left, right


_SCALES = {operator.mul, operator.truediv, torch.mul, torch.div}
_SCALE_METHODS = {"mul", "div", "__mul__", "__truediv__"}
_DIVISIONS = {operator.truediv, torch.div, "div", "__truediv__"}
_ADDS = {operator.add, torch.add}


def _is_scale(node: fx.Node) -> bool:
    return _is(node, _SCALES, _SCALE_METHODS)


def _under_scale(node: fx.Node) -> fx.Node:
    """`node` under casts and multiplications/divisions (whatever their operands: checked by `_scores_chain`)."""
    node = _strip_casts(node)
    while _is_scale(node):
        node = _strip_casts(next((a for a in node.args[:2] if isinstance(a, fx.Node)), node.args[0]))
        if not isinstance(node, fx.Node):
            break
    return node


def _is_product(node: object) -> bool:
    return isinstance(node, fx.Node) and not isinstance(_product(node, None), str)


def _scores_chain(scores: fx.Node) -> tuple[fx.Node, float, fx.Node | None] | str:
    """(the q @ k^T product, the constant scale, the additive mask or None) under the softmax's input."""
    node, mask, scale = _strip_casts(scores), None, 1.0
    if _is(node, {torch.baddbmm}, {"baddbmm"}):  # beta * bias + alpha * (q @ k^T): the scale and the mask at once
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        if len(node.args) != 3 or not all(isinstance(x, (int, float)) for x in (beta, alpha)) or beta not in (0, 1):
            return (f"{node.name}: baddbmm with beta/alpha the pass cannot read as constants (beta 0, or 1 with a "
                    "floating-point mask)")
        bias = node.args[0]
        if beta == 1 and not (isinstance(bias, fx.Node) and example(bias).dtype.is_floating_point):
            return f"{node.name}: baddbmm's added input is not a floating-point mask"
        return node, float(alpha), bias if beta == 1 else None
    if _is(node, {torch.masked_fill}, {"masked_fill"}):  # scores.masked_fill(~mask, -inf): SDPA's boolean mask
        where, fill = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("value")
        if not (_is(where, {operator.invert, torch.logical_not}, {"logical_not", "__invert__"})
                and isinstance(example(where.args[0]), torch.Tensor) and example(where.args[0]).dtype == torch.bool
                and fill == float("-inf")):
            return ("the scores are masked_fill'ed other than masked_fill(~mask, float('-inf')) (SDPA's boolean "
                    "mask: True where a key is seen)")
        mask, node = where.args[0], _strip_casts(node.args[0])
    elif node.op == "call_function" and node.target in _ADDS and len(node.args) == 2:
        sides = [a for a in node.args if isinstance(a, fx.Node) and _is_product(_under_scale(a))]
        if len(sides) != 1 or not all(isinstance(a, fx.Node) for a in node.args):
            return "the scores are a sum the pass cannot split into (q @ k^T) * scale and one mask"
        node, mask = sides[0], next(a for a in node.args if a is not sides[0])
        if not (isinstance(example(mask), torch.Tensor) and example(mask).dtype.is_floating_point):
            return (f"the mask added to the scores ({mask.name}) is not floating point (SDPA would read a bool mask "
                    "as visibility)")
        node = _strip_casts(node)
    while _is_scale(node):
        if node.kwargs:  # torch.div(..., rounding_mode=...)
            return f"the scores are scaled with arguments the pass does not read ({node.name}: {dict(node.kwargs)})"
        left, right = node.args[:2]
        const, tensor = (right, left) if isinstance(left, fx.Node) else (left, right)
        if isinstance(const, fx.Node) or not isinstance(const, (int, float)):
            return (f"the scores are scaled by a tensor ({node.name}); the scale must be a constant the pass can "
                    "read (a Python number, e.g. head_dim ** -0.5 or / math.sqrt(head_dim))")
        if node.target in _DIVISIONS:
            if tensor is not left:
                return "the scores divide a constant"
            scale /= float(const)
        else:
            scale *= float(const)
        node = _strip_casts(tensor)
        if (node.op == "call_function" and node.target in _ADDS) or _is(node, {torch.masked_fill}, {"masked_fill"}):
            return "a mask (or bias) is added before the scale: SDPA adds it after"
    got = _product(node, None)
    if isinstance(got, str):
        return f"the softmax input is not (q @ k^T) * constant + mask: {got}"
    return node, scale, mask


def _attention(out: fx.Node, standins: set[fx.Node], writers: set[fx.Node], params: set[fx.Node]) -> tuple[dict, str]:
    """The SDPA arguments a final product ``probs @ v`` computes (with the nodes to build), or why not."""
    got = _product(out, None)
    if isinstance(got, str):
        return {}, ""
    probs, v = got
    softmax = _strip_casts(probs, narrowing=True)
    if not _is(softmax, _SOFTMAX_FUNCTIONS, {"softmax"}):
        return {}, ""
    if not (standins & ancestors(out)) and find_parameter([v], params) not in writers:
        return {}, ""  # reads no cache stand-in and its layer stores none (site.analyze's test): left as written
    ex = example(out)
    dim = _arg(softmax, 1, "dim")
    scores = softmax.args[0]
    if not isinstance(ex, torch.Tensor) or ex.dim() not in (3, 4):
        return {}, f"{out.name}: hand-written attention must be (batch, heads, seq, head_dim) or (batch*heads, seq, " \
                   "head_dim)"
    if not isinstance(dim, int) or dim % ex.dim() != ex.dim() - 1:
        return {}, f"{softmax.name}: the softmax runs over axis {dim}, not over the keys (the last axis)"
    dtype = _arg(softmax, 3 if softmax.target is F.softmax else 2, "dtype")  # F.softmax has _stacklevel first
    if isinstance(dtype, torch.dtype) and (
            not dtype.is_floating_point or dtype.itemsize < example(scores).dtype.itemsize):
        return {}, f"{softmax.name}: the softmax runs at a lower precision ({dtype}) than its scores"
    chain = _scores_chain(scores)
    if isinstance(chain, str):
        return {}, f"{out.name}: {chain}"
    product, scale, mask = chain
    return {"out": out, "product": product, "v": v, "scale": scale, "mask": mask}, ""


def _split_batch_heads(built: _Built, q: fx.Node, kt: fx.Node, v: fx.Node, mask: fx.Node | None):
    """(B, H, ...) views of bmm's (B*H, ...) operands: the split whose query, keys and values all read their
    tensors with batch and heads as the paged op does (`provenance`, on tags), the most heads first; or why none."""
    BH = example(q).shape[0]
    for heads in (h for h in range(BH, 0, -1) if BH % h == 0):
        views = [built.method("unflatten", x, 0, (BH // heads, heads)) for x in (q, kt, v)]
        k = built.method("transpose", views[1], -1, -2)
        if all(provenance(x)[0] is not None for x in (views[0], k, views[2])):
            if mask is not None and example(mask).dim() == 3 and example(mask).shape[0] == BH:
                mask = built.method("unflatten", mask, 0, (BH // heads, heads))
            elif mask is not None and example(mask).dim() == 3 and example(mask).shape[0] != 1:
                return f"its mask {tuple(example(mask).shape)} does not broadcast over batch*heads"
            return views[0], views[1], views[2], mask
    return ("no split of its batch*heads axis reads query, keys and values with batch and heads as the paged op "
            "does (write it 4-D: q @ k.transpose(-1, -2) on (B, H, L, D))")


def _replace(graph: fx.Graph, found: dict) -> str:
    out, product = found["out"], found["product"]
    with graph.inserting_before(out):
        built = _Built(graph)
        q, kt = _product(product, built)
        probs_v = _product(out, built)
        v = probs_v[1]
        mask = found["mask"]
        if example(q).dim() == 3:
            got = _split_batch_heads(built, q, kt, v, mask)
            if isinstance(got, str):
                return f"{out.name}: {got}"
            q, kt, v, mask = got
        shapes = [tuple(example(x).shape) for x in (q, kt, v)]
        (B, H, L, D), kt_shape, v_shape = shapes
        if kt_shape[:2] != (B, H) or v_shape[:2] != (B, H) or kt_shape[2] != D:
            return (f"{out.name}: query {shapes[0]}, keys^T {kt_shape} and values {v_shape} do not share batch and "
                    "heads (a broadcast product): repeat the kv heads explicitly (repeat_interleave)")
        k = built.method("transpose", kt, -1, -2)
        sdpa = graph.call_function(F.scaled_dot_product_attention, (q, k, v),
                                   {"attn_mask": mask, "scale": found["scale"]})
        sdpa.meta["example_value"] = example(out).unflatten(0, (B, H)) if example(out).dim() == 3 else example(out)
        result = built.method("flatten", sdpa, 0, 1) if example(out).dim() == 3 else sdpa
    out.replace_all_uses_with(result)
    return ""


def canonicalize(graph: fx.Graph, standins: set[fx.Node], stores: list[fx.Node],
                 params: set[fx.Node]) -> list[tuple[fx.Node, str]]:
    """Replace each hand-written attention that reads a cache stand-in, or whose layer stores into one (a prefill),
    by the SDPA node it computes; (output product, reason) for the ones left as written (their stand-in reads or
    stores then get the graph refused)."""
    writers = {store_weight(s, params) for s in stores} - {None}
    reasons = []
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        found, why = _attention(node, standins, writers, params)
        if found:
            why = _replace(graph, found)
        if why:
            reasons.append((node, f"hand-written attention {why}"))
    return reasons
