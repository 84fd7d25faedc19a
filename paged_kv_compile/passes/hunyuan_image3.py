"""HunyuanImage-3's retained-prefix idiom.

Step 0 projects the whole sequence, stores ``cached_key[:, :P]`` (per-row zero-padded prefix) and
attends with the full 4-D mask. Later steps feed the target span only and attend over
``cat([cached_key, key])`` after ``repeat_kv`` with the mask sliced to the target rows. Read
structurally, a later step's key columns are cache positions ``[0, P)`` then every new token; step 0's
are the new tokens only, plus a store into the cache stand-in. The causal/bidirectional structure of
the mask is the runtime's layout (``kv_visible_end``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..families.hunyuan_image3 import HunyuanExpect
from .common import ancestors, is_movement
from .site import Match, Site

# What may turn the mask input into the mask the attention uses: slicing/reshaping, negation, and boolean to
# additive conversion. Anything else (a tril, an `&` with another mask, ...) changes which keys are visible,
# which the paged op takes from the request spec instead: such a site cannot be rewritten without a wrong answer.
_MASK_FUNCTIONS = {
    torch.where, torch.logical_not, operator.invert, torch.zeros, torch.zeros_like, torch.full, torch.full_like,
}
_MASK_METHODS = {"masked_fill", "masked_fill_", "logical_not", "__invert__", "to", "float", "half", "bfloat16", "type",
                 "type_as", "bool"}


def _mask_problem(mask: object) -> str:
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
            f"its mask is computed in the graph ({n.name}: {what}), so it may differ from the request's layout the "
            "paged op uses (causal prompt, bidirectional image span): pass the final mask in as an input"
        )
    return ""


def match(site: Site) -> Match | str:
    """A `Match` for the prefix idiom (prefill or step), or why this site is not one."""
    if site.args["is_causal"]:
        return "is_causal=True is not HunyuanImage-3's layout (it passes an explicit causal/full mask)"
    if site.args["attn_mask"] is None:
        return "HunyuanImage-3's attention carries a 4-D mask; this site has none"
    why = _mask_problem(site.args["attn_mask"])
    if why:
        return why
    if site.history_positions:
        if site.standin_ndim != 4:
            return "the cached prefix must be a (B, P, H, D) stand-in"
        prefix = site.standin_seq_len
        if site.history_positions != list(range(prefix)):
            return "a later step must read the whole cached prefix [0, P) in order before the new tokens"
        if len(site.new_sizes) != 1:
            return "a later step appends one new key tensor after the prefix"
        return Match("hunyuan-prefix-step", HunyuanExpect(prefix))
    if not site.stores:
        return "no cached prefix is read and none is stored: not a KV-cache site"
    if len(site.new_sizes) != 1:
        return "prefill attends over one freshly projected key tensor"
    return Match("hunyuan-prefill", HunyuanExpect(site.store_seq_len))
