"""The one object a compiled attention site talks to during a forward: what it checks, records and reads.

The runtime (`runtime.py`) is the public lifecycle API; a compiled site (`backend.py`, and the captured path in
`capture/`) needs far less of it: the forward's plan and metadata, the checks that compare its compiled
expectation with that plan, and a place to record which layers it served. That is a `ForwardContext`, made by
the runtime for each forward and dropped when the forward ends, as vLLM's forward context or nano-vllm's
`Context`. "Did any paged attention run" is counted on it too (`attention_ran`): the op reports its calls to the
contexts open while it runs (`ops.write_attend.observe_calls`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from .config import Bucket
from .errors import RequestError
from .layout import mask_disagreement, mask_rows

if TYPE_CHECKING:
    from .families.base import ForwardPlan, Owner
    from .metadata import BucketMetadata
    from .passes.idioms import Expectation, Idiom


@dataclass(eq=False)
class ForwardContext:
    """One forward in progress: its plan, its bucket's metadata, and what its compiled sites did."""

    plan: ForwardPlan
    bucket: Bucket
    meta: BucketMetadata
    generation: int
    #: the live owner of an id (None once it ended): a site's expectation is checked against its owner's family
    owner_of: Callable[[str], "Owner | None"] = lambda owner_id: None
    layers_seen: set[int] = field(default_factory=set)  # layers whose compiled site ran in this forward
    paged_calls: int = 0  # calls of the paged ops while this forward was open (any site, or a direct call)
    unpaged_calls: int = 0  # calls of graphs compiled by the backend with nothing to page, while it was open
    nothing_to_page: str = ""  # why the last of those had no paged site (its pass report's words)
    expect_attention: bool = True  # the body must run paged attention (`PagedKVRuntime._check_attention_ran`)

    @property
    def attention_ran(self) -> bool:
        """Whether a compiled site served a layer, or the paged op ran, in this forward."""
        return bool(self.layers_seen) or self.paged_calls > 0

    def note_call(self, nothing_to_page: str | None = None) -> None:
        """A paged op ran (None), or a compiled graph with nothing to page ran (why: `ops.write_attend.report_call`)."""
        if nothing_to_page is None:
            self.paged_calls += 1
        else:
            self.unpaged_calls += 1
            self.nothing_to_page = nothing_to_page

    def record_layers(self, layers: Iterable[int]) -> None:
        """Layers whose compiled site served this forward (checked when it keeps its K/V)."""
        self.layers_seen.update(layers)

    def check_expectation(self, expect: Expectation | None, idiom: Idiom | None) -> None:
        """A compiled site's idiom must be one the forward's owners' family accepts (this very `Idiom` object), and
        its expectation agree with each owner (window, sink, prefix)."""
        if expect is None:
            return
        for plan in self.plan.owner_plans():
            owner = self.owner_of(plan.owner_id)
            if owner is None:
                continue
            family = owner.family
            if not family.accepts(idiom):
                raise RequestError(
                    f"a {idiom.name if idiom is not None else expect.idiom!r} attention site ran inside a {family.name} forward ({plan.owner_id!r}), "
                    f"whose family accepts the idioms {[i.name for i in family.idioms]}: run this model's owners, "
                    "or compile the model this owner belongs to"
                )
            family.check_expectation(expect, owner, plan)

    def check_regions(self, tokens: int) -> None:
        """A compiled site reads a `tokens`-token shared region per row: every row of the forward must hold one."""
        plan = self.plan
        regions = plan.regions or [None] * len(plan.rows)
        for r, region in enumerate(regions):
            if region is None or region.tokens != tokens:
                have = "no shared region" if region is None else f"a region of {region.tokens} tokens"
                raise RequestError(
                    f"a compiled cross-attention site reads a {tokens}-token shared region (its K/V came in as a region "
                    f"stand-in) but row {r} of this {plan.kind} forward ({plan.owner_id!r}) holds {have}: admit the "
                    "owner with runtime.admit(..., cross_kv=model.prepare_cross_kv(...)), or pass the dense cross K/V"
                )

    def check_dense_mask(self, mask: torch.Tensor) -> None:
        """Debug: the model's dense mask must allow exactly what the runtime's layout makes visible.

        Each dense key column holds the logical position the plan says (`ForwardPlan.key_positions`);
        without them the columns are the new tokens, after a cached prefix read as logical positions.
        Boolean or additive masks.
        """
        plan = self.plan
        masks = mask_rows(mask, len(plan.rows))
        for r, row in enumerate(plan.rows):
            keys = plan.key_positions[r] if plan.key_positions else None
            if keys is None:
                keys, cols = row.positions, masks[r].shape[-1]
                if cols != row.num_tokens:  # [cached prefix | new tokens]: column j is logical j below the prefix
                    first_new = int(row.positions[row.positions >= 0].min())
                    cached = torch.arange(cols - row.num_tokens)
                    keys = torch.cat([torch.where(cached < first_new, cached, -1), row.positions])
            why = mask_disagreement(masks[r], row, keys)
            if why:
                raise RequestError(
                    f"check_mask: row {r}'s dense mask disagrees with the runtime's layout at {why}: the request "
                    "spec (prefix lengths, target length, full spans) does not describe this model's mask"
                )


def require(active: ForwardContext | None) -> ForwardContext:
    """`active` (a runtime's forward in progress), or the error a site that runs outside a forward gets."""
    if active is None:
        raise RequestError(
            "a paged attention site ran outside a forward: wrap the model call in "
            "`with runtime.forward(owner_id, kind, ...):`"
        )
    return active
