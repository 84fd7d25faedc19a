"""Kernel selection and the vendor adapters, driven through fake flash_attn / torch_npu modules.

Each fake computes attention in torch from exactly the arguments it receives, so a wrong layout,
length or table in the adapter shows up as a wrong result. Nothing vendor-specific is installed.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import paged_kv_compile  # noqa: F401  (registers torch.ops.paged_kv)
from paged_kv_compile.errors import KernelUnavailableError, OpInputError
from paged_kv_compile.ops import flash_attn as fa
from paged_kv_compile.ops import npu
from paged_kv_compile.ops import check_values, reference, resolve_kernel

from _opcases import dense_oracle, expected_pool, make_case

FLASH_MODULES = ("flash_attn_interface", "flash_attn", "flash_attn.cute", "vllm.vllm_flash_attn")


@pytest.fixture
def no_vendor_modules(monkeypatch):
    """Every vendor import fails, whatever is installed; fakes are added per test."""
    for name in FLASH_MODULES + ("torch_npu",):
        monkeypatch.setitem(sys.modules, name, None)
    fa.load_module.cache_clear()
    npu.load_module.cache_clear()
    yield monkeypatch
    fa.load_module.cache_clear()
    npu.load_module.cache_clear()


def _paged_attention(q, k_cache, v_cache, table, seq_lens, scale, allowed_fn, empty_value, with_lse=False):
    """Reference math on paged caches ``[N, B, Hkv, D]``; allowed_fn(r, L) gives the [T, L] mask.

    with_lse: also the natural-log LSE ``[R, T, Hq]`` float32, +inf where a query sees nothing (what flash-attn
    2/3 return for an empty row), so a merge that trusts an empty part's LSE goes wrong."""
    R, T, Hq, _ = q.shape
    B, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    lse = torch.empty(R, T, Hq, dtype=torch.float32)
    for r in range(R):
        L = int(seq_lens[r])
        p = torch.arange(L)
        blocks = table[r].long()[p // B]
        k = k_cache[blocks, p % B].float().repeat_interleave(Hq // Hkv, 1)
        v = v_cache[blocks, p % B].float().repeat_interleave(Hq // Hkv, 1)
        allowed = allowed_fn(r, L)
        s = torch.einsum("thd,lhd->htl", q[r].float(), k) * scale
        s = s.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(s, -1)
        o = torch.einsum("htl,lhd->thd", probs, v)
        seen = allowed.any(-1)
        out[r] = torch.where(seen[:, None, None], o, torch.tensor(empty_value))
        lse[r] = torch.where(seen[:, None], torch.logsumexp(s, -1).transpose(0, 1), float("inf"))
    return (out.to(q.dtype), lse) if with_lse else out.to(q.dtype)


def _fa_mask(T, causal):
    """flash-attn's masks: all keys, or bottom-right causal (query t sees keys j <= t + L - T)."""
    if causal:
        return lambda r, L: torch.arange(L) <= torch.arange(T)[:, None] + L - T
    return lambda r, L: torch.ones(T, L, dtype=torch.bool)


def _check_flash_inputs(page_multiple, k_cache, table, seq_lens):
    """The checks flash-attn's flash_api.cpp makes: a paged cache's page size (FA2 % 256, vLLM's build % 16,
    FA3 any), a unit last stride of the block table, contiguous lengths."""
    assert k_cache.shape[1] % page_multiple == 0, f"paged KV needs page_block_size % {page_multiple} == 0"
    assert table.stride(-1) == 1, "block_table must have contiguous last dimension"
    assert seq_lens.is_contiguous(), "seqlens_k must be contiguous"
    assert bool((seq_lens >= 0).all()) and bool((seq_lens <= table.shape[1] * k_cache.shape[1]).all()), \
        "a length beyond the table's pages reads past it"


def _fake_kvcache_module(name, table_kw, calls):
    page_multiple = 256 if name == "flash_attn" else 1

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, softmax_scale=None,
                                causal=False, return_softmax_lse=False, **kw):
        table = kw.pop(table_kw)
        assert not kw and k is None and v is None, "the adapter writes K/V itself and passes nothing else"
        assert table.dtype == cache_seqlens.dtype == torch.int32 and q.is_contiguous()
        _check_flash_inputs(page_multiple, k_cache, table, cache_seqlens)
        calls.append(dict(k_cache=k_cache, v_cache=v_cache, causal=causal, build=name, table=table,
                          lengths=cache_seqlens))
        mask = _fa_mask(q.shape[1], causal)
        result = _paged_attention(q, k_cache, v_cache, table, cache_seqlens, softmax_scale, mask, 0.0,
                                  return_softmax_lse)
        return (result[0], result[1].transpose(1, 2).contiguous()) if return_softmax_lse else result  # lse (R, Hq, T)

    module = types.ModuleType(name)
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


def _fake_vllm_module(calls, fa3: bool = False):
    """vLLM's wrapper: fa_version defaults to 2 (DEFAULT_FA_VERSION), FA3 only where the build has it."""

    def is_fa_version_supported(fa_version: int) -> bool:
        return fa_version == 2 or (fa3 and fa_version == 3)

    def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=None, block_table=None,
                               softmax_scale=None, causal=False, fa_version=2, return_softmax_lse=False, **kw):
        assert not kw and q.dim() == 3 and block_table.dtype == seqused_k.dtype == torch.int32
        assert is_fa_version_supported(fa_version), f"FA{fa_version} is unavailable in this build"
        _check_flash_inputs(16, k, block_table, seqused_k)
        T = max_seqlen_q
        R = cu_seqlens_q.numel() - 1
        assert torch.equal(cu_seqlens_q, torch.arange(0, (R + 1) * T, T, dtype=torch.int32))
        assert max_seqlen_k == block_table.shape[1] * k.shape[1]
        calls.append(dict(k_cache=k, v_cache=v, causal=causal, build=f"vllm fa{fa_version}", table=block_table,
                          lengths=seqused_k))
        q4 = q.view(R, T, *q.shape[1:])
        out, lse = _paged_attention(q4, k, v, block_table, seqused_k, softmax_scale, _fa_mask(T, causal), 0.0, True)
        out = out.view(R * T, *q.shape[1:])
        return (out, lse.permute(2, 0, 1).reshape(q.shape[1], R * T)) if return_softmax_lse else out  # (Hq, R*T)

    module = types.ModuleType("vllm.vllm_flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.is_fa_version_supported = is_fa_version_supported
    return module


def _fake_fa4_module(calls):
    """flash-attn 4's `flash_attn.cute.flash_attn_varlen_func` with a page table, as flash_attn/cute/interface.py
    (4.0.0b36) checks it: batched q, pages (num_pages, page_size, Hkv, D), int32 page_table with a unit last
    stride and int32 seqused_k, no cu_seqlens_k; returns (out, lse)."""

    def flash_attn_varlen_func(q, k, v, seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                               return_lse=False, **kw):
        assert not kw, f"unexpected keywords {sorted(kw)}"
        assert q.dim() == 4 and k.dim() == 4 and k.shape == v.shape
        assert page_table.dtype == seqused_k.dtype == torch.int32 and page_table.shape[0] == q.shape[0]
        _check_flash_inputs(1, k, page_table, seqused_k)
        calls.append(dict(k_cache=k, v_cache=v, causal=causal, build="flash_attn.cute", table=page_table,
                          lengths=seqused_k))
        out, lse = _paged_attention(q, k, v, page_table, seqused_k, softmax_scale, _fa_mask(q.shape[1], causal), 0.0,
                                    True)
        return out, (lse.transpose(1, 2).contiguous() if return_lse else None)  # lse (R, Hq, T) only when asked

    module = types.ModuleType("flash_attn.cute")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


def _fake_flash(flavor: str, calls: list) -> tuple[str, types.ModuleType]:
    if flavor == "fa4":
        return "flash_attn.cute", _fake_fa4_module(calls)
    if flavor in ("vllm", "vllm-fa3"):
        return "vllm.vllm_flash_attn", _fake_vllm_module(calls, fa3=flavor == "vllm-fa3")
    name, kw = {"fa2": ("flash_attn", "block_table"), "fa3": ("flash_attn_interface", "page_table")}[flavor]
    return name, _fake_kvcache_module(name, kw, calls)


def _case(visibility: str, block_size: int, dtype=torch.bfloat16, meta_layout="contiguous"):
    modes = {"full": ["full", "padded", "full"], "causal": ["causal", "causal", "padded"]}[visibility]
    return make_case(seed=31, hkv=2, ratio=2, block_size=block_size, tokens=4, prefixes=[5, 3, 2], new_counts=[2, 4, 0],
                     modes=modes, right_aligned=True, layout="transposed", dtype=dtype, meta_layout=meta_layout)


BUILD_RAN = {"fa2": "flash_attn", "fa3": "flash_attn_interface", "fa4": "flash_attn.cute", "vllm": "vllm fa2",
             "vllm-fa3": "vllm fa3"}


@pytest.mark.parametrize("visibility", ["full", "causal"])
@pytest.mark.parametrize("flavor, block_size", [("fa2", 256), ("fa3", 4), ("fa3", 3), ("fa4", 3), ("fa4", 16),
                                                ("vllm", 16), ("vllm-fa3", 32)])
@pytest.mark.parametrize("meta_layout", ["contiguous", "strided"])
def test_flash_attn_adapter_passes_the_pool_table_and_lengths(no_vendor_modules, flavor, block_size, visibility,
                                                              meta_layout):
    calls: list = []
    name, module = _fake_flash(flavor, calls)
    no_vendor_modules.setitem(sys.modules, name, module)
    no_vendor_modules.setattr(fa, "DEVICE_TYPES", ("cuda", "cpu"))
    case = _case(visibility, block_size, meta_layout=meta_layout)
    before = case.pool.clone()
    out = torch.ops.paged_kv.write_attend(*case.args(), case.scale, "flash_attn", visibility=visibility)
    assert len(calls) == 1 and calls[0]["causal"] == (visibility == "causal")
    assert calls[0]["build"] == BUILD_RAN[flavor], "FA3 wherever the build has it (vLLM defaults to FA2)"
    assert calls[0]["k_cache"].data_ptr() == case.pool[0].data_ptr(), "k_cache is the pool's K half, not a copy"
    assert calls[0]["v_cache"].data_ptr() == case.pool[1].data_ptr()
    assert torch.equal(case.pool, expected_pool(case, before)), "new K/V written at their slots first"
    torch.testing.assert_close(out.float(), dense_oracle(case), atol=1e-2, rtol=0)
    empty = case.kv_visible_end <= 0
    assert bool((out[empty] == 0).all()), "padded queries are zeroed even where flash-attn's mask sees keys"


@pytest.mark.parametrize("flavor, block_size, rule", [
    ("fa2", 16, r"block_size=16 \(flash-attn 2's paged mode needs block_size % 256 == 0\)"),
    ("vllm", 8, r"block_size=8 \(vLLM's vllm_flash_attn needs block_size % 16 == 0\)"),
    ("vllm-fa3", 3, r"block_size=3 \(vLLM's vllm_flash_attn needs block_size % 16 == 0\)"),
])
def test_flash_attn_page_size_rules(no_vendor_modules, flavor, block_size, rule):
    """Each build's paged page-size rule is refused up front (unavailable_reason), never sent to the kernel."""
    name, module = _fake_flash(flavor, [])
    no_vendor_modules.setitem(sys.modules, name, module)
    no_vendor_modules.setattr(fa, "DEVICE_TYPES", ("cuda", "cpu"))
    case = _case("full", block_size=block_size)
    before = case.pool.clone()
    with pytest.raises(KernelUnavailableError, match=rule + ".*kernel='triton'"):
        torch.ops.paged_kv.write_attend(*case.args(), case.scale, "flash_attn", visibility="full")
    assert torch.equal(case.pool, before)


def test_flash_attn_prefers_a_build_whose_rule_the_block_size_meets(no_vendor_modules):
    """Several builds importable: FA3 first; a block size FA2 cannot take falls through to vLLM's build."""
    calls: list = []
    for flavor in ("fa2", "vllm-fa3"):
        name, module = _fake_flash(flavor, calls)
        no_vendor_modules.setitem(sys.modules, name, module)
    no_vendor_modules.setattr(fa, "DEVICE_TYPES", ("cuda", "cpu"))
    assert fa.describe(16) == "vllm.vllm_flash_attn fa_version=3"
    assert fa.describe(256) == "flash_attn (flash-attn 2)"
    case = _case("full", block_size=16)
    torch.ops.paged_kv.write_attend(*case.args(), case.scale, "flash_attn", visibility="full")
    assert [c["build"] for c in calls] == ["vllm fa3"]


def test_flash_attn_4_runs_on_hopper_and_blackwell_only_and_a_bare_flash_attn_namespace_is_not_flash_attn_2(
        no_vendor_modules):
    """FA4 asserts on SM 8.0 and 12.x for paged KV: another device is refused with the reason. FA4's wheel installs
    `flash_attn/cute` alone, so `import flash_attn` can succeed without flash-attn 2 in it: never taken for it."""
    calls: list = []
    no_vendor_modules.setitem(sys.modules, "flash_attn.cute", _fake_fa4_module(calls))
    no_vendor_modules.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # the namespace package
    assert fa.describe(256) == "flash_attn.cute (flash-attn 4)"
    assert fa.select(16, capability=9)[0].module == "flash_attn.cute"
    assert fa.select(16, capability=10)[0].module == "flash_attn.cute"
    for major in (8, 12):
        why = fa.select(16, capability=major)
        assert isinstance(why, str) and f"compute capability {major}.x" in why and "SM 9.x-11.x" in why, why
    no_vendor_modules.setitem(sys.modules, "flash_attn.cute", None)
    fa.load_module.cache_clear()
    assert "none is importable" in fa.select(256)


def test_flash_attn_refuses_layouts_it_cannot_express(no_vendor_modules):
    fa3 = _fake_kvcache_module("flash_attn_interface", "page_table", [])
    no_vendor_modules.setitem(sys.modules, "flash_attn_interface", fa3)
    no_vendor_modules.setattr(fa, "DEVICE_TYPES", ("cuda", "cpu"))
    case = _case("full", block_size=4)
    with pytest.raises(KernelUnavailableError, match=r"not expressible with flash-attn.*kernel='triton'"):
        torch.ops.paged_kv.write_attend(*case.args(), case.scale, "flash_attn")  # visibility="general"
    with pytest.raises(KernelUnavailableError, match=r"float16/bfloat16, got torch.float32"):
        fp32 = _case("full", block_size=4, dtype=torch.float32)
        torch.ops.paged_kv.write_attend(*fp32.args(), fp32.scale, "flash_attn", visibility="full")


def test_flash_attn_missing_package_or_device_is_named(no_vendor_modules):
    case = _case("full", block_size=4)
    with pytest.raises(KernelUnavailableError, match=r"flash_attn.*runs on CUDA tensors, got cpu"):
        torch.ops.paged_kv.write_attend(*case.args(), case.scale, "flash_attn", visibility="full")
    no_vendor_modules.setattr(fa, "DEVICE_TYPES", ("cuda", "cpu"))
    with pytest.raises(KernelUnavailableError, match=r"needs flash_attn .*none is importable"):
        torch.ops.paged_kv.write_attend(*case.args(), case.scale, "flash_attn", visibility="full")


def _fake_torch_npu(calls, scale_kw: str = "scale"):
    """torch_npu 7.0 (``scale``) or 6.0.x (``scale_value``): a wrong keyword is a TypeError, as in the real op."""

    def npu_fused_infer_attention_score(query, key, value, *, atten_mask=None, block_table=None,
                                        actual_seq_lengths_kv=None, num_heads=1, input_layout="BSH",
                                        num_key_value_heads=0, block_size=0, **kw):
        scale = kw.pop(scale_kw)
        assert not kw, f"unexpected keywords {sorted(kw)}"
        assert input_layout == "BSND" and query.is_contiguous()
        assert isinstance(actual_seq_lengths_kv, list) and all(type(n) is int for n in actual_seq_lengths_kv)
        R, T, Hq, D = query.shape
        assert Hq == num_heads and key.dim() == 3 and key.shape[1] == block_size
        assert key.shape[2] == num_key_value_heads * D and block_table.dtype == torch.int32
        assert block_table.is_contiguous(), "block_table: non-contiguous tensors are not supported"
        assert npu.page_size_rule(block_size, T, D) is None, "the adapter sent a block size the op refuses"
        calls.append(dict(mask=atten_mask, lengths=actual_seq_lengths_kv))
        k = key.view(key.shape[0], block_size, num_key_value_heads, D)
        v = value.view(k.shape)
        if atten_mask is None:
            allowed = lambda r, L: torch.ones(T, L, dtype=torch.bool)  # noqa: E731
        else:
            allowed = lambda r, L: ~atten_mask[r, 0, :, :L]  # noqa: E731  (True = masked out)
        # NaN for fully masked rows: the adapter must zero padded queries without multiplying.
        out = _paged_attention(query, k, v, block_table, actual_seq_lengths_kv, scale, allowed, float("nan"))
        return out, torch.zeros(())

    if scale_kw == "scale_value":  # 6.0.x's keyword, in the signature a caller can inspect
        def fused(query, key, value, *, scale_value=1.0, **kw):
            return npu_fused_infer_attention_score(query, key, value, scale_value=scale_value, **kw)
    else:
        def fused(query, key, value, *, scale=1.0, **kw):
            return npu_fused_infer_attention_score(query, key, value, scale=scale, **kw)

    module = types.ModuleType("torch_npu")
    module.npu_fused_infer_attention_score = fused
    return module


@pytest.mark.parametrize("scale_kw", ["scale", "scale_value"], ids=["torch_npu-7.0", "torch_npu-6.0"])
@pytest.mark.parametrize("visibility, meta_layout", [("general", "contiguous"), ("full", "contiguous"),
                                                     ("general", "strided")])
def test_npu_adapter_passes_bsnd_caches_host_lengths_and_mask(no_vendor_modules, visibility, meta_layout, scale_kw):
    calls: list = []
    no_vendor_modules.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls, scale_kw))
    no_vendor_modules.setattr(npu, "DEVICE_TYPES", ("npu", "cpu"))
    if visibility == "general":
        case = make_case(seed=41, hkv=1, ratio=4, head_dim=64, block_size=16, tokens=3, prefixes=[20, 0],
                         new_counts=[3, 0], modes=["random", "padded"], layout="sliced", dtype=torch.float16,
                         meta_layout=meta_layout)
    else:
        case = _case("full", block_size=128, dtype=torch.float16)
    before = case.pool.clone()
    out = torch.ops.paged_kv.write_attend(*case.args(), case.scale, "npu", visibility=visibility)
    assert calls[0]["lengths"] == case.seq_lens.tolist()
    assert (calls[0]["mask"] is None) == (visibility == "full")
    assert torch.equal(case.pool, expected_pool(case, before))
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), dense_oracle(case), atol=2e-3, rtol=0)


