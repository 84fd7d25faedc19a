"""What the rewrite pass returns: a report per attention site, and what the backend needs of the rewritten graph."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx

from .extra_inputs import ExtraInput
from .idioms import Expectation, Idiom


@dataclass
class SiteReport:
    """One attention site: what it is, which layer key it binds to, and what happened to it."""

    node: str
    pattern: str
    layer_key: str | None
    status: str  # "rewritten" | "dense" | "refused"
    reason: str = ""


@dataclass
class RewrittenSite:
    weight_input: int  # index of the layer-key parameter among the graph's inputs
    layer_key: str
    mask_input: int | None = None  # index of the dense mask among the inputs (for the check_mask option)
    mask_replay: Callable | None = None  # the input -> the mask the site reads (data movement such as .contiguous())
    #: (input index, input -> write positions, row or None for every row) per store at data positions (Tencent's
    #: index_copy_ at position_ids): checked against the rows' layouts at every call
    write_checks: list[tuple[int, Callable, int | None]] = field(default_factory=list)


@dataclass
class PassResult:
    graph_module: fx.GraphModule
    reports: list[SiteReport]
    sites: list[RewrittenSite] = field(default_factory=list)
    expect: Expectation | None = None  # what every rewritten site of the graph assumes of the forward
    idiom: Idiom | None = None  # the idiom its cache sites are (a family must accept this very object)
    shape: tuple[int, int, int] | None = None  # (rows, tokens, context) the graph was compiled for
    region_tokens: int | None = None  # tokens of the shared region its `attend` sites read (None: no such site)
    #: the inputs the rewrite appended to the graph, in order (`extra_inputs.py`); the backend's values come from
    #: this same list (`extra_values`); site i's layer base is the i-th of `sites`
    inputs: tuple[ExtraInput, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.sites)
