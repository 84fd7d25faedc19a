"""Adapter to flash-attn's paged attention: FA3, FA4 (`flash_attn.cute`), FA2 or vLLM's `vllm.vllm_flash_attn`.

The caches are the pool's halves ``kv_pool[0]``, ``kv_pool[1]`` ``[num_blocks, block_size, Hkv, D]``,
addressed by our int32 block table and ``seq_lens``. New K/V are written first by the shared torch
helper, not by flash-attn's ``k=``/``v=`` append (which appends at ``cache_seqlens``, not at our slots).

flash-attn expresses two visibility layouts: every query sees [0, seq_len) (non-causal) and
bottom-right causal. Checking ``kv_visible_end`` against them needs a host sync, so the caller states
the layout with the op's ``visibility`` hint ("full" or "causal"); "general" is refused here. The hint
is verified on CPU tensors only (see write_attend.check_values). Padded queries are zeroed afterwards.
A row's ``kv_gap`` (visible keys that start and end inside blocks) is served by split calls merged by their
log-sum-exp (`attend`, ops/gap_split.py).

FP8 pools (float8_e4m3fn only): FA3 alone reads FP8 caches, and only with an FP8 query of the same
dtype. The adapter passes the op's own row scales as ``k_descale``/``v_descale`` ``(R, Hkv)`` (the
shape vLLM builds in vllm/v1/attention/backends/flash_attn.py) and quantizes the query with a dynamic
per (row, kv head) scale, passed as ``q_descale``. flash-attn 2 has no FP8 KV (vLLM's FA2 path raises
"FA2 does not support ... q_descale, k_descale, v_descale") and vLLM refuses fp8_e5m2 for flash-attn
(vllm/v1/attention/backends/fa_utils.py, flash_attn_supports_kv_cache_dtype): both are refused.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from . import gap_split
from .flash_attn4 import flash_attn4_paged
from .fp8 import dequantize, is_fp8, quantize
from .reference import zero_padded_queries
from .reference import write_kv  # noqa: F401  the dispatcher writes new K/V with <kernel module>.write_kv

#: Device types whose tensors the vendor kernels take (tests add "cpu" to drive a fake module).
DEVICE_TYPES = ("cuda",)


def _kvcache_call(table_kw: str) -> Callable:
    def call(mod, q, k_cache, v_cache, block_table, seq_lens, scale, causal, return_lse=False, **descales):
        # flash-attn 2 and 3: softmax_lse (R, Hq, T) with return_softmax_lse=True
        result = mod.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seq_lens, softmax_scale=scale, causal=causal, **{table_kw: block_table},
            **({"return_softmax_lse": True} if return_lse else {}), **descales,
        )
        return (result[0], result[1].transpose(1, 2)) if return_lse else result

    return call


def _fa4_call(mod, q, k_cache, v_cache, block_table, seq_lens, scale, causal, return_lse=False, **descales):
    # flash-attn 4 (flash_attn/cute/interface.py): batched queries (R, T, H, D), pages (num_blocks, block_size, Hkv,
    # D), page_table (R, M) int32 with a unit last stride, seqused_k (R,) int32; returns (out, lse), lse (R, Hq, T)
    # with return_lse=True (the keyword vLLM's vendored copy passes on to _flash_attn_fwd). Called through our
    # custom op (ops/flash_attn4.py): FA4 ships none. No FP8 here (`Flavor.reads_fp8`), so no descales.
    assert not descales, "flash-attn 4 is not given FP8 caches (Flavor.reads_fp8)"
    out, lse = flash_attn4_paged(q, k_cache, v_cache, block_table, seq_lens, scale, causal)
    return (out, lse.transpose(1, 2)) if return_lse else out


def vllm_fa_version(mod: ModuleType) -> int:
    """3 where vLLM's build has a usable FA3 (Hopper), else 2 -- the choice vLLM itself makes first in
    ``vllm/v1/attention/backends/fa_utils.py::get_flash_attn_version``. Without ``fa_version``
    ``flash_attn_varlen_func`` runs its default, FA2, even on Hopper."""
    supported = getattr(mod, "is_fa_version_supported", None)
    try:
        return 3 if supported is not None and supported(3) else 2
    except Exception:  # noqa: BLE001 - a probe that fails (no device, old build) means FA3 is not usable
        return 2


def _vllm_call(mod, q, k_cache, v_cache, block_table, seq_lens, scale, causal, return_lse=False, **descales):
    # vLLM's build only exposes the varlen entry point; every row has T queries. softmax_lse is (Hq, R * T).
    R, T, H, D = q.shape
    cu_seqlens_q = torch.arange(0, (R + 1) * T, T, dtype=torch.int32, device=q.device)
    result = mod.flash_attn_varlen_func(
        q.reshape(R * T, H, D), k_cache, v_cache, max_seqlen_q=T, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_k=block_table.shape[1] * k_cache.shape[1], seqused_k=seq_lens, block_table=block_table,
        softmax_scale=scale, causal=causal, fa_version=vllm_fa_version(mod),
        **({"return_softmax_lse": True} if return_lse else {}), **descales,
    )
    if return_lse:
        return result[0].view(R, T, H, D), result[1].view(H, R, T).permute(1, 2, 0)
    return result.view(R, T, H, D)


@dataclass(frozen=True)
class Flavor:
    """One importable flash-attn build and the rule its paged mode puts on block_size."""

    module: str
    page_multiple: int
    call: Callable
    rule: str
    entry: str = "flash_attn_with_kvcache"  # the function `call` uses: without it the module is another build
    capabilities: tuple[int, ...] | None = None  # the compute-capability majors its paged mode runs on (None: any)

    def usable(self, mod: ModuleType | None) -> bool:
        """Imported and this build: FA4 installs `flash_attn/cute` only, so `import flash_attn` may succeed
        without flash-attn 2 in it."""
        return mod is not None and callable(getattr(mod, self.entry, None))

    def reads_fp8(self, mod: ModuleType) -> bool:
        """Whether this build reads FP8 caches with descales: FA3 only (FA4 takes FP8 descales too, but their
        shapes have not been checked against ours: refused until they are)."""
        if self.call is _vllm_call:
            return vllm_fa_version(mod) == 3
        return self.module == "flash_attn_interface"

    def describe(self, mod: ModuleType) -> str:
        """Which build and version runs, for reports (e.g. "vllm.vllm_flash_attn fa_version=3")."""
        if self.call is _vllm_call:
            return f"{self.module} fa_version={vllm_fa_version(mod)}"
        return {"flash_attn_interface": "flash_attn_interface (flash-attn 3)",
                "flash_attn.cute": "flash_attn.cute (flash-attn 4)"}.get(self.module, f"{self.module} (flash-attn 2)")


# Page-size rules of each build's paged mode:
# * flash-attn 3 (hopper/flash_attn_interface.py): any page size -- "in FA3 there's no restriction on
#   page_size", Dao-AILab/flash-attention issue 1627 (maintainer's answer).
# * flash-attn 2 (flash_attn/flash_attn_interface.py, flash_attn_with_kvcache): "page_block_size must be
#   a multiple of 256", checked in csrc/flash_attn/flash_api.cpp.
# * vLLM's build (FA2 and FA3 alike): its FlashAttention backend declares MultipleOf(16) as the supported
#   kernel block sizes (vllm/v1/attention/backends/flash_attn.py::get_supported_kernel_block_sizes).
# * flash-attn 4 (pip flash-attn-4 4.0.0b36, flash_attn/cute/interface.py, read from the wheel): any page size
#   (pages of exactly its key tile, e.g. 128, load by TMA; others by cp.async, "paged_kv_non_tma"); paged KV
#   asserts on SM 8.0 and SM 12.x, so Hopper (9.x) and Blackwell datacenter (10.x, 11.x) only.
FLAVORS = (
    Flavor("flash_attn_interface", 1, _kvcache_call("page_table"), "flash-attn 3 takes any block size"),
    Flavor("flash_attn.cute", 1, _fa4_call, "flash-attn 4 takes any block size on SM 9.x-11.x",
           entry="flash_attn_varlen_func", capabilities=(9, 10, 11)),
    Flavor("flash_attn", 256, _kvcache_call("block_table"), "flash-attn 2's paged mode needs block_size % 256 == 0"),
    Flavor("vllm.vllm_flash_attn", 16, _vllm_call, "vLLM's vllm_flash_attn needs block_size % 16 == 0",
           entry="flash_attn_varlen_func"),
)


@functools.cache
def load_module(name: str) -> ModuleType | None:
    """The imported module or None; cached (tests that fake modules call ``load_module.cache_clear()``)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def select(block_size: int, fp8: bool = False, capability: int | None = None) -> tuple[Flavor, ModuleType] | str:
    """The first importable build whose page-size rule `block_size` meets (and, for an FP8 pool, that
    reads FP8 caches; on a device of compute-capability major `capability`, that runs there), or why there
    is none."""
    loaded = [(f, m) for f in FLAVORS if f.usable(m := load_module(f.module))]
    if not loaded:
        return (
            "kernel='flash_attn' needs flash_attn (flash-attn 2), flash_attn_interface (flash-attn 3), flash_attn.cute "
            "(flash-attn 4) or vllm.vllm_flash_attn; none is importable: pip install flash-attn on a CUDA machine, or "
            "use kernel='triton'"
        )
    if capability is not None:
        here = [(f, m) for f, m in loaded if f.capabilities is None or capability in f.capabilities]
        if not here:
            return (f"no importable flash-attn build runs paged attention on compute capability {capability}.x "
                    f"({'; '.join(f.rule for f, _ in loaded)}): use kernel='triton'")
        loaded = here
    if fp8:
        loaded = [(f, m) for f, m in loaded if f.reads_fp8(m)]
        if not loaded:
            return (
                "an FP8 pool needs flash-attn 3 (flash_attn_interface, or vllm.vllm_flash_attn with FA3 on Hopper): "
                "flash-attn 2 has no FP8 KV cache (no q/k/v_descale); use kernel='triton' or kv_dtype=None"
            )
    for flavor, mod in loaded:
        if block_size % flavor.page_multiple == 0:
            return flavor, mod
    rules = "; ".join(f.rule for f, _ in loaded)
    return (
        f"no importable flash-attn build takes block_size={block_size} ({rules}): choose a block size those "
        "rules allow (16 for vLLM's build, 256 for flash-attn 2), install flash-attn 3 (any block size), "
        "or use kernel='triton'"
    )


