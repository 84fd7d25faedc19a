"""vllm-omni's DreamZero (`CausalWanModel`) paged at block sizes that divide neither its frame nor its chunk.

As tests/upstream/test_dreamzero_vllm_omni.py drives it (its pipeline's 1-frame first commit, commits without
registers, denoising forwards with them, CFG branches as separate batch-1 forwards), but in blocks of 5 and 12
tokens against 32-token frames (8-token frames with the sliding 21-frame window): the first commit leaves a partial
block the next continues, the window starts inside a block (a kv_gap). Oracle: the same model's dense path, eager,
fp32, <= 1e-5; one compiled frame per phase.
"""

from __future__ import annotations

import pytest

from .test_dreamzero_vllm_omni import _max_err, _pair

ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

CASES = [(5, 5, {}), (12, 12, {"max_chunk_size": -1, "frame_hw": (2, 4)})]  # (block, calls, model options)


@pytest.mark.parametrize("block,calls,model_kw", CASES, ids=["page5-resets", "page12-sliding"])
def test_page_size_vllm_omni_dreamzero_equals_dense(omni, omni_ctx, block, calls, model_kw):
    plans = []
    dense, paged, backend, spec = _pair(omni, "aot_eager", calls, block_size=block, plans=plans, **model_kw)
    assert spec.frame_seqlen % block and spec.chunk_tokens % block
    assert _max_err(dense, paged) <= ATOL
    assert dense["resets"] == paged["resets"] and backend.frames == 3
    if "max_chunk_size" in model_kw:
        assert any(row.kv_gap != (0, 0) for p in plans for row in p.rows), "the sliding window never hid a key"
