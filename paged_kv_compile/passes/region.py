"""Attention over a shared write-once region (regions.py): DreamZero's cross-attention, read with `paged_kv::attend`.

A site qualifies when its keys and values are pure data movement of ONE region stand-in (`runtime.region_standin`,
`(2, B, L, H, D)`): keys exactly ``standin[0]`` and values exactly ``standin[1]`` in SDPA's ``(B, H, L, D)`` layout
(checked by running the movement on integer tags, `passes/tags.py`), with full visibility (no mask, not causal,
no dropout, as many query as key heads). It then reads all L tokens of the row's region. Anything else is refused
with the reason, and the graph is rejected (a stand-in holds no data): never wrong numbers.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .graph import example, sdpa_args
from .tags import leaf_offsets, movement_leaves


def region_source(node: fx.Node, regions: set[fx.Node]) -> fx.Node | str | None:
    """For an SDPA node: None when it reads no region stand-in, its region stand-in when the site can be read
    with `attend`, else why not."""
    args = sdpa_args(node)
    found: list[fx.Node] = []
    for half, name in ((0, "key"), (1, "value")):
        arg = args[name]
        if not isinstance(arg, fx.Node):
            return None if not found else f"its {name} is not a tensor of the graph"
        leaves, _ = movement_leaves(arg)
        hits = [leaf for leaf in leaves if leaf in regions]
        if not hits:
            if found:
                return f"its {name} does not come from the region stand-in its keys come from"
            continue
        if len(leaves) != 1:
            return f"its {name} mixes the region stand-in with other tensors (only a whole region can be read)"
        offsets = leaf_offsets(arg)
        standin = example(leaves[0])
        if offsets is None or standin.dim() != 5 or standin.shape[0] != 2:
            return f"its {name} is not a data movement of a (2, B, L, H, D) region stand-in"
        tags = offsets[1]
        want = torch.arange(standin.numel(), dtype=torch.int64).view(tuple(standin.shape))[half].transpose(1, 2)
        if tags.shape != want.shape or not torch.equal(tags, want):
            return f"its {name} is not exactly stand-in[{half}] as (B, H, L, D) (a slice, reorder or head mix)"
        found.append(leaves[0])
    if not found:
        return None
    if len(found) != 2 or found[0] is not found[1]:
        return "its keys and values do not come from one region stand-in"
    if args["attn_mask"] is not None or args["is_causal"] or args["dropout_p"] or args["enable_gqa"]:
        return "a region is read with full visibility: no mask, not causal, no dropout, no GQA"
    q, standin = example(args["query"]), example(found[0])
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != standin.shape[1] or q.shape[1] != standin.shape[3]:
        return "its query is not (B, H, T, D) with the region's batch and heads"
    return found[0]
