"""Shared test setup. TRITON_INTERPRET must be set before anything imports triton."""

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402  (after TRITON_INTERPRET)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `-n 2` on a 2-core machine: one intra-op thread per worker avoids oversubscription (10-20x slower).
    torch.set_num_threads(1)


# CI sets PAGED_KV_NO_SKIP=1: there a skipped test is a failure unless it needs a device (gpu/npu marker).
# A missing package (vLLM, vllm-omni, triton) must break CI, not quietly skip the tests that need it.
_NO_SKIP = os.environ.get("PAGED_KV_NO_SKIP") == "1"
_DEVICE_MARKERS = ("gpu", "npu")


def pytest_runtest_setup(item):
    """A test marked `vllm` skips where vLLM is not installed (the torch 2.14 lane: vLLM's CPU build pins torch
    2.13), saying how to install it; under PAGED_KV_NO_SKIP=1 that skip fails (below)."""
    if item.get_closest_marker("vllm") and importlib.util.find_spec("vllm") is None:
        from paged_kv_compile.allocator import _VLLM_INSTALL_HINT

        pytest.skip(f"needs vLLM, which is not installed: {_VLLM_INSTALL_HINT}")


def pytest_runtest_makereport(item, call):
    """Under PAGED_KV_NO_SKIP=1, turn a skip of a non-device test into a failure that names the reason."""
    if not _NO_SKIP or call.excinfo is None or not call.excinfo.errisinstance(pytest.skip.Exception):
        return None
    if any(item.get_closest_marker(name) for name in _DEVICE_MARKERS):
        return None
    from _pytest.reports import TestReport

    report = TestReport.from_item_and_call(item, call)
    report.outcome = "failed"
    report.longrepr = (
        f"{item.nodeid} skipped ({call.excinfo.value}) but PAGED_KV_NO_SKIP=1 forbids skips of tests that need "
        "no device: install what it needs (bash .ci/run builds the locked environment)"
    )
    return report


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test: frame and recompile counts see only its compiles.

    Test modules that compile opt in with ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_grad():
    """The test runs under ``torch.no_grad()``, as inference does (opt in like `fresh_dynamo`)."""
    with torch.no_grad():
        yield
