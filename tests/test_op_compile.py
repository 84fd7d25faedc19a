"""The op inside torch.compile(fullgraph=True): it writes the real pool, and Inductor neither
allocates nor copies a pool-sized buffer (checked on the generated code, with bad variants as controls)."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import paged_kv_compile  # noqa: F401  (registers torch.ops.paged_kv)

from _codecheck import pool_sized_allocations
from _opcases import make_case

GEOMETRY = dict(seed=21, hkv=2, ratio=2, block_size=4, tokens=3, prefixes=[5, 2], new_counts=[3, 2],
                modes=["causal", "random"], extra_width=2)


def _step(kernel: str):
    def step(q, k, v, pool, slot, table, seq, end):
        out = torch.ops.paged_kv.write_attend(q, k, v, pool, slot, table, seq, end, 0.5, kernel)
        return out * 2 + 1  # something for Inductor to fuse around the op

    return step


def _compiled_run(fn, backend: str, args: tuple):
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        if backend == "inductor":
            return run_and_get_code(compiled, *args)
        return compiled(*args), []


@pytest.mark.parametrize(
    "backend, kernel", [("aot_eager", "reference"), ("aot_eager", "triton"), ("inductor", "reference")]
)
def test_compiled_op_writes_the_real_pool_and_matches_eager(backend, kernel):
    if kernel == "triton":
        pytest.importorskip("triton")
    eager_case, case = make_case(**GEOMETRY), make_case(**GEOMETRY)
    want = _step(kernel)(*eager_case.args())
    pool = case.pool
    got, codes = _compiled_run(_step(kernel), backend, case.args())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert case.pool is pool and torch.equal(pool, eager_case.pool), "the caller's pool itself holds the new K/V"
    if backend == "inductor":
        code = "\n".join(codes)
        assert "torch.ops.paged_kv.write_attend.default(" in code
        assert pool_sized_allocations(code, tuple(pool.shape)) == []


@torch.library.custom_op("paged_kv_test::write_two_views", mutates_args=("k_cache", "v_cache"))
def _write_two_views(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor) -> None:
    """The anti-pattern the one-mutated-pool rule forbids (README.md, "Pool"):
    K and V as two mutated views of one allocation."""
    k_cache.view(-1)[: k.numel()].copy_(k.reshape(-1))
    v_cache.view(-1)[: k.numel()].copy_(k.reshape(-1))


@_write_two_views.register_fake
def _(k_cache, v_cache, k):
    return None


def _clones_pool(q, k, v, pool, slot, table, seq, end):
    scratch = pool.clone()
    return torch.ops.paged_kv.write_attend(q, k, v, scratch, slot, table, seq, end, 0.5, "reference"), scratch


def _two_views(q, k, v, pool, slot, table, seq, end):
    torch.ops.paged_kv_test.write_two_views(pool[0], pool[1], k)
    return torch.ops.paged_kv.attend(q, pool, table, seq, end, 0.5, "reference")


@pytest.mark.parametrize(
    "fn, functionalization_v2",
    # auto_functionalized v1 (torch's default before v2) clones the base of two mutated views; torch
    # 2.13's default v2 re-inplaces even that, so the control pins v1 to keep the detector honest.
    [(_clones_pool, True), (_two_views, False)],
    ids=["pool.clone() in the function", "two mutated views of one allocation"],
)
def test_the_check_detects_pool_copies(fn, functionalization_v2):
    case = make_case(**GEOMETRY)
    with torch._inductor.config.patch(enable_auto_functionalized_v2=functionalization_v2):
        _, codes = _compiled_run(fn, "inductor", case.args())
    found = pool_sized_allocations("\n".join(codes), tuple(case.pool.shape))
    assert found, "a pool-sized allocation or copy must be reported"
