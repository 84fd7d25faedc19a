"""Shared test setup. TRITON_INTERPRET must be set before anything imports triton (notes/deps.md)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402  (after TRITON_INTERPRET)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `-n 2` on a 2-core machine: one intra-op thread per worker avoids oversubscription (10-20x slower).
    torch.set_num_threads(1)