@pytest.mark.parametrize("block_size, head_dim, tokens, ok", [
    (16, 128, 4, True), (16, 8, 1, True), (128, 8, 4, True), (512, 64, 2, True),
    (8, 128, 1, False), (1024, 128, 1, False), (16, 8, 4, False), (3, 64, 1, False),
])
def test_npu_page_size_rule(no_vendor_modules, block_size, head_dim, tokens, ok):
    """Ascend's documented block_size rule is refused up front with the reason, never sent to the op."""
    no_vendor_modules.setitem(sys.modules, "torch_npu", _fake_torch_npu([]))
    no_vendor_modules.setattr(npu, "DEVICE_TYPES", ("npu", "cpu"))
    query = torch.empty(1, tokens, 2, head_dim, dtype=torch.float16)
    pool = torch.empty(2, 3, block_size, 1, head_dim, dtype=torch.float16)
    reason = npu.unavailable_reason(query, pool, "full")
    assert (reason is None) == ok, reason
    if not ok:
        assert f"got {block_size}" in reason and "kernel='reference'" in reason


def test_npu_missing_package_is_named(no_vendor_modules):
    no_vendor_modules.setattr(npu, "DEVICE_TYPES", ("npu", "cpu"))
    case = _case("full", block_size=4, dtype=torch.float16)
    with pytest.raises(KernelUnavailableError, match=r"needs torch_npu"):
        torch.ops.paged_kv.write_attend(*case.args(), case.scale, "npu")


