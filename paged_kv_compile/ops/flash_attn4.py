"""flash-attn 4's paged attention (`flash_attn.cute.flash_attn_varlen_func` with a page table) as our custom op.

FA4 ships no ``torch.library`` op: called bare inside a compiled region, Dynamo would trace into its Python
(the CuTe DSL's JIT, its caches) and break the graph. ``paged_kv::flash_attn4_paged`` is opaque to the compiler
(a schema and a fake kernel), so it can sit in a ``fullgraph=True`` graph and in a CUDA graph (FA4's kernel is
JIT-compiled at its first call: the warm-up before capture makes it). The ops in ops/write_attend.py call
it through ops/flash_attn.py. Importing this module imports nothing of FA4: the build is loaded at the first call.
"""

from __future__ import annotations

import importlib

import torch


def _module():
    """``flash_attn.cute``, imported at the first call (then from ``sys.modules``, where tests plant fakes)."""
    try:
        return importlib.import_module("flash_attn.cute")
    except ImportError as e:
        raise RuntimeError("paged_kv::flash_attn4_paged needs flash-attn 4 (flash_attn.cute): "
                           "pip install flash-attn-4") from e


@torch.library.custom_op("paged_kv::flash_attn4_paged", mutates_args=())
def flash_attn4_paged(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seqused_k: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [R, T, Hq, D], lse [R, Hq, T] float32)`` of batched queries over pages ``[num_pages, page, Hkv, D]``
    addressed by an int32 ``page_table [R, max_pages]`` (unit last stride) and int32 ``seqused_k [R]``."""
    out, lse = _module().flash_attn_varlen_func(query, k_cache, v_cache, seqused_k=seqused_k, page_table=page_table,
                                                softmax_scale=scale, causal=causal, return_lse=True)
    return out.contiguous(), lse.contiguous()


@flash_attn4_paged.register_fake
def _flash_attn4_paged_fake(query, k_cache, v_cache, page_table, seqused_k, scale, causal):
    R, T, Hq, _ = query.shape
    return query.new_empty(query.shape), query.new_empty((R, Hq, T), dtype=torch.float32)
