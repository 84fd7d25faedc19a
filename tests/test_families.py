"""The family architecture: the scheduler and runtime are generic, each family is one module.

A third family defined here (plain causal decoding: the prompt's K/V is kept, each decode step appends
one token) joins by implementing `Family` and registering itself; admission, planning, the forward
bracket, metadata and the op then serve it unchanged, and its attention equals dense causal SDPA.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from paged_kv_compile import PagedKVConfig, RequestError, families
from paged_kv_compile.families.base import BlockSource, ForwardPlan, Owner, ceil_div
from paged_kv_compile.families.dreamzero import DreamZeroExpect
from paged_kv_compile.families.hunyuan_image3 import HunyuanExpect
from paged_kv_compile.layout import RowLayout
from paged_kv_compile.runtime import PagedKVRuntime

H, D, B = 2, 8, 4


@dataclass(frozen=True)
class DecodeSpec:
    prompt_len: int
    max_new: int


@dataclass(frozen=True)
class DecodeExpect:
    context: int
    family: str = field(default="toy_decode", init=False)


class DecodeFamily:
    """Causal decoding: a prefill writes the prompt; each decode step appends one kept token."""

    name = "toy_decode"
    noun = "sequence"
    spec_type = DecodeSpec
    evict_lru = False

    def rows(self, spec, requested):
        return 1 if requested is None else requested

    def admission_blocks(self, spec: DecodeSpec, rows: int, blocks: BlockSource) -> list[int]:
        return [ceil_div(spec.prompt_len + spec.max_new, blocks.block_size)] * rows

    def plan(self, owner: Owner, blocks: BlockSource, kind: str, **info) -> ForwardPlan:
        spec: DecodeSpec = owner.spec
        done = owner.version  # decode steps finished so far
        if kind == "prefill":
            start, count = 0, spec.prompt_len
        elif kind == "decode":
            start, count = spec.prompt_len + done, 1
        else:
            raise RequestError(f"unknown kind {kind!r}")
        positions = torch.arange(start, start + count)
        layouts = [RowLayout.build(row, [], positions, positions + 1, start + count) for row in owner.rows]
        return ForwardPlan(owner.owner_id, kind, layouts, count, spec.prompt_len + spec.max_new, [],
                           keeps_kv=True)

    def finish(self, owner: Owner, plan: ForwardPlan, blocks: BlockSource) -> None:
        if plan.kind == "decode":
            owner.version += 1

    def check_expectation(self, expect, owner: Owner, plan) -> None:
        if expect.context != owner.spec.prompt_len + owner.spec.max_new:
            raise RequestError("toy_decode: wrong context")

    def match(self, site):
        return "toy_decode runs uncompiled here: it has no idiom to match"


@pytest.fixture
def decode_family():
    family = families.register(DecodeFamily())
    yield family
    families.unregister(family.name)


def _runtime() -> PagedKVRuntime:
    cfg = PagedKVConfig(num_layers=2, num_kv_heads=H, head_dim=D, block_size=B, blocks_per_layer=16, max_rows=2,
                        scratch_tokens_per_row=8, dtype=torch.float32)
    return PagedKVRuntime(cfg)


def test_a_third_family_runs_on_the_generic_runtime(decode_family):
    """Admission, plans, forwards and finishes of a family the scheduler has never heard of; attention
    through the op equals dense causal attention over the whole sequence (fp32, 1e-5)."""
    rt = _runtime()
    spec = DecodeSpec(prompt_len=6, max_new=3)
    rt.admit("seq", spec)
    assert rt.scheduler.owners["seq"].family == "toy_decode"
    gen = torch.Generator().manual_seed(0)
    total = spec.prompt_len + spec.max_new
    q_all, k_all, v_all = (torch.randn(1, total, H, D, generator=gen) for _ in range(3))
    dense = F.scaled_dot_product_attention(q_all.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2),
                                           is_causal=True).transpose(1, 2)
    got = []
    for kind, start, count in [("prefill", 0, 6), ("decode", 6, 1), ("decode", 7, 1), ("decode", 8, 1)]:
        with rt.forward_for("seq", kind) as active:
            rt.check_layout(DecodeExpect(total))
            for layer in range(rt.config.num_layers):
                views = active.meta.layers[layer]
                sl = slice(start, start + count)
                out = torch.ops.paged_kv.write_attend(
                    q_all[:, sl], k_all[:, sl], v_all[:, sl], rt.pool.tensor, views.slot_mapping,
                    views.block_table, active.meta.seq_lens, active.meta.kv_visible_end, D**-0.5, "reference")
            got.append(out)
    torch.testing.assert_close(torch.cat(got, dim=1), dense, atol=1e-5, rtol=0)
    rt.scheduler.release("seq", "finished")
    assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer


def test_a_site_of_one_family_refuses_a_forward_of_another(decode_family):
    rt = _runtime()
    rt.admit("seq", DecodeSpec(prompt_len=4, max_new=1))
    with rt.forward_for("seq", "prefill"):
        with pytest.raises(RequestError, match="a dreamzero attention site ran inside a toy_decode forward"):
            rt.check_layout(DreamZeroExpect(window_tokens=8, sink_tokens=0, chunk_tokens=4, action_tokens=0))
        with pytest.raises(RequestError, match="toy_decode: wrong context"):
            rt.check_layout(DecodeExpect(3))


def test_expectations_are_frozen_and_typed():
    """What a matched site expects is a frozen dataclass naming its family, not a dict read with .get."""
    dz = DreamZeroExpect(window_tokens=24, sink_tokens=8, chunk_tokens=8, action_tokens=2)
    hy = HunyuanExpect(12)
    assert (dz.family, dz.context, hy.family, hy.context) == ("dreamzero", 24, "hunyuan_image3", 12)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dz.window_tokens = 8
    assert isinstance(dz, families.Expectation) and isinstance(hy, families.Expectation)


def test_registry_lookups_name_the_fix():
    with pytest.raises(RequestError, match="is no family's spec"):
        families.for_spec(object())
    with pytest.raises(Exception, match="no model family knows Linear"):
        families.for_model(torch.nn.Linear(2, 2))
    with pytest.raises(Exception, match="unknown model family 'nope'"):
        families.get("nope")
    with pytest.raises(Exception, match="already registered"):
        families.register(type("Fake", (), {"name": "dreamzero"})())
