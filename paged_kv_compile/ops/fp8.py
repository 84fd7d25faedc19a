"""FP8 pool arithmetic shared by the kernels: a row's scales, quantize on write, dequantize on read.

A stored value x means ``x * scale``. Scales are static per (layer, kv head) and kept per block in
``KVPool.scales`` ``[2, N, Hkv]`` (pool.py says why); a row uses the scales of its first table block
for every token it writes and reads (`row_scales`), the shape FA3's ``k_descale``/``v_descale`` take.
Quantization divides in float32 and saturates to the format's largest finite value: a plain cast
would turn an out-of-range value into NaN (e4m3fn) or inf (e5m2). Nothing here reads a value on the host.
"""

from __future__ import annotations

import torch

from ..config import FP8_DTYPES

__all__ = ["FP8_DTYPES", "is_fp8", "row_scales", "quantize", "dequantize"]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def row_scales(kv_scales: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """``[2, R, Hkv]`` float32: K and V scales of each row, those of the row's first table block."""
    return kv_scales.index_select(1, block_table[:, 0].to(torch.int64))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in float32, saturated to ``dtype``'s finite range, cast to ``dtype``; scale broadcasts."""
    fmax = torch.finfo(dtype).max
    return (x.to(torch.float32) / scale).clamp(-fmax, fmax).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` computed in float32, returned as ``dtype``; scale broadcasts."""
    return (q.to(torch.float32) * scale).to(dtype)