def describe(block_size: int) -> str:
    """The build (and FA version) that would serve `block_size`, or why none would."""
    picked = select(block_size)
    return picked if isinstance(picked, str) else picked[0].describe(picked[1])


def unavailable_reason(query: torch.Tensor, kv_pool: torch.Tensor, visibility: str) -> str | None:
    """Why flash-attn cannot serve these inputs, or None. Cheap; imports only on an accepted device."""
    if query.device.type not in DEVICE_TYPES:
        return (
            f"kernel='flash_attn' (flash_attn / vllm.vllm_flash_attn) runs on CUDA tensors, got {query.device.type}; "
            "use kernel='reference' or 'triton'"
        )
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"kernel='flash_attn' computes in float16/bfloat16, got {query.dtype}; use kernel='triton'"
    if visibility == "general":
        return (
            "this kv_visible_end layout is not expressible with flash-attn (it has only non-causal [0, seq_len) "
            "and bottom-right causal): pass visibility='full' or 'causal' if the layout is one of them, "
            "else use kernel='triton'"
        )
    if kv_pool.dtype == torch.float8_e5m2:
        return (
            "flash-attn reads float8_e4m3fn caches only (vLLM refuses fp8_e5m2 for flash-attn too): use "
            "kv_dtype=torch.float8_e4m3fn or kernel='triton'"
        )
    picked = select(kv_pool.shape[2], is_fp8(kv_pool.dtype), _capability(query))
    return picked if isinstance(picked, str) else None


