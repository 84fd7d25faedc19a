"""HunyuanImage-3's retained-prefix idiom.

Step 0 projects the whole sequence, stores ``cached_key[:, :P]`` (per-row zero-padded prefix) and
attends with the full 4-D mask. Later steps feed the target span only and attend over
``cat([cached_key, key])`` after ``repeat_kv`` with the mask sliced to the target rows. Read
structurally, a later step's key columns are cache positions ``[0, P)`` then every new token; step 0's
are the new tokens only, plus a store into the cache stand-in. The causal/bidirectional structure of
the mask is the runtime's layout (``kv_visible_end``).
"""

from __future__ import annotations

from .site import Match, Site


def match(site: Site) -> Match | str:
    """A `Match` for the prefix idiom (prefill or step), or why this site is not one."""
    if site.args["is_causal"]:
        return "is_causal=True is not HunyuanImage-3's layout (it passes an explicit causal/full mask)"
    if site.args["attn_mask"] is None:
        return "HunyuanImage-3's attention carries a 4-D mask; this site has none"
    if site.history_positions:
        if site.standin_ndim != 4:
            return "the cached prefix must be a (B, P, H, D) stand-in"
        prefix = site.standin_seq_len
        if site.history_positions != list(range(prefix)):
            return "a later step must read the whole cached prefix [0, P) in order before the new tokens"
        if len(site.new_sizes) != 1:
            return "a later step appends one new key tensor after the prefix"
        return Match("hunyuan-prefix-step", {"family": "hunyuan_image3", "prefix_capacity": prefix})
    if not site.stores:
        return "no cached prefix is read and none is stored: not a KV-cache site"
    if len(site.new_sizes) != 1:
        return "prefill attends over one freshly projected key tensor"
    return Match("hunyuan-prefill", {"family": "hunyuan_image3", "prefix_capacity": site.store_seq_len})
