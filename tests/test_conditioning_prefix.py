"""The conditioning-prefix idiom and family on a plain attention: a prefix forward RETURNS its K/V (the other way a
model keeps them; GLM-Image's attribute assignment is in tests/upstream/test_models_glm_image.py), the family
stores them once, every step reads them with ``cat([prefix_k, k])`` and no mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import CountingBackend, raises_paged

from paged_kv_compile import PagedKVConfig, PagedKVRuntime, PassError
from paged_kv_compile.errors import RequestError
from paged_kv_compile.families.conditioning_prefix import ConditioningPrefixSpec, prefix_columns, store_prefix

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_grad")

HEADS, HEAD_DIM, LAYERS, BLOCK, PREFIX, NEW = 2, 8, 2, 4, 6, 5
DIM = HEADS * HEAD_DIM


class PrefixAttention(torch.nn.Module):
    """Fused QKV, then attention over ``cat([prefix, new])`` when given a prefix; returns its own K/V too."""

    def __init__(self, causal: bool = False, skip: int = 0) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(DIM, 3 * DIM), torch.nn.Linear(DIM, DIM)
        self.causal, self.skip = causal, skip

    def forward(self, x, prefix_k=None, prefix_v=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, HEAD_DIM).unbind(2)
        if prefix_k is not None and prefix_k.dim() == 3:  # packed (P, H, D), as BAGEL's NaiveCache keeps a branch
            prefix_k, prefix_v = prefix_k[None].expand(B, -1, -1, -1), prefix_v[None].expand(B, -1, -1, -1)
        if prefix_k is not None:
            k = torch.cat([prefix_k[:, self.skip:], k], 1)
            v = torch.cat([prefix_v[:, self.skip:], v], 1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=self.causal and prefix_k is not None)
        return self.out(o.transpose(1, 2).reshape(B, T, DIM)), (k, v)


def _layers(**kw) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(PrefixAttention(**kw) for _ in range(LAYERS))


def _prefix_kv(layers, rows: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The prefix forward as the model writes it: each layer's returned K/V kept by the caller."""
    x, kept = torch.randn(rows, PREFIX, DIM, generator=torch.Generator().manual_seed(1)), []
    for layer in layers:
        x, kv = layer(x)
        kept.append(kv)
    return kept


def _step(layers, x, prefixes):
    for layer, (k, v) in zip(layers, prefixes):
        x, _ = layer(x, k, v)
    return x


def _runtime(rows: int = 2) -> PagedKVRuntime:
    return PagedKVRuntime(PagedKVConfig(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
                                        blocks_per_layer=8, max_rows=rows, scratch_tokens_per_row=16,
                                        kernel="reference"))


def _admitted(layers, spec: ConditioningPrefixSpec | None = None) -> PagedKVRuntime:
    """A runtime bound to `layers` with request "r" admitted (one row of PREFIX tokens unless `spec` says)."""
    runtime = _runtime()
    runtime.bind(list(layers))
    runtime.admit("r", spec or ConditioningPrefixSpec((PREFIX,), NEW))
    return runtime


def _compiled(layers) -> CountingBackend:
    backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, fullgraph=True, dynamic=False)
    return backend


