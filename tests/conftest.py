"""Shared test setup. TRITON_INTERPRET must be set before anything imports triton (notes/deps.md)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
