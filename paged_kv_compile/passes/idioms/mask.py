"""The mask rule every masked idiom shares: the attention's mask must be a graph input, not computed in the graph.

Which keys a query sees is the owner's row layout (read from its mask at admission or prefill, `layout.py`); the
paged op reads that, not the graph's mask. A mask the graph computes itself may say something else, so a site whose
mask is more than data movement and dtype conversion of an input cannot be rewritten without risking a wrong answer.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import ancestors
from ..tags import is_movement

# What may turn the mask input into the mask the attention uses: slicing/reshaping, negation, and boolean to
# additive conversion. Anything else (a tril, an `&` with another mask, ...) changes which keys are visible,
# which the paged op takes from the owner's row layout instead: such a site cannot be rewritten without a
# wrong answer.
_MASK_FUNCTIONS = {
    torch.where, torch.logical_not, operator.invert, torch.zeros, torch.zeros_like, torch.full, torch.full_like,
}
_MASK_METHODS = {"masked_fill", "masked_fill_", "logical_not", "__invert__", "to", "float", "half", "bfloat16", "type",
                 "type_as", "bool"}


def mask_problem(mask: object) -> str:
    """Why the attention's mask is not a graph input seen through data movement and dtype conversion ("" if it is)."""
    if not isinstance(mask, fx.Node):
        return ""
    for n in [mask, *ancestors(mask)]:
        if n.op in ("placeholder", "get_attr") or is_movement(n):
            continue
        if (n.op == "call_function" and n.target in _MASK_FUNCTIONS) or (
            n.op == "call_method" and n.target in _MASK_METHODS
        ):
            continue
        what = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        return (
            f"its mask is computed in the graph ({n.name}: {what}), so it may differ from the layout the paged op "
            "uses (the owner's, read from its mask at admission or prefill): pass the final mask in as an input"
        )
    return ""
