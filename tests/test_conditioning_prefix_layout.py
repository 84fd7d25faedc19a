"""The conditioning-prefix family's two layout fields (padding inside the prefix, `prefix_columns`; how many new
tokens each new token sees, `new_visible`: what pi0 needs, tests/upstream/test_models_pi0.py), refused when they
do not fit, and the conversion a model applies to its prefix before concatenating it (``prefix_k.to(k.dtype)``,
pi0's spelling): read as the identity when it converts nothing, refused when it does."""

from __future__ import annotations

import pytest
import torch
from helpers import raises_paged
from test_conditioning_prefix import (DIM, LAYERS, NEW, PREFIX, PrefixAttention, _admitted, _compiled, _prefix_kv,
                                     _runtime, _step)

from paged_kv_compile import PassError
from paged_kv_compile.errors import RequestError
from paged_kv_compile.families.conditioning_prefix import ConditioningPrefixSpec, prefix_columns, store_prefix

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_grad")


def test_prefix_columns_give_each_held_column_its_position_in_order():
    held = (True, False, True, True, False, True)
    assert prefix_columns(4, 6, "right", held).tolist() == [0, -1, 1, 2, -1, 3]
    assert prefix_columns(4, 6, "left").tolist() == [-1, -1, 0, 1, 2, 3]  # unchanged without columns
    with pytest.raises(RequestError, match="prefix_columns gives 6 dense columns but the prefix stand-ins have 7"):
        prefix_columns(4, 7, "right", held)


@pytest.mark.parametrize("spec, reason", [
    (ConditioningPrefixSpec((3,), NEW, prefix_columns=((True,) * 4 + (False,) * 2,)),
     "as many of them True as the row's prefix length"),
    (ConditioningPrefixSpec((2, 2), NEW, prefix_columns=((True, True), (True, False, True))),
     "the same number of dense columns"),
    (ConditioningPrefixSpec((PREFIX,), NEW, new_visible=(1, 2)), r"each of the 5 new tokens"),
    (ConditioningPrefixSpec((PREFIX,), NEW, new_visible=(0,) * NEW), r"\(1\.\.5\)"),
])
def test_a_layout_that_does_not_fit_is_refused_at_admission(spec, reason):
    runtime = _runtime(rows=2)
    before = runtime.state()
    with pytest.raises(RequestError, match=reason):
        runtime.admit("r", spec)
    assert runtime.state() == before


def test_new_visible_needs_every_new_token_and_a_mask():
    """A step of fewer tokens than new_visible names is refused; so is an unmasked site (it would let every new
    token see every other), before anything runs."""
    layers = torch.nn.ModuleList(PrefixAttention() for _ in range(LAYERS))
    runtime = _admitted(layers, ConditioningPrefixSpec((PREFIX,), NEW, new_visible=(1,) + (NEW,) * (NEW - 1)))
    k, v = store_prefix(runtime, "r", _prefix_kv(layers))
    with pytest.raises(RequestError, match="computes all 5 new tokens at every step"):
        runtime.forward("r", "step", new_tokens=NEW - 1)
    _compiled(layers)
    with pytest.raises(RequestError, match=r"sees? \(1, 5, 5, 5, 5\) of them: pass the mask in the model"):
        with runtime.forward("r", "step"):
            _step(layers, torch.randn(1, NEW, DIM), [(k, v)] * LAYERS)
    assert not runtime.state()["in_flight"]


class ConvertedPrefixAttention(PrefixAttention):
    """`PrefixAttention` with the prefix converted before the concatenation, as pi0 writes it."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x, prefix_k=None, prefix_v=None):
        if prefix_k is not None and self.dtype is None:  # pi0: k_prefix.to(k_suf.dtype)
            prefix_k, prefix_v = prefix_k.to(x.dtype), prefix_v.to(x.dtype)
        elif prefix_k is not None:  # a round trip through another dtype
            prefix_k, prefix_v = prefix_k.to(self.dtype).to(x.dtype), prefix_v.to(self.dtype).to(x.dtype)
        return super().forward(x, prefix_k, prefix_v)


def test_a_no_op_conversion_of_the_prefix_pages_and_a_real_one_is_refused():
    """``prefix_k.to(x.dtype)`` on an fp32 stand-in moves nothing: it pages like the bare stand-in. Rounding it
    through bfloat16 changes the keys the dense model attends with, which the pool does not hold: refused."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(ConvertedPrefixAttention(None) for _ in range(LAYERS))
    kept = _prefix_kv(layers)
    x = torch.randn(1, NEW, DIM)
    want = _step(layers, x, kept)
    runtime = _admitted(layers)
    k, v = store_prefix(runtime, "r", kept)
    backend = _compiled(layers)
    with runtime.forward("r", "step"):
        got = _step(layers, x, [(k, v)] * LAYERS)
    assert (got - want).abs().max().item() <= 1e-5
    assert [r.status for res in backend.results for r in res.reports] == ["rewritten"]

    torch._dynamo.reset()
    for layer in layers:
        layer.dtype = torch.bfloat16
    _compiled(layers)
    with raises_paged(PassError, "a cache stand-in feeds its keys/values through computation"):
        with runtime.forward("r", "step"):
            _step(layers, x, [(k, v)] * LAYERS)
