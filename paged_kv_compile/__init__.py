"""paged_kv_compile: paged KV cache for diffusion transformers that stays compiled.

Importing this package is cheap: it registers the `paged_kv` custom ops and the `paged_kv`
torch.compile backend, and imports neither vLLM nor Triton.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .config import Bucket, PagedKVConfig
from .errors import (
    BindingError,
    CapacityError,
    ConfigError,
    KernelUnavailableError,
    OpInputError,
    PagedKVError,
    PassError,
    RequestError,
)
from . import ops as _ops  # registers torch.ops.paged_kv
from .pool import KVPool
from .runtime import PagedKVRuntime

__all__ = [
    "__version__",
    "Bucket",
    "PagedKVConfig",
    "KVPool",
    "PagedKVRuntime",
    "PagedKVError",
    "ConfigError",
    "OpInputError",
    "KernelUnavailableError",
    "CapacityError",
    "RequestError",
    "BindingError",
    "PassError",
]
