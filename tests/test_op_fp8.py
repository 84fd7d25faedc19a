"""The FP8 pool: quantize on write inside the op, dequantize in attention, against exact oracles.

The exact oracle of the FP8 path is dense fp32 attention over the SAME quantize-dequantize round trip of
K/V (tests/_opcases.py, fp8_case): it must match to 1e-5, and the pool must hold the quantized bytes
bit for bit. The distance to unquantized attention is a property of the format and of the scales:
benchmarks/fp8_accuracy.py measures it on both families' loops.
"""

from __future__ import annotations

import os

import pytest
import torch

import paged_kv_compile  # noqa: F401  (registers torch.ops.paged_kv)
from paged_kv_compile.config import PagedKVConfig
from paged_kv_compile.errors import ConfigError, OpInputError
from paged_kv_compile.ops import reference
from paged_kv_compile.pool import KVPool

from _opcases import dense_oracle, expected_fp8_pool, fp8_case, make_case
from hypothesis import given, settings
from hypothesis import strategies as st
from test_op_reference import geometries

write_attend = torch.ops.paged_kv.write_attend
attend = torch.ops.paged_kv.attend
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]

GEOMETRIES = {
    "gqa2, padded row, unaligned prefix": dict(
        seed=50, hkv=2, ratio=2, block_size=3, tokens=3, prefixes=[4, 0, 7], new_counts=[2, 0, 3],
        modes=["random", "padded", "causal"], layout="transposed"),
    "mha, block 4, full rows": dict(
        seed=51, hkv=2, ratio=1, head_dim=4, block_size=4, tokens=5, prefixes=[9, 1], new_counts=[3, 5],
        modes=["full", "random"], right_aligned=True, extra_width=2),
    "gqa4, strided metadata": dict(
        seed=52, hkv=1, ratio=4, block_size=2, tokens=4, prefixes=[3, 5], new_counts=[4, 1],
        modes=["causal", "full"], layout="sliced", meta_layout="strided"),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _run(kernel: str, geometry: str, dtype: torch.dtype):
    case = make_case(**GEOMETRIES[geometry])
    pool, scales, oracle = fp8_case(case, dtype, seed=7)
    before = pool.clone()
    out = write_attend(*case.args(pool), case.scale, kernel, kv_scales=scales)
    return case, pool, before, scales, oracle, out


@pytest.mark.parametrize("host_lengths", [True, False], ids=["cpu-used-span", "device-path"])
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_reference_fp8_matches_dense_attention_over_the_same_round_trip(geometry, dtype, host_lengths, monkeypatch):
    monkeypatch.setattr(reference, "HOST_LENGTHS_ON_CPU", host_lengths)
    case, pool, before, scales, oracle, out = _run("reference", geometry, dtype)
    assert out.dtype == case.query.dtype and out.is_contiguous()
    torch.testing.assert_close(out, dense_oracle(oracle), atol=1e-5, rtol=0)
    assert torch.equal(_bits(pool), _bits(expected_fp8_pool(case, before, scales))), "quantized bytes, only at slots"
    again = attend(case.query, pool, case.block_table, case.seq_lens, case.kv_visible_end, case.scale, "reference",
                   kv_scales=scales)
    assert torch.equal(again, out), "attend reads what write_attend wrote"


@settings(max_examples=40, deadline=None)
@given(geometry=geometries(), dtype=st.sampled_from(FP8), host_lengths=st.booleans(), seed=st.integers(0, 2**16))
def test_reference_fp8_over_random_geometries(geometry, dtype, host_lengths, seed):
    """The same exact oracle over test_op_reference's random geometries (rows, blocks, layouts, strides)."""
    previous, reference.HOST_LENGTHS_ON_CPU = reference.HOST_LENGTHS_ON_CPU, host_lengths
    try:
        case = make_case(**geometry)
        pool, scales, oracle = fp8_case(case, dtype, seed=seed)
        before = pool.clone()
        out = write_attend(*case.args(pool), case.scale, "reference", kv_scales=scales)
        torch.testing.assert_close(out, dense_oracle(oracle), atol=1e-5, rtol=0)
        assert torch.equal(_bits(pool), _bits(expected_fp8_pool(case, before, scales)))
    finally:
        reference.HOST_LENGTHS_ON_CPU = previous


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_triton_fp8_matches_the_reference(geometry, dtype):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    ref = _run("reference", geometry, dtype)
    case, pool, before, scales, oracle, out = _run("triton", geometry, dtype)
    assert torch.equal(_bits(pool), _bits(ref[1])), "the Triton store quantizes bit for bit like ops/fp8.py"
    torch.testing.assert_close(out, ref[5], atol=1e-5, rtol=0)
    torch.testing.assert_close(out, dense_oracle(oracle), atol=1e-5, rtol=0)


def test_a_block_filled_by_several_forwards_keeps_every_token_exact():
    """Chunks write one block in turns: static scales never change, so earlier tokens are never requantized."""
    B, H, D = 4, 1, 8
    pool = torch.zeros(2, 3, B, H, D, dtype=torch.float8_e4m3fn)
    scales = torch.full((2, 3, H), 0.01)
    scales[:, 1] = torch.tensor([[0.02], [0.005]])  # the row's block: K and V scales differ
    gen = torch.Generator().manual_seed(3)
    ks, vs = [], []
    for chunk in range(2):  # tokens 0-1, then 2-3 of block 1
        k, v, q = (torch.randn(1, 2, H, D, generator=gen) for _ in range(3))
        ks.append(k)
        vs.append(v)
        slots = torch.tensor([[B + 2 * chunk, B + 2 * chunk + 1]])
        table = torch.tensor([[1, 2]], dtype=torch.int32)
        seq = torch.tensor([2 * chunk + 2], dtype=torch.int32)
        end = seq.view(1, 1).expand(1, 2).contiguous()
        write_attend(q, k, v, pool, slots, table, seq, end, 0.5, "reference", kv_scales=scales)
    k_all, v_all = torch.cat(ks, 1)[0], torch.cat(vs, 1)[0]
    assert torch.equal(_bits(pool[0, 1]), _bits((k_all / 0.02).to(torch.float8_e4m3fn)))
    assert torch.equal(_bits(pool[1, 1]), _bits((v_all / 0.005).to(torch.float8_e4m3fn)))


def test_out_of_range_values_saturate_instead_of_turning_nan():
    case = make_case(**GEOMETRIES["mha, block 4, full rows"])
    pool, scales, oracle = fp8_case(case, torch.float8_e4m3fn, low=1e-4, high=2e-4)  # most values > 448 * scale
    write_attend(*case.args(pool), case.scale, "reference", kv_scales=scales)
    stored = pool.float()
    assert not stored.isnan().any() and stored.abs().max() == 448.0


def test_scales_are_checked_where_the_pool_is():
    case = make_case(**GEOMETRIES["mha, block 4, full rows"])
    pool, scales, _ = fp8_case(case, torch.float8_e4m3fn)
    before = pool.clone()
    with pytest.raises(OpInputError, match=r"needs kv_scales, float32 \[2, N, Hkv\].*pass KVPool.scales"):
        write_attend(*case.args(pool), case.scale, "reference")
    with pytest.raises(OpInputError, match=r"kv_scales must be float32 \(2, \d+, 2\)"):
        write_attend(*case.args(pool), case.scale, "reference", kv_scales=scales[:, :-1])
    with pytest.raises(OpInputError, match=r"kv_scales must be float32"):
        write_attend(*case.args(pool), case.scale, "reference", kv_scales=scales.double())
    with pytest.raises(OpInputError, match=r"scales go with an FP8 pool only"):
        write_attend(*case.args(), case.scale, "reference", kv_scales=scales)
    with pytest.raises(OpInputError, match=r"query must be a floating dtype \(a compute dtype, not FP8\)"):
        args = list(case.args(pool))
        args[0] = args[0].to(torch.float8_e4m3fn)
        write_attend(*args, case.scale, "reference", kv_scales=scales)
    assert torch.equal(_bits(pool), _bits(before)), "a refused call leaves the pool as it was"


def test_opcheck_with_scales():
    case = make_case(**GEOMETRIES["gqa2, padded row, unaligned prefix"])
    pool, scales, _ = fp8_case(case, torch.float8_e4m3fn)
    # test_schema is left out: its checker multiplies the float8 pool on the CPU, which torch cannot do.
    torch.library.opcheck(write_attend.default, (*case.args(pool), case.scale),
                          {"kernel": "reference", "kv_scales": scales},
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))


