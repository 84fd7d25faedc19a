"""The attention kernels behind the paged ops: a small protocol and a registry.

A kernel is a module with ``write_kv(kv_pool, key, value, slot_mapping, row_scales=None)`` and
``attend(query, kv_pool, block_table, seq_lens, kv_visible_end, scale, visibility, row_scales=None, kv_gap=None)``
(`ops/reference.py` is the oracle; ``row_scales`` ``[2, R, Hkv]`` comes with FP8 pools, ops/fp8.py; ``kv_gap``
``[R, 2]`` with rows whose visible keys skip a span, ops/write_attend.py). Its
registry entry says when it cannot run (missing package, device, page size) without importing it, how to
load it, and on which devices `kernel="auto"` prefers it. The dispatcher (`ops/write_attend.py`) only
looks kernels up here.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from . import flash_attn, npu


class KernelModule(Protocol):
    def write_kv(self, kv_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor, row_scales: torch.Tensor | None = None) -> None: ...

    def attend(self, query: torch.Tensor, kv_pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               kv_visible_end: torch.Tensor, scale: float, visibility: str,
               row_scales: torch.Tensor | None = None, kv_gap: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Kernel:
    """One registered kernel."""

    name: str
    #: (query, kv_pool, visibility) -> why it cannot run these inputs here, or None. Imports nothing heavy.
    unavailable_reason: Callable[[torch.Tensor, torch.Tensor, str], str | None]
    load: Callable[[], KernelModule]  # imports the kernel module (only when it is selected)
    auto_on: tuple[str, ...] = ()  # device types on which kernel="auto" tries it, in registry order


@functools.cache
def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _triton_unavailable_reason(query: torch.Tensor, kv_pool: torch.Tensor, visibility: str) -> str | None:
    device = query.device
    if not installed("triton"):
        return "kernel='triton' needs the triton package, which is not installed: pip install triton"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "kernel='triton' on CPU tensors needs TRITON_INTERPRET=1 set before the first call; "
            "or use kernel='reference'"
        )
    if device.type not in ("cpu", "cuda"):
        return f"kernel='triton' runs on CUDA tensors (or CPU under TRITON_INTERPRET=1), got {device.type}"
    if device.type == "cuda" and kv_pool.dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability(device) < (8, 9):
        return (
            "kernel='triton' with a float8_e4m3fn pool needs a GPU of compute capability >= 8.9 (Ada, Hopper), "
            "where Triton has the e4m3 type: use kv_dtype=torch.float8_e5m2 or kernel='reference'"
        )
    return None


def _load_reference() -> KernelModule:
    from . import reference

    return reference


def _load_triton() -> KernelModule:
    from . import triton_kernel  # imports triton: only when selected

    return triton_kernel


REGISTRY: dict[str, Kernel] = {}


def register(kernel: Kernel) -> Kernel:
    """Add a kernel; `auto` tries kernels in registration order."""
    REGISTRY[kernel.name] = kernel
    return kernel


register(Kernel("reference", lambda q, pool, vis: None, _load_reference))
register(Kernel("flash_attn", flash_attn.unavailable_reason, lambda: flash_attn, auto_on=("cuda",)))
register(Kernel("triton", _triton_unavailable_reason, _load_triton, auto_on=("cuda",)))
register(Kernel("npu", npu.unavailable_reason, lambda: npu, auto_on=("npu",)))


def get(name: str) -> Kernel:
    return REGISTRY[name]


def auto_preference(device_type: str) -> list[Kernel]:
    """The kernels kernel="auto" tries on `device_type`, best first (then the reference)."""
    return [k for k in REGISTRY.values() if device_type in k.auto_on]