def test_kernel_selection(monkeypatch):
    case = _case("full", block_size=4, dtype=torch.float32)
    with pytest.raises(OpInputError, match=r"unknown kernel 'cudnn'; choose one of auto, reference"):
        torch.ops.paged_kv.write_attend(*case.args(), case.scale, "cudnn")
    assert resolve_kernel("auto", case.query, case.pool) == "reference"
    ref_case = _case("full", block_size=4, dtype=torch.float32)
    auto = torch.ops.paged_kv.write_attend(*case.args(), case.scale)  # kernel="auto"
    assert torch.equal(auto, torch.ops.paged_kv.write_attend(*ref_case.args(), ref_case.scale, "reference"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelUnavailableError, match=r"TRITON_INTERPRET=1"):
        resolve_kernel("triton", case.query, case.pool)


def test_importing_the_package_imports_no_kernel_package():
    code = (
        "import sys, paged_kv_compile, torch; assert hasattr(torch.ops.paged_kv, 'write_attend'); "
        "print(sorted(m for m in ('triton', 'flash_attn', 'flash_attn_interface', 'torch_npu', 'vllm') "
        "if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def _sink_window_case(block_size: int, frame: int, visibility: str, dtype=torch.bfloat16, tokens: int = 4):
    """Row 0: a one-frame sink, then a two-frame window that slid so it starts inside a block (gap from the sink's
    end to the window's start); row 1: a window starting inside its first block (gap (0, o)); row 2: no gap,
    or padded. Queries are the chunk's last `tokens` positions; causal rows see up to their own position."""
    B = block_size
    offset = (3 * frame) % B or 1
    sink_blocks = -(-frame // B)
    seq0 = sink_blocks * B + offset + 2 * frame
    seq1 = offset + 2 * frame
    mode = {"full": "full", "causal": "causal"}[visibility]
    return make_case(seed=B + frame, hkv=2, ratio=2, head_dim=8, block_size=B, tokens=tokens,
                     prefixes=[seq0 - tokens, seq1 - tokens, frame],
                     new_counts=[tokens, tokens - 1, 0 if visibility == "causal" else tokens],
                     modes=[mode, mode, "padded" if visibility == "causal" else mode], right_aligned=True,
                     extra_width=1, dtype=dtype, gaps=[(frame, sink_blocks * B + offset), (0, offset), (0, 0)])


@pytest.mark.parametrize("visibility", ["full", "causal"])
@pytest.mark.parametrize("flavor, block_size, frame", [
    ("fa2", 256, 880), ("fa3", 4, 10), ("fa3", 3, 7), ("fa4", 128, 880), ("fa4", 3, 10), ("vllm", 16, 30),
    ("vllm-fa3", 32, 30),
])
def test_flash_attn_irregular_gap_splits_the_call_and_merges_by_lse(no_vendor_modules, flavor, block_size, frame,
                                                                     visibility):
    """A row whose visible keys start and end inside blocks, on each build: two flash-attn calls (the span before
    the gap on the row's own table, the span after it on the table shifted past the gap's block), the gap's last
    block in torch, merged by LSE; FA2's page rule met at DreamZero's 880-token frames with pages of 256."""
    calls: list = []
    name, module = _fake_flash(flavor, calls)
    no_vendor_modules.setitem(sys.modules, name, module)
    no_vendor_modules.setattr(fa, "DEVICE_TYPES", ("cuda", "cpu"))
    case = _sink_window_case(block_size, frame, visibility)
    before = case.pool.clone()
    out = torch.ops.paged_kv.write_attend(*case.args(), case.scale, "flash_attn", visibility=visibility,
                                          kv_gap=case.kv_gap)
    assert torch.equal(case.pool, expected_pool(case, before))
    torch.testing.assert_close(out.float(), dense_oracle(case), atol=1e-2, rtol=0)
    assert [c["causal"] for c in calls] == [False, visibility == "causal"], "before the gap: whole; after: as hinted"
    assert all(c["build"] == BUILD_RAN[flavor] for c in calls)
    assert all(c["k_cache"].data_ptr() == case.pool[0].data_ptr() for c in calls), "both read the pool in place"
    gap, seq, B = case.kv_gap.long(), case.seq_lens.long(), block_size
    assert torch.equal(calls[0]["lengths"].long(), gap[:, 0])
    shift = -(-gap[:, 1] // B)
    assert torch.equal(calls[1]["lengths"].long(), (seq - shift * B).clamp(min=0))
    for r in range(case.block_table.shape[0]):
        kept = case.block_table.shape[1] - int(shift[r])
        assert torch.equal(calls[1]["table"][r, :kept], case.block_table[r, int(shift[r]):]), "the shifted table"
    empty = reference.visible_counts(case.seq_lens, case.kv_visible_end, case.kv_gap) <= 0
    assert bool((out[empty] == 0).all())


@pytest.mark.parametrize("visibility", ["full", "causal"])
@pytest.mark.parametrize("flavor, block_size, frame", [("fa2", 256, 880), ("fa3", 4, 10), ("fa3", 8, 13)])
def test_flash_attn_irregular_merge_is_exact_in_float32(no_vendor_modules, flavor, block_size, frame, visibility):
    """The split and the LSE merge themselves, in float32 against the dense oracle at 1e-5 (the adapter's attend
    called directly: the op refuses float32 for flash-attn, whose real kernels compute in 16 bits)."""
    name, module = _fake_flash(flavor, [])
    no_vendor_modules.setitem(sys.modules, name, module)
    case = _sink_window_case(block_size, frame, visibility, dtype=torch.float32)
    fa.write_kv(case.pool, case.key, case.value, case.slot_mapping)
    out = fa.attend(case.query, case.pool, case.block_table, case.seq_lens, case.kv_visible_end, case.scale,
                    visibility, kv_gap=case.kv_gap)
    torch.testing.assert_close(out, dense_oracle(case), atol=1e-5, rtol=0)


@pytest.mark.parametrize("scale_kw", ["scale"])
def test_npu_adapter_irregular_gap_goes_into_the_mask(no_vendor_modules, scale_kw):
    """The NPU kernel takes an attention mask over the whole table: a gap becomes masked keys in one call, also
    under visibility='full' (which otherwise sends no mask)."""
    calls: list = []
    no_vendor_modules.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls, scale_kw))
    no_vendor_modules.setattr(npu, "DEVICE_TYPES", ("npu", "cpu"))
    case = _sink_window_case(128, 200, "full", dtype=torch.float16)
    before = case.pool.clone()
    out = torch.ops.paged_kv.write_attend(*case.args(), case.scale, "npu", visibility="full", kv_gap=case.kv_gap)
    assert len(calls) == 1 and calls[0]["mask"] is not None
    assert torch.equal(case.pool, expected_pool(case, before))
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), dense_oracle(case), atol=2e-3, rtol=0)