# ---- the pool and the config ------------------------------------------------------------------------------


def _cfg(**kw) -> PagedKVConfig:
    base = dict(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, blocks_per_layer=5, scratch_tokens_per_row=8,
                dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    return PagedKVConfig(**{**base, **kw})


def test_fp8_pool_layout_scales_and_bytes():
    pool = KVPool.from_config(_cfg())
    assert pool.tensor.dtype == torch.float8_e4m3fn and pool.scales.shape == (2, pool.num_blocks_total, 2)
    k = torch.tensor([[1.0, 2.0], [3.0, 0.5], [2.0, 4.0]])
    pool.set_scales(k, 0.25)
    assert torch.equal(pool.scales[0, :15], k.repeat_interleave(5, 0)), "each layer's blocks carry its scales"
    assert torch.equal(pool.scales[0, 15:], torch.tensor([3.0, 4.0]).expand(7, 2)), "scratch + pad: max over layers"
    assert bool((pool.scales[1] == 0.25).all())
    per_block = 2 * (4 * 2 * 4 * 1 + 2 * 4)  # K and V: fp8 values + one float32 scale per kv head
    assert KVPool.bytes_per_block_all_layers(_cfg()) == 3 * per_block
    assert pool.nbytes == pool.num_blocks_total * per_block
    bf16 = KVPool.from_config(_cfg(kv_dtype=None))
    assert bf16.scales is None and bf16.tensor.dtype == torch.bfloat16
    with pytest.raises(ConfigError, match=r"has no scales; set kv_dtype"):
        bf16.set_scales(1.0, 1.0)
    with pytest.raises(ConfigError, match=r"k_scale has shape \(4,\); it must broadcast to \(3, 2\)"):
        pool.set_scales(torch.ones(4), 1.0)
    with pytest.raises(ConfigError, match=r"finite and > 0"):
        pool.set_scales(0.0, 1.0)


def test_budget_sizing_counts_the_scales():
    per_block = 2 * (4 * 2 * 4 + 2 * 4)
    budget = per_block * (3 * 7 + 2 * 3 + 1) + per_block - 1
    pool = KVPool.from_config(_cfg(blocks_per_layer=None, budget_bytes=budget))
    assert pool.blocks_per_layer == 7 and pool.nbytes <= budget


def test_config_refuses_other_kv_dtypes():
    with pytest.raises(ConfigError, match=r"kv_dtype=torch.int8 is not supported"):
        _cfg(kv_dtype=torch.int8)
    with pytest.raises(ConfigError, match=r"set kv_dtype for an FP8 pool"):
        _cfg(dtype=torch.float8_e4m3fn)
    assert _cfg(kv_dtype=torch.bfloat16).pool_dtype == torch.bfloat16


# ---- vendor adapters (fakes enforce the vendor rules) -----------------------------------------------------


def _fake_fa3(calls: list):
    """flash_attn_interface.flash_attn_with_kvcache with FA3's FP8 rules: q, k_cache and v_cache share one
    float8_e4m3fn dtype; q/k/v_descale are float32 (batch, num_heads_k); the output is bfloat16."""
    import types

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None, causal=False,
                                page_table=None, q_descale=None, k_descale=None, v_descale=None,
                                return_softmax_lse=False, **kw):
        assert not kw
        assert q.dtype == k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn, "FA3 FP8 needs q, k, v in e4m3"
        R, T, Hq, D = q.shape
        Hkv = k_cache.shape[2]
        for d in (q_descale, k_descale, v_descale):
            assert d.dtype == torch.float32 and tuple(d.shape) == (R, Hkv), "descales are (batch, num_heads_k)"
        calls.append(dict(k_cache=k_cache, k_descale=k_descale))
        G = Hq // Hkv
        out = torch.empty(R, T, Hq, D)
        lse = torch.full((R, Hq, T), float("inf"))  # +inf for an empty row, as FA3 returns
        for r in range(R):
            L = int(cache_seqlens[r])
            p = torch.arange(L)
            blocks = page_table[r].long()[p // k_cache.shape[1]]
            k = (k_cache[blocks, p % k_cache.shape[1]].float() * k_descale[r, None, :, None]).repeat_interleave(G, 1)
            v = (v_cache[blocks, p % v_cache.shape[1]].float() * v_descale[r, None, :, None]).repeat_interleave(G, 1)
            qr = q[r].float() * q_descale[r].repeat_interleave(G)[None, :, None]
            s = torch.einsum("thd,lhd->htl", qr, k) * softmax_scale
            out[r] = torch.einsum("htl,lhd->thd", torch.softmax(s, -1), v) if L else 0.0
            if L:
                lse[r] = torch.logsumexp(s, -1)
        return (out.to(torch.bfloat16), lse) if return_softmax_lse else out.to(torch.bfloat16)

    module = types.ModuleType("flash_attn_interface")
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


def _bf16_fp8_case(dtype=torch.float8_e4m3fn):
    case = make_case(seed=60, hkv=2, ratio=2, block_size=4, tokens=4, prefixes=[5, 3], new_counts=[2, 4],
                     modes=["full", "full"], right_aligned=True, dtype=torch.bfloat16)
    pool, scales, _ = fp8_case(case, dtype, low=0.01, high=0.03)
    return case, pool, scales


@pytest.fixture
def vendor(monkeypatch):
    import sys

    from paged_kv_compile.ops import flash_attn as fa
    from paged_kv_compile.ops import npu

    for name in ("flash_attn_interface", "flash_attn", "vllm.vllm_flash_attn", "torch_npu"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(fa, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(npu, "DEVICE_TYPES", ("npu", "cpu"))
    fa.load_module.cache_clear()
    npu.load_module.cache_clear()
    yield monkeypatch
    fa.load_module.cache_clear()
    npu.load_module.cache_clear()


def test_flash_attn_3_gets_the_pools_fp8_halves_and_the_ops_row_scales_as_descales(vendor):
    import sys

    from paged_kv_compile.ops.flash_attn import quantize_query
    from paged_kv_compile.ops.fp8 import dequantize, row_scales

    calls: list = []
    vendor.setitem(sys.modules, "flash_attn_interface", _fake_fa3(calls))
    case, pool, scales = _bf16_fp8_case()
    ref_pool = pool.clone()
    out = write_attend(*case.args(pool), case.scale, "flash_attn", visibility="full", kv_scales=scales)
    assert calls[0]["k_cache"].data_ptr() == pool[0].data_ptr(), "k_cache is the FP8 pool's K half, not a copy"
    assert torch.equal(calls[0]["k_descale"], row_scales(scales, case.block_table)[0])
    # Oracle: the reference kernel on the same pool with the query FA3 sees (its FP8 round trip).
    q8, q_descale = quantize_query(case.query.contiguous(), 2, torch.float8_e4m3fn)
    q_seen = dequantize(q8, q_descale.repeat_interleave(2, 1)[:, None, :, None], torch.float32)
    want = write_attend(case.query.float().copy_(q_seen), case.key.float(), case.value.float(),
                        ref_pool, *case.args()[4:], case.scale, "reference", kv_scales=scales)
    assert torch.equal(_bits(pool), _bits(ref_pool))
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=0)
    assert out.dtype == torch.bfloat16


def test_flash_attn_3_fp8_irregular_gap_splits_with_the_rows_descales(vendor):
    """An FP8 pool with a gap on FA3: both split calls get the FP8 halves and the rows' scales as descales; the
    merged result is the reference's on the query FA3 sees (its FP8 round trip), every part scoring that query."""
    import sys

    from paged_kv_compile.ops.flash_attn import quantize_query
    from paged_kv_compile.ops.fp8 import dequantize, row_scales

    calls: list = []
    vendor.setitem(sys.modules, "flash_attn_interface", _fake_fa3(calls))
    case = make_case(seed=61, hkv=2, ratio=2, block_size=4, tokens=4, prefixes=[15, 9], new_counts=[2, 4],
                     modes=["full", "full"], right_aligned=True, dtype=torch.bfloat16, gaps=[(3, 10), (0, 2)])
    pool, scales, _ = fp8_case(case, torch.float8_e4m3fn, low=0.01, high=0.03)
    ref_pool = pool.clone()
    out = write_attend(*case.args(pool), case.scale, "flash_attn", visibility="full", kv_scales=scales,
                       kv_gap=case.kv_gap)
    assert len(calls) == 2 and all(c["k_cache"].data_ptr() == pool[0].data_ptr() for c in calls)
    assert all(torch.equal(c["k_descale"], row_scales(scales, case.block_table)[0]) for c in calls)
    q8, q_descale = quantize_query(case.query.contiguous(), 2, torch.float8_e4m3fn)
    q_seen = dequantize(q8, q_descale.repeat_interleave(2, 1)[:, None, :, None], torch.float32)
    want = write_attend(q_seen, case.key.float(), case.value.float(), ref_pool, *case.args()[4:],
                        case.scale, "reference", kv_scales=scales, kv_gap=case.kv_gap)
    assert torch.equal(_bits(pool), _bits(ref_pool))
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=0)


def test_vendors_without_fp8_kv_are_refused_up_front(vendor):
    import sys

    from paged_kv_compile.errors import KernelUnavailableError

    import importlib
    fake_adapters = importlib.import_module("test_op_adapters")
    case, pool, scales = _bf16_fp8_case()
    before = pool.clone()
    vendor.setitem(sys.modules, "flash_attn", fake_adapters._fake_kvcache_module("flash_attn", "block_table", []))
    vendor.setitem(sys.modules, "vllm.vllm_flash_attn", fake_adapters._fake_vllm_module([], fa3=False))
    with pytest.raises(KernelUnavailableError, match=r"FP8 pool needs flash-attn 3.*flash-attn 2 has no FP8 KV"):
        write_attend(*case.args(pool), case.scale, "flash_attn", visibility="full", kv_scales=scales)
    case5, pool5, scales5 = _bf16_fp8_case(torch.float8_e5m2)
    vendor.setitem(sys.modules, "flash_attn_interface", _fake_fa3([]))
    with pytest.raises(KernelUnavailableError, match=r"float8_e4m3fn caches only"):
        write_attend(*case5.args(pool5), case5.scale, "flash_attn", visibility="full", kv_scales=scales5)
    vendor.setitem(sys.modules, "torch_npu", fake_adapters._fake_torch_npu([]))
    with pytest.raises(KernelUnavailableError, match=r"npu_fused_infer_attention_score has no torch.float8_e4m3fn"):
        write_attend(*case.args(pool), case.scale, "npu", kv_scales=scales)
    assert torch.equal(_bits(pool), _bits(before))


def test_compiled_fp8_op_updates_the_pool_in_place():
    """Under Inductor the FP8 pool is still the op's only mutated argument: no pool-sized copy appears."""
    from torch._inductor.utils import run_and_get_code

    from _codecheck import pool_sized_allocations

    eager_case, case = (make_case(**GEOMETRIES["gqa2, padded row, unaligned prefix"]) for _ in range(2))
    eager_pool, scales, _ = fp8_case(eager_case, torch.float8_e4m3fn)
    pool = eager_pool.clone()

    def step(q, k, v, pool, slot, table, seq, end, kv_scales):
        return write_attend(q, k, v, pool, slot, table, seq, end, 0.5, "reference", kv_scales=kv_scales) * 2 + 1

    want = step(*eager_case.args(eager_pool), scales)
    torch._dynamo.reset()
    with torch.no_grad():
        got, codes = run_and_get_code(torch.compile(step, backend="inductor", fullgraph=True), *case.args(pool), scales)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(_bits(pool), _bits(eager_pool)), "the caller's FP8 pool itself holds the new K/V"
    code = "\n".join(codes)
    assert "torch.ops.paged_kv.write_attend.default(" in code
    assert pool_sized_allocations(code, tuple(pool.shape)) == []
