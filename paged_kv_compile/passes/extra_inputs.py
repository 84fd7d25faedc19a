"""The inputs the rewrite adds to a graph, described once: the pass makes its placeholders from this list and the
backend supplies their values from the same list, so the two cannot disagree on an order, a name or a presence.

Each input is the runtime's pool (or its FP8 scales), a buffer of the bucket's metadata (`metadata.py:
BucketMetadata`), or, per rewritten site, an attribute of the calling layer's views (`metadata.py: LayerViews`).
`extra_inputs` says which are present for a graph; `PassResult.inputs` keeps that list, and `extra_values`
turns it into the tensors to append at every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..metadata import BucketMetadata
from ..pool import KVPool

SOURCES = ("pool", "metadata", "layer")
PRESENCE = ("always", "fp8", "gaps", "regions", "site")


@dataclass(frozen=True)
class ExtraInput:
    """One graph input the rewrite adds and the backend supplies at every call.

    name: the placeholder's name in the rewritten graph. source/attr: where its value is, `pool.<attr>` (the
    runtime's KVPool), `meta.<attr>` (the bucket's BucketMetadata) or `meta.layers[layer].<attr>` (the layer
    serving rewritten site number `site`). present: "always"; "fp8" when the pool stores FP8 (it has scales);
    "gaps" when the runtime's rows may hide keys inside their tables (`PagedKVConfig.kv_gaps`);
    "regions" when the graph has a shared-region site (`attend`); "site": one per rewritten site.
    """

    name: str
    source: str
    attr: str
    present: str = "always"
    site: int | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES or self.present not in PRESENCE or (self.present == "site") != (
                self.site is not None) or (self.source == "layer") != (self.present == "site"):
            raise ValueError(f"inconsistent extra input {self}")


POOL = ExtraInput("paged_kv_pool", "pool", "tensor")
SEQ_LENS = ExtraInput("paged_kv_seq_lens", "metadata", "seq_lens")
VISIBLE_END = ExtraInput("paged_kv_visible_end", "metadata", "kv_visible_end")
# per row the logical keys no query sees (`layout.RowLayout.kv_gap`: a window's evicted head inside a block, what lies
# between a sink and the recent tokens), built once per forward like seq_lens
KV_GAP = ExtraInput("paged_kv_kv_gap", "metadata", "kv_gap", "gaps")
KV_SCALES = ExtraInput("paged_kv_kv_scales", "pool", "scales", "fp8")
# what every layer's slot mapping and block table are computed from in the graph (`metadata.py: layer_metadata`)
POSITIONS = ExtraInput("paged_kv_positions", "metadata", "positions")
TABLE0 = ExtraInput("paged_kv_table0", "metadata", "table0")
TABLE_MANAGED = ExtraInput("paged_kv_table_managed", "metadata", "table_managed")
# the forward's shared-region table (`metadata.py: BucketMetadata.stage_regions`, `layer_block_table`)
REGION_TABLE0 = ExtraInput("paged_kv_region_table0", "metadata", "region_table0", "regions")
REGION_MANAGED = ExtraInput("paged_kv_region_managed", "metadata", "region_managed", "regions")
REGION_SEQ_LENS = ExtraInput("paged_kv_region_seq_lens", "metadata", "region_seq_lens", "regions")
REGION_VISIBLE_END = ExtraInput("paged_kv_region_visible_end", "metadata", "region_visible_end", "regions")

#: the inputs shared by every site of a graph, in the order they are added (each when present)
SHARED = (POOL, SEQ_LENS, VISIBLE_END, KV_GAP, KV_SCALES, POSITIONS, TABLE0, TABLE_MANAGED,
          REGION_TABLE0, REGION_MANAGED, REGION_SEQ_LENS, REGION_VISIBLE_END)


def block_base(site: int) -> ExtraInput:
    """The layer base of rewritten site number `site` (its layer's blocks are layer-0 ids plus this)."""
    return ExtraInput(f"paged_kv_block_base_{site}", "layer", "block_base", "site", site)


def extra_inputs(*, fp8: bool, regions: bool, sites: int, gaps: bool = True) -> tuple[ExtraInput, ...]:
    """Every input the rewrite adds to a graph, in order: the shared ones present, then one base per site.
    `gaps`: the runtime's rows may hide keys inside their tables (`PagedKVConfig.kv_gaps`)."""
    present = {"always": True, "fp8": fp8, "gaps": gaps, "regions": regions}
    return tuple(i for i in SHARED if present[i.present]) + tuple(block_base(s) for s in range(sites))


def extra_values(inputs: Sequence[ExtraInput], pool: KVPool, meta: BucketMetadata,
                 layers: Sequence[int]) -> list[torch.Tensor]:
    """The tensors `inputs` name, in their order: `layers[i]` is the layer serving rewritten site i."""
    values = []
    for i in inputs:
        holder = pool if i.source == "pool" else meta if i.source == "metadata" else meta.layers[layers[i.site]]
        values.append(getattr(holder, i.attr))
    return values
