"""The op finds its kernels in one registry (`paged_kv_compile/ops/kernels.py`), not in an if-chain."""

from __future__ import annotations

import dataclasses

import torch

import paged_kv_compile  # noqa: F401  (registers torch.ops.paged_kv)
from paged_kv_compile.config import KERNELS
from paged_kv_compile.ops import kernels, resolve_kernel

from _opcases import make_case


def _case():
    return make_case(seed=7, block_size=4, tokens=4, prefixes=[5, 3], new_counts=[2, 4], modes=["full", "full"],
                     dtype=torch.float32)


def test_every_configurable_kernel_is_registered_and_auto_prefers_by_device():
    assert set(kernels.REGISTRY) == set(KERNELS) - {"auto"}
    assert [k.name for k in kernels.auto_preference("cuda")] == ["flash_attn", "triton"]
    assert [k.name for k in kernels.auto_preference("npu")] == ["npu"]
    assert kernels.auto_preference("cpu") == []


def test_the_op_dispatches_through_the_registry(monkeypatch):
    """Replacing the registry entry replaces what the op runs: writes and attention both go through it."""
    calls = []
    reference = kernels.get("reference").load()

    class Counting:
        @staticmethod
        def write_kv(*args):
            calls.append("write_kv")
            return reference.write_kv(*args)

        @staticmethod
        def attend(*args):
            calls.append("attend")
            return reference.attend(*args)

    want_case = _case()
    want = torch.ops.paged_kv.write_attend(*want_case.args(), want_case.scale, "reference")
    monkeypatch.setitem(kernels.REGISTRY, "reference", dataclasses.replace(kernels.get("reference"), load=lambda: Counting))
    case = _case()
    got = torch.ops.paged_kv.write_attend(*case.args(), case.scale, "reference")
    assert calls == ["write_kv", "attend"]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(case.pool, want_case.pool, atol=0, rtol=0)


def test_an_unavailable_entry_is_skipped_by_auto(monkeypatch):
    case = _case()
    blocked = dataclasses.replace(kernels.get("reference"), name="cpu_fast", auto_on=("cpu",),
                                  unavailable_reason=lambda q, pool, vis: "not here")
    monkeypatch.setitem(kernels.REGISTRY, "cpu_fast", blocked)
    assert resolve_kernel("auto", case.query, case.pool) == "reference"