def test_a_returned_prefix_is_stored_once_and_read_by_every_step():
    """Dense eager vs compiled paged over 3 steps of 2 rows: one frame for both layers, the prefix in the
    request's blocks (taken at admission, no block taken by a step), everything freed at release."""
    layers = _layers()
    kept = _prefix_kv(layers, rows=2)
    steps = [torch.randn(2, NEW, DIM, generator=torch.Generator().manual_seed(10 + i)) for i in range(3)]
    dense = [_step(layers, x, kept) for x in steps]
    runtime = _runtime(rows=2)
    runtime.bind(list(layers))
    runtime.admit("r", ConditioningPrefixSpec((PREFIX, PREFIX), NEW))
    held = runtime.state()["num_free"]
    k, v = store_prefix(runtime, "r", kept)
    backend = _compiled(layers)
    for x, want in zip(steps, dense):
        with runtime.forward("r", "step", new_tokens=NEW):
            got = _step(layers, x, [(k, v)] * LAYERS)
        assert (got - want).abs().max().item() <= 1e-5
    assert backend.frames == 1
    assert [r.pattern for res in backend.results for r in res.reports] == ["conditioning-prefix"]
    assert runtime.state()["num_free"] == held == 8 - 2 * -(-PREFIX // BLOCK)
    runtime.release("r")
    assert runtime.state()["num_free"] == 8


def test_after_a_reset_the_prefix_must_be_stored_again():
    layers = _layers()
    kept = _prefix_kv(layers)
    x = torch.randn(1, NEW, DIM)
    want = _step(layers, x, kept)
    runtime = _admitted(layers)
    store_prefix(runtime, "r", kept)
    runtime.reset("r")
    with pytest.raises(RequestError, match="has no stored prefix"):
        runtime.forward("r", "step")
    k, v = store_prefix(runtime, "r", kept)  # takes its blocks again (admission reserved them)
    _compiled(layers)
    with runtime.forward("r", "step"):
        got = _step(layers, x, [(k, v)] * LAYERS)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kw, reason", [
    (dict(causal=True), "is_causal=True: a conditioning prefix is attended with full visibility"),
    (dict(skip=2), r"it must read the whole prefix \[0, 6\) in order"),
])
def test_a_site_that_is_not_a_whole_unmasked_prefix_is_refused_with_the_reason(kw, reason):
    layers = _layers(**kw)
    runtime = _admitted(layers)
    k, v = store_prefix(runtime, "r", _prefix_kv(_layers()))
    _compiled(layers)
    with raises_paged(PassError, reason):
        with runtime.forward("r", "step"):
            _step(layers, torch.randn(1, NEW, DIM), [(k, v)] * LAYERS)
    assert not runtime.state()["in_flight"]


def test_a_packed_prefix_of_one_row_pages_and_is_refused_for_several():
    """A prefix kept packed (P, H, D) and read as ``prefix[None]`` by a one-row attention pages; read by two rows
    (broadcast) it is refused (its batch axis is not the stand-in's)."""
    layers = _layers()
    kept = _prefix_kv(layers)
    x = torch.randn(1, NEW, DIM)
    want = _step(layers, x, [(k[0], v[0]) for k, v in kept])
    runtime = _admitted(layers)
    k, v = store_prefix(runtime, "r", kept)
    backend = _compiled(layers)
    with runtime.forward("r", "step"):
        got = _step(layers, x, [(k[0], v[0])] * LAYERS)  # the model keeps the packed stand-in
    assert (got - want).abs().max().item() <= 1e-5
    assert [r.pattern for res in backend.results for r in res.reports] == ["conditioning-prefix"]
    runtime.admit("two", ConditioningPrefixSpec((PREFIX, PREFIX), NEW))
    store_prefix(runtime, "two", [(torch.cat([k, k]), torch.cat([v, v])) for k, v in kept])
    with raises_paged(PassError, "key: l_prefix_k_ does not map batch/heads/head_dim the way the paged op reads"):
        with runtime.forward("two", "step"):
            _step(layers, torch.randn(2, NEW, DIM), [(k[0], v[0])] * LAYERS)


def test_store_prefix_is_refused_inside_a_forward_and_for_another_family():
    layers = _layers()
    runtime = _runtime()
    runtime.admit("r", ConditioningPrefixSpec((PREFIX,), NEW))
    kept = _prefix_kv(layers)
    store_prefix(runtime, "r", kept)
    runtime.admit("s", ConditioningPrefixSpec((PREFIX,), NEW))
    with runtime.forward_plan(runtime.plan("r", "step"), expect_attention=False):
        with pytest.raises(RequestError, match="inside a forward"):
            store_prefix(runtime, "s", kept)
    from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec

    runtime.admit("h", HunyuanSpec((3,), 4))
    with pytest.raises(RequestError, match="not a conditioning_prefix request"):
        store_prefix(runtime, "h", kept)


def test_prefix_columns_name_each_dense_column():
    assert prefix_columns(3, 5, "right").tolist() == [0, 1, 2, -1, -1]
    assert prefix_columns(3, 5, "left").tolist() == [-1, -1, 0, 1, 2]
