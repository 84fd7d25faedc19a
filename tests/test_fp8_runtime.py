"""The FP8 pool through the whole stack: rewrite pass (kv_scales input), backend, runtime, both loops.

The op-level exactness is tests/test_op_fp8.py's; here the loops run on an FP8 pool at all (the op
refuses an FP8 pool without its scales, so a graph that did not thread them fails), the pool really
stores FP8 (its error differs from the bf16 pool's), and the final outputs stay near dense bf16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import fp8_accuracy  # noqa: E402

POOLS = [p for p in fp8_accuracy.POOLS if p[0] in ("bf16 pool", "fp8 e4m3, calibrated")]


def _check(rows):
    bf16, fp8 = (r for r in rows)
    # Measured (docs/benchmarks.md, FP8 section): on these loops FP8 e4m3 moves outputs of mean |x| ~1 by a
    # few hundredths on average. 0.1 mean / 1.0 max is a guard against a lost or doubled scale, which moves
    # them by O(1).
    assert fp8["mean_err"] < 0.1 and fp8["max_err"] < 1.0, fp8
    assert fp8["mean_err"] != bf16["mean_err"], "the FP8 pool must actually quantize"


def test_hunyuan_loop_on_an_fp8_pool():
    _check(fp8_accuracy.hunyuan(fp8_accuracy.HY_QUICK, (9, 5), 12, steps=2, pools=POOLS))


def test_dreamzero_loop_on_an_fp8_pool():
    _check(fp8_accuracy.dreamzero(fp8_accuracy.DZ_QUICK, chunks=4, steps=1, pools=POOLS))


@torch.no_grad()
def test_a_graph_compiled_for_an_fp32_pool_is_refused_on_an_fp8_pool_of_the_same_shape():
    """The pool's dtype is part of what a compiled graph assumes (an FP8 pool adds its scales as an input)."""
    from paged_kv_compile.errors import RequestError
    from paged_kv_compile.families.dreamzero import DreamZeroSpec
    from test_reliability_bad_input import TINY_DZ, _block_inputs, _commit_once, _dz_compiled, _dz_runtime

    model, rt = _dz_compiled()
    _commit_once(model, rt, _block_inputs(model, rt))
    shape = rt.pool.tensor.shape
    rt.close()
    rt2 = _dz_runtime(kv_dtype=torch.float8_e4m3fn)
    assert rt2.pool.tensor.shape == shape
    rt2.bind(model.blocks)
    rt2.admit("s", DreamZeroSpec.from_model_config(TINY_DZ), rows=2)
    inputs = _block_inputs(model, rt2)
    before = rt2.pool.tensor.view(torch.uint8).clone()
    with pytest.raises(RequestError, match=r"another pool geometry; compile again for this runtime \(shape and dtype"):
        with rt2.forward("s", "denoise"):
            model.blocks[0](*inputs)
    assert torch.equal(rt2.pool.tensor.view(torch.uint8), before)


@pytest.mark.parametrize("allocator", ["builtin", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_set_scales_is_refused_while_any_block_holds_quantized_data(allocator):
    """Issue 23, defect 4: scales set after a session's shared regions were quantized at admission were accepted,
    and attention read those regions about 100x off. Refused now while any block is held (regions, history,
    prefixes), naming the fix, with the scales and the pool unchanged; accepted again once every owner is gone."""
    from paged_kv_compile import ConfigError
    from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
    from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config
    from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec
    from paged_kv_compile.models.dreamzero import DreamZeroConfig
    from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config
    from paged_kv_compile.runtime import PagedKVRuntime

    fp8 = torch.float8_e4m3fn
    cfg = DreamZeroConfig(num_layers=2, frame_seqlen=4, num_frame_per_block=1, local_attn_size=3, text_len=6)
    rt = PagedKVRuntime(dreamzero_runtime_config(cfg, cross_regions=2, kernel="reference", kv_dtype=fp8),
                        allocator=allocator)
    rt.pool.set_scales(0.5, 0.25)  # nothing held yet: fine
    kv = [torch.randn(2, 2, cfg.text_len, cfg.num_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    rt.admit("s", DreamZeroSpec.from_model_config(cfg), cross_kv=kv)
    scales, pool = rt.pool.scales.clone(), rt.pool.tensor.view(torch.uint8).clone()
    state = rt.state()
    with pytest.raises(ConfigError, match=r"set_scales while 4 blocks per layer are held.*quantized with the current "
                                          r"scales.*Set the scales before admitting any session or request"):
        rt.pool.set_scales(0.005, 0.0025)
    assert torch.equal(rt.pool.scales, scales) and torch.equal(rt.pool.tensor.view(torch.uint8), pool)
    assert rt.state() == state
    rt.release("s")
    rt.pool.set_scales(0.005, 0.0025)  # every block free again

    hcfg = HunyuanImage3Config()
    hy = PagedKVRuntime(hunyuan_runtime_config(hcfg, max_prefix=8, kv_dtype=fp8), allocator=allocator)
    hy.admit("r", HunyuanSpec((5,), hcfg.target_len))  # its prompt prefix is held from admission
    with pytest.raises(ConfigError, match="set_scales while 1 blocks per layer are held"):
        hy.pool.set_scales(2.0, 2.0)
    hy.release("r")
    hy.pool.set_scales(2.0, 2.0)
