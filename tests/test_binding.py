"""Binding: each compiled site reads its own layer's KV, whatever order blocks run in.

Blocks are driven one by one (as a pipeline with its own block loop would) and compared with the
same dense blocks, each with its own dense cache.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, compile_blocks, raises_paged

from paged_kv_compile import BindingError, RequestError
from paged_kv_compile.binding import resolve
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel
from paged_kv_compile.runtime import PagedKVRuntime

CFG = DreamZeroConfig(num_layers=3)
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Harness:
    """A paged model and a dense twin, driven block by block."""

    def __init__(self):
        self.dense = DreamZeroModel(CFG, seed=0)
        self.model = DreamZeroModel(CFG, seed=0)
        self.rt = PagedKVRuntime(dreamzero_runtime_config(CFG, block_size=8, kernel="reference"))
        self.rt.bind(self.model.blocks)
        self.backend = CountingBackend({"inner_compiler": "aot_eager"})
        compile_blocks(self.model.blocks, self.backend)
        self.rt.admit("s", DreamZeroSpec.from_model_config(CFG), rows=2)
        self.caches = [torch.zeros(2, 2, 0, CFG.num_heads, CFG.head_dim) for _ in range(CFG.num_layers)]
        self.standin = self.rt.standin(2, 2, CFG.max_attention_size, CFG.num_heads, CFG.head_dim)
        g = torch.Generator().manual_seed(0)
        self.cross = self.dense.prepare_cross_kv(torch.randn(2, CFG.text_len, CFG.text_dim, generator=g))
        self.g = g
        self.start = 0

    def inputs(self):
        x = torch.randn(2, CFG.tokens_per_forward, CFG.dim, generator=self.g)
        e = torch.randn(2, 6, CFG.dim, generator=self.g) * 0.1
        cos, sin = self.dense.rope_tables(self.start, CFG.num_frame_per_block)
        return x, e, cos, sin

    @torch.no_grad()
    def forward(self, order, commit, blocks=None):
        blocks = blocks if blocks is not None else self.model.blocks
        x, e, cos, sin = self.inputs()
        with self.rt.forward("s", "commit" if commit else "denoise"):
            for i in order:
                want, new_cache = self.dense.blocks[i](x, e, cos, sin, self.caches[i], self.cross[i])
                got, _ = blocks[i](x, e, cos, sin, self.standin, self.cross[i])
                assert (got - want).abs().max().item() <= ATOL, f"layer {i} read the wrong KV"
                if commit:
                    self.caches[i] = new_cache
        self.start += CFG.num_frame_per_block


def test_blocks_out_of_order_and_skipped_read_their_own_layer():
    h = Harness()
    h.forward([0, 1, 2], commit=True)
    h.forward([2, 0, 1], commit=True)  # out of order
    h.forward([1], commit=False)  # skip blocks in a denoise step
    h.forward([2, 1], commit=False)
    h.forward([1, 2, 0], commit=True)
    h.forward([0, 2], commit=False)
    assert h.backend.frames == 1


def test_commit_that_skips_a_block_is_refused_and_rolled_back():
    h = Harness()
    h.forward([0, 1, 2], commit=True)
    before = h.rt.state()
    with pytest.raises(RequestError, match=r"skipped layers \[1\]"):
        h.forward([0, 2], commit=True)
    assert h.rt.state() == before


def test_unbound_block_is_a_clear_error():
    h = Harness()
    stranger = DreamZeroModel(CFG, seed=7).blocks  # same code, never bound
    compile_blocks(stranger, h.backend)
    with raises_paged(BindingError, "no live runtime has bound"):
        h.forward([0], commit=False, blocks=stranger)


def test_weights_replaced_after_binding_are_a_clear_error():
    h = Harness()
    h.forward([0, 1, 2], commit=True)
    block = h.model.blocks[1]
    block.self_attn.qkv.weight = torch.nn.Parameter(block.self_attn.qkv.weight.detach().clone())
    with raises_paged(BindingError, "bind"):
        h.forward([1], commit=False)


def test_tied_weights_cannot_be_bound():
    model = DreamZeroModel(CFG, seed=0)
    model.blocks[2].self_attn.qkv.weight = model.blocks[0].self_attn.qkv.weight
    rt = PagedKVRuntime(dreamzero_runtime_config(CFG, block_size=8))
    with pytest.raises(BindingError, match="tied weights"):
        rt.bind(model.blocks)


def test_compiled_block_outside_a_forward_is_a_clear_error():
    h = Harness()
    x, e, cos, sin = h.inputs()
    with pytest.raises(RequestError, match="outside a forward"):
        with torch.no_grad():
            h.model.blocks[0](x, e, cos, sin, h.standin, h.cross[0])


def test_a_stale_binding_does_not_block_new_weights_at_its_address():
    """A live runtime whose bound layer no longer holds a weight (replaced, or the layer is gone and the allocator
    reused the address) does not own that address: another runtime may bind a layer that holds it now (a
    vllm-omni runner outlives a pipeline it was handed; tests/upstream/test_vs_vllm_omni_runner.py). A layer that
    still holds its weight stays exclusive."""
    old = DreamZeroModel(CFG, seed=0)
    first = PagedKVRuntime(dreamzero_runtime_config(CFG, block_size=8, kernel="reference"))
    first.bind(old.blocks)
    new = DreamZeroModel(CFG, seed=1)
    with pytest.raises(BindingError, match="already bound to another live runtime"):  # the same tensors: refused
        PagedKVRuntime(dreamzero_runtime_config(CFG, block_size=8, kernel="reference")).bind(old.blocks)
    for old_block, new_block in zip(old.blocks, new.blocks):  # the new model now holds the old tensors ...
        for name, p in list(old_block.named_parameters()):
            module_name, _, attr = name.rpartition(".")
            setattr(new_block.get_submodule(module_name), attr, p)
            setattr(old_block.get_submodule(module_name), attr, torch.nn.Parameter(p.detach().clone()))
    second = PagedKVRuntime(dreamzero_runtime_config(CFG, block_size=8, kernel="reference"))
    second.bind(new.blocks)  # ... and the old layers hold none of them: the first binding is stale
    assert resolve(new.blocks[0].self_attn.qkv.weight) == (second, 0)


class _NewTokensOnlyAttention(torch.nn.Module):
    """Attention over its new tokens only: what a first chunk with an empty cache (LingBot-World's) compiles to."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, x.shape[1], 3, 2, 16).unbind(2)
        return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def test_a_forward_whose_compiled_blocks_had_nothing_to_page_names_that_cause():
    """Blocks compiled with backend='paged_kv' whose graphs read and write no cache stand-in page nothing: the
    runtime refuses the forward naming that cause (and the pass report's words), not stand-ins read outside a
    compiled graph; the forward is rolled back (no block held)."""
    module = _NewTokensOnlyAttention()
    rt = PagedKVRuntime(dreamzero_runtime_config(DreamZeroConfig(num_layers=1), block_size=8, kernel="reference"))
    rt.bind([module])
    rt.admit("s", DreamZeroSpec.from_model_config(CFG), rows=1)
    free = rt.scheduler.allocator.num_free
    compiled = torch.compile(module, backend=CountingBackend({"inner_compiler": "aot_eager"}), fullgraph=True,
                             dynamic=False)
    x = torch.randn(1, DreamZeroSpec.from_model_config(CFG).chunk_tokens, 32)
    with torch.no_grad():
        for kind in ("denoise", "commit"):
            with pytest.raises(RequestError) as err:
                with rt.forward("s", kind):
                    compiled(x)
            message = str(err.value)
            assert f"no paged attention ran in this {kind} forward of 's': its blocks ran compiled with " \
                   "backend='paged_kv', but the graphs they ran had nothing to page: their attention sites were not " \
                   "paged (scaled_dot_product_attention: no cache stand-in among the inputs)" in message, message
            assert "outside a compiled graph" not in message, message
            assert rt.scheduler.allocator.num_free == free


def test_a_bound_model_run_uncompiled_is_refused_not_silently_wrong():
    """A bound model whose blocks were not compiled reads its zero stand-ins in plain PyTorch and gives wrong
    numbers: the runtime refuses every such forward (no compiled site and no call of the paged op ran), rolls it
    back, and the run ends holding no block. Both families."""
    from paged_kv_compile.driver import paged_run
    from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config
    from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model

    model = DreamZeroModel(CFG, seed=0)
    rt = PagedKVRuntime(dreamzero_runtime_config(CFG, block_size=8, kernel="reference"))
    rt.bind(model.blocks)
    with pytest.raises(RequestError, match=r"no paged attention ran in this denoise forward of 's': the model read its "
                                           r"cache stand-ins \(which hold no data\) outside a compiled graph"):
        paged_run(model, rt, owner_id="s", num_chunks=1, num_inference_steps=1)
    assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer and rt.owner_ids() == []

    hcfg = HunyuanImage3Config()
    hy = HunyuanImage3Model(hcfg, seed=0)
    hrt = PagedKVRuntime(hunyuan_runtime_config(hcfg, max_prefix=12, block_size=4, kernel="reference"))
    hrt.bind(hy.layers)
    with pytest.raises(RequestError, match="no paged attention ran in this prefill forward of 'r'"):
        paged_run(hy, hrt, owner_id="r", prompts=[torch.arange(9) % hcfg.vocab], prefix_capacity=12, num_steps=2)
    assert hrt.scheduler.allocator.num_free == hrt.pool.blocks_per_layer and hrt.owner_ids() == []