@st.composite
def _gap_geometries(draw) -> dict:
    """Rows of "full" or "causal" queries (one visibility per case) with any gap a causal hint allows: its start
    at most the first new token's end (the row's history + 1), its end anywhere up to the row's length."""
    visibility = draw(st.sampled_from(["full", "causal"]))
    rows = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 4))
    prefixes = draw(st.lists(st.integers(0, 20), min_size=rows, max_size=rows))
    counts = draw(st.lists(st.integers(1, tokens), min_size=rows, max_size=rows))
    gaps = []
    for prefix, count in zip(prefixes, counts):
        start = draw(st.integers(0, prefix + 1 if visibility == "causal" else prefix + count))
        gaps.append((start, draw(st.integers(start, prefix + count))))
    return dict(seed=draw(st.integers(0, 2**16)), hkv=draw(st.integers(1, 2)), ratio=draw(st.sampled_from([1, 2])),
                head_dim=4, block_size=draw(st.sampled_from([1, 3, 4, 8])), tokens=tokens, prefixes=prefixes,
                new_counts=counts, modes=[visibility] * rows, right_aligned=True, extra_width=draw(st.integers(0, 2)),
                dtype=torch.float32, gaps=gaps), visibility


@pytest.mark.parametrize("flavor", ["fa3", "fa4"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=_gap_geometries())
def test_flash_attn_irregular_split_property(no_vendor_modules, flavor, drawn):
    """Any gap (at a row's start or end, ending on or inside a block, empty, the whole row) through the split and
    the LSE merge, float32 against the dense oracle at 1e-5."""
    geometry, visibility = drawn
    name, module = _fake_flash(flavor, [])
    no_vendor_modules.setitem(sys.modules, name, module)
    fa.load_module.cache_clear()
    case = make_case(**geometry)
    check_values(case.query, case.pool, case.slot_mapping, case.block_table, case.seq_lens, case.kv_visible_end,
                 visibility, case.kv_gap)  # the drawn case keeps the hint's promises
    fa.write_kv(case.pool, case.key, case.value, case.slot_mapping)
    out = fa.attend(case.query, case.pool, case.block_table, case.seq_lens, case.kv_visible_end, case.scale,
                    visibility, kv_gap=case.kv_gap)
    torch.testing.assert_close(out, dense_oracle(case), atol=1e-5, rtol=0)


def test_flash_attn_4_irregular_is_our_custom_op_compiled_in_one_frame(no_vendor_modules):
    """FA4 ships no torch.library op: ours (`paged_kv::flash_attn4_paged`) passes opcheck against the fake build
    and sits in a fullgraph compile as one node, with the eager result (the fake build is never traced)."""
    calls: list = []
    no_vendor_modules.setitem(sys.modules, "flash_attn.cute", _fake_fa4_module(calls))
    case = _case("causal", block_size=3)
    table, lengths = case.block_table.contiguous(), case.seq_lens.contiguous()
    args = (case.query.contiguous(), case.pool[0], case.pool[1], table, lengths, case.scale, True)
    op = torch.ops.paged_kv.flash_attn4_paged
    torch.library.opcheck(op.default, args)
    out, lse = op(*args)
    assert lse.shape == (3, 4, 4) and lse.dtype == torch.float32
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: op(*a)[0] * 2, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(*args), out * 2, atol=0, rtol=0)
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert op.default in targets or op in targets, targets
