"""The Triton kernels against the reference kernel, on tiny geometries under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

import paged_kv_compile  # noqa: F401  (registers torch.ops.paged_kv)

from _opcases import dense_oracle, expected_pool, make_case

pytest.importorskip("triton")

GEOMETRIES = {
    "gqa2, padded row, unaligned prefix": dict(
        seed=10, hkv=2, ratio=2, block_size=3, tokens=3, prefixes=[4, 0, 7], new_counts=[2, 0, 3],
        modes=["random", "padded", "causal"], layout="transposed"),
    "gqa4, block size 1, sliced views": dict(
        seed=11, hkv=1, ratio=4, block_size=1, tokens=4, prefixes=[3, 5], new_counts=[4, 1],
        modes=["causal", "full"], layout="sliced"),
    "mha, block 8, padding first": dict(
        seed=12, hkv=2, ratio=1, head_dim=4, block_size=8, tokens=5, prefixes=[9, 1], new_counts=[3, 5],
        modes=["full", "random"], right_aligned=True, extra_width=2),
    "nothing written, nothing visible": dict(
        seed=13, hkv=1, ratio=2, block_size=4, tokens=2, prefixes=[0, 0], new_counts=[0, 0],
        modes=["padded", "padded"]),
}


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_triton_matches_reference(name):
    ref_case, tri_case = make_case(**GEOMETRIES[name]), make_case(**GEOMETRIES[name])
    before = tri_case.pool.clone()
    want = torch.ops.paged_kv.write_attend(*ref_case.args(), ref_case.scale, "reference")
    got = torch.ops.paged_kv.write_attend(*tri_case.args(), tri_case.scale, "triton")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, dense_oracle(tri_case), atol=1e-5, rtol=0)
    assert got.is_contiguous()
    assert torch.equal(tri_case.pool, expected_pool(tri_case, before))
    empty = torch.minimum(tri_case.kv_visible_end, tri_case.seq_lens.view(-1, 1)) <= 0
    assert bool((got[empty] == 0).all())


def test_triton_attend_only_and_half_precision():
    case = make_case(**GEOMETRIES["gqa2, padded row, unaligned prefix"], dtype=torch.float16)
    before = case.pool.clone()
    read = (case.query, case.pool, case.block_table, case.seq_lens, case.kv_visible_end, case.scale)
    got = torch.ops.paged_kv.attend(*read, "triton")
    want = torch.ops.paged_kv.attend(*read, "reference")
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    assert torch.equal(case.pool, before), "attend never writes"


@pytest.mark.parametrize("meta_layout", ["strided", "transposed"])
@pytest.mark.parametrize("name", ["gqa2, padded row, unaligned prefix", "mha, block 8, padding first"])
def test_triton_honours_every_stride(name, meta_layout):
    """Strided views of all four metadata tensors (and of q/k/v, per geometry) give the oracle's answer."""
    case = make_case(**GEOMETRIES[name], meta_layout=meta_layout)
    assert not any(t.is_contiguous() for t in (case.slot_mapping, case.block_table, case.seq_lens,
                                                case.kv_visible_end))
    before = case.pool.clone()
    got = torch.ops.paged_kv.write_attend(*case.args(), case.scale, "triton")
    torch.testing.assert_close(got, dense_oracle(case), atol=1e-5, rtol=0)
    assert torch.equal(case.pool, expected_pool(case, before))
    read = (case.query, case.pool, case.block_table, case.seq_lens, case.kv_visible_end, case.scale)
    torch.testing.assert_close(torch.ops.paged_kv.attend(*read, "triton"), got, atol=1e-5, rtol=0)