def _capability(tensor: torch.Tensor) -> int | None:
    """The compute-capability major of a CUDA tensor's device (None elsewhere)."""
    return torch.cuda.get_device_capability(tensor.device)[0] if tensor.is_cuda else None


def attend(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_visible_end: torch.Tensor,
    scale: float,
    visibility: str,
    row_scales: torch.Tensor | None = None,
    kv_gap: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend with flash-attn over the pool (the dispatcher wrote the new K/V), zero the padded queries.

    With a ``kv_gap``, flash-attn (which sees one prefix of a table) runs twice, on the span before the gap and
    on the table shifted past it; the rest of the block the gap ends in is attended in torch; the three are
    merged by their log-sum-exp (ops/gap_split.py). The causal hint applies to the span after the gap; the span
    before it is seen whole by every query that sees anything (check_values verifies that promise on CPU values).
    """
    flavor, mod = select(kv_pool.shape[2], row_scales is not None, _capability(query))
    causal = visibility == "causal"
    q, descales, q_seen = query.contiguous(), {}, query
    if row_scales is not None:
        q, q_descale = quantize_query(q, kv_pool.shape[3], kv_pool.dtype)
        descales = dict(q_descale=q_descale, k_descale=row_scales[0], v_descale=row_scales[1])
        # the query flash-attn sees, for the span attended here: every part then scores the same query
        q_seen = dequantize(q, q_descale.repeat_interleave(query.shape[2] // kv_pool.shape[3], 1)[:, None, :, None],
                            torch.float32)
    # flash-attn checks that seqused_k/cache_seqlens are contiguous and block_table has a unit last
    # stride (flash_api.cpp); the op accepts any strides, so copy where needed (a no-op for our buffers).
    table, lengths = block_table.contiguous(), seq_lens.contiguous()
    if kv_gap is None:
        out = flavor.call(mod, q, kv_pool[0], kv_pool[1], table, lengths, scale, causal, **descales)
        return zero_padded_queries(out.to(query.dtype), seq_lens, kv_visible_end)
    split = gap_split.split_around_gap(table, lengths, kv_gap, kv_pool.shape[2])
    ends = gap_split.query_ends(seq_lens, kv_visible_end)
    before = flavor.call(mod, q, kv_pool[0], kv_pool[1], table, split.before_len, scale, False, return_lse=True,
                         **descales)
    after = flavor.call(mod, q, kv_pool[0], kv_pool[1], split.after_table, split.after_len, scale, causal,
                        return_lse=True, **descales)
    out = gap_split.merge_by_lse([
        (*before, gap_split.sees_before(split, ends)),
        gap_split.attend_head(q_seen, kv_pool, split, ends, scale, row_scales),
        (*after, gap_split.sees_after(split, ends)),
    ])
    return zero_padded_queries(out.to(query.dtype), seq_lens, kv_visible_end, kv_gap)


def quantize_query(query: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """FA3 wants q in the caches' FP8 dtype: a dynamic scale per (row, kv head) from the query's own
    absolute maximum (over its tokens and the kv head's query heads), computed on the device.

    Returns the FP8 query ``[R, T, Hq, D]`` and ``q_descale`` ``[R, Hkv]`` float32.
    """
    R, T, Hq, D = query.shape
    group = Hq // num_kv_heads
    amax = query.abs().view(R, T, num_kv_heads, group, D).amax(dim=(1, 3, 4)).to(torch.float32)
    q_scale = torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax))
    per_head = q_scale.repeat_interleave(group, 1)[:, None, :, None]
    return quantize(query, per_head, dtype), q_scale
