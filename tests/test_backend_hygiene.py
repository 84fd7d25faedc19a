"""Backend hygiene: registration, pass-through without stand-ins, no pool copies, clear refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from _codecheck import pool_sized_allocations
from helpers import CountingBackend, compile_blocks, raises_paged

from paged_kv_compile import ConfigError, PassError
from paged_kv_compile.backend import record_passes
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel
from paged_kv_compile.runtime import PagedKVRuntime


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_backend_is_registered_through_the_entry_point_without_import():
    code = (
        "import sys, torch\n"
        "m = torch.nn.Linear(4, 4)\n"
        "f = torch.compile(m, backend='paged_kv', options={'inner_compiler': 'eager'})\n"
        "x = torch.randn(2, 4)\n"
        "assert torch.equal(f(x), m(x))\n"
        "assert 'paged_kv_compile' in sys.modules  # loaded by dynamo through the entry point\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_without_standins_it_is_the_inner_compiler():
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x, cache):
            q, k, v = self.qkv(x).view(1, -1, 3, 2, 8).unbind(2)
            k = torch.cat([cache[0], k], 1)
            v = torch.cat([cache[1], v], 1)
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

    m = Attention()
    x, cache = torch.randn(1, 4, 16), torch.randn(2, 1, 6, 2, 8)  # a real dense cache: stays dense
    backend = CountingBackend({"inner_compiler": "aot_eager"})
    compiled = torch.compile(m, backend=backend, fullgraph=True)
    with torch.no_grad():
        assert torch.allclose(compiled(x, cache), m(x, cache), atol=1e-6)
    (result,) = backend.results
    assert not result.changed and [r.status for r in result.reports] == ["dense"]


def _dreamzero_block_setup(inner: str, **cfg_kw):
    cfg = DreamZeroConfig(num_layers=2, **cfg_kw)
    model = DreamZeroModel(cfg, seed=0)
    rt = PagedKVRuntime(dreamzero_runtime_config(cfg, block_size=8, kernel="reference"))
    rt.bind(model.blocks)
    rt.admit("s", DreamZeroSpec.from_model_config(cfg), rows=2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, cfg.tokens_per_forward, cfg.dim, generator=g)
    e = torch.randn(2, 6, cfg.dim, generator=g) * 0.1
    cos, sin = model.rope_tables(0, cfg.num_frame_per_block)
    cross = model.prepare_cross_kv(torch.randn(2, cfg.text_len, cfg.text_dim, generator=g))[0]
    standin = rt.standin(2, 2, cfg.max_attention_size, cfg.num_heads, cfg.head_dim)
    return cfg, model, rt, (x, e, cos, sin, standin, cross)


def test_inductor_passes_the_pool_straight_to_the_op():
    """Inductor's generated code allocates and copies no pool-sized buffer (the op mutates in place)."""
    from torch._inductor.utils import run_and_get_code

    cfg, model, rt, args = _dreamzero_block_setup("inductor")
    block = model.blocks[0]
    block.compile(backend="paged_kv", fullgraph=True, dynamic=False, options={"inner_compiler": "inductor"})
    pool_before = rt.pool.tensor.clone()
    with torch.no_grad(), rt.forward("s", "denoise"):
        _, codes = run_and_get_code(block, *args)
    code = "\n".join(codes)
    assert "paged_kv.write_attend" in code
    assert pool_sized_allocations(code, tuple(rt.pool.tensor.shape)) == []
    assert not torch.equal(rt.pool.tensor, pool_before), "the compiled op wrote the runtime's real pool"


def test_dynamic_shapes_are_refused_with_the_fix():
    cfg, model, rt, args = _dreamzero_block_setup("aot_eager")
    block = model.blocks[0]
    block.compile(backend="paged_kv", fullgraph=True, dynamic=True, options={"inner_compiler": "aot_eager"})
    with raises_paged(PassError, "dynamic=False"), torch.no_grad(), rt.forward("s", "denoise"):
        block(*args)


def test_unknown_option_is_a_config_error():
    cfg, model, rt, args = _dreamzero_block_setup("aot_eager")
    block = model.blocks[0]
    block.compile(backend="paged_kv", fullgraph=True, dynamic=False, options={"inner": "eager"})
    with raises_paged(ConfigError, "unknown paged_kv option"), torch.no_grad(), rt.forward("s", "denoise"):
        block(*args)


def test_pass_report_lists_every_site():
    cfg, model, rt, args = _dreamzero_block_setup("aot_eager")
    compile_blocks(model.blocks, CountingBackend({"inner_compiler": "aot_eager"}))
    with record_passes() as passes, torch.no_grad(), rt.forward("s", "commit"):
        for block in model.blocks:
            block(*args)
    (result,) = passes
    by_status = {r.status: r for r in result.reports}
    assert by_status["rewritten"].pattern == "window"
    assert "qkv" in by_status["rewritten"].layer_key
    assert by_status["dense"].reason.startswith("reads no cache stand-in"), "cross-attention stays model-owned"
