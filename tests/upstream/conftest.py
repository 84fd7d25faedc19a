"""Fixtures for the tests that run vllm-omni's real classes on CPU (see vllm_omni_cpu.py).

vllm-omni is a pinned test dependency: when it is missing these tests fail (an ImportError from the
fixture), they do not skip.
"""

from __future__ import annotations

import pytest

from . import vllm_omni_cpu


@pytest.fixture(scope="session")
def omni():
    """The harness module, shims installed and a one-rank gloo world initialized (once per process)."""
    vllm_omni_cpu.install()
    vllm_omni_cpu.init_distributed()
    return vllm_omni_cpu


@pytest.fixture
def omni_ctx(omni):
    """Build and run vllm-omni layers inside this fixture's context (configs + forward context)."""
    with omni.model_context() as od_config:
        yield od_config


@pytest.fixture(scope="session")
def ranks():
    """Two gloo ranks in worker processes through vllm-omni's parallel_state (multirank.py), started once per
    test process and shared by every multi-rank test; `ranks.setup(tensor_parallel_size=2)` etc. picks the layout."""
    from .multirank import RankPool

    pool = RankPool(2)
    try:
        yield pool
    finally:
        pool.close()
