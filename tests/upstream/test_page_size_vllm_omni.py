"""vllm-omni's DreamZero (`CausalWanModel`) paged at block sizes that divide neither its frame nor its chunk.

As tests/upstream/test_dreamzero_vllm_omni.py drives it (its pipeline's 1-frame first commit, commits without
registers, denoising forwards with them, CFG branches as separate batch-1 forwards), but in blocks of 5 and 12
tokens against 32-token frames (8-token frames with the sliding 21-frame window): the first commit leaves a partial
block the next continues, the window starts inside a block (a kv_gap). Oracle: the same model's dense path, eager,
fp32, <= 1e-5; one compiled frame per phase.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend

from paged_kv_compile.config import PagedKVConfig
from paged_kv_compile.families.dreamzero import DreamZeroSpec, session_blocks_per_row
from paged_kv_compile.runtime import PagedKVRuntime

from .dreamzero_pipeline import DenseKV, PagedKV, run_session
from .test_dreamzero_vllm_omni import START_FRAME_IS_A_VALUE

ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

CASES = [(5, 5, {}), (12, 12, {"max_chunk_size": -1, "frame_hw": (2, 4)})]  # (block, calls, model options)


@pytest.mark.parametrize("block,calls,model_kw", CASES, ids=["page5-resets", "page12-sliding"])
def test_page_size_vllm_omni_dreamzero_equals_dense(omni, omni_ctx, block, calls, model_kw):
    frame_hw = model_kw.get("frame_hw", (4, 8))
    model_d = omni.tiny_dreamzero_model(**model_kw)
    with torch.no_grad():
        dense = run_session(model_d, DenseKV(model_d), calls=calls, frame_hw=frame_hw)
    model = omni.tiny_dreamzero_model(**model_kw)
    spec = DreamZeroSpec.from_vllm_omni(model)
    assert spec.frame_seqlen % block and spec.chunk_tokens % block
    attn = model.blocks[0].self_attn
    rt = PagedKVRuntime(PagedKVConfig(
        num_layers=len(model.blocks), num_kv_heads=attn.tp_num_heads, head_dim=attn.head_dim, block_size=block,
        blocks_per_layer=2 * session_blocks_per_row(spec, block), max_rows=2,
        scratch_tokens_per_row=spec.tokens_per_forward, buckets=spec.buckets(rows=1), kernel="reference"))
    rt.bind(model.blocks)
    rt.admit("s", spec, rows=2)
    backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
    for b in model.blocks:
        b.forward = torch.compile(b.forward, backend=backend, fullgraph=True, dynamic=False)
    gaps = []
    kv = PagedKV(model, rt, "s", lambda kind, branch: rt.forward("s", "commit" if kind == "commit" else "denoise",
                                                                 branch=branch))
    plan = rt.scheduler.plan
    rt.scheduler.plan = lambda *a, **k: gaps.append(p := plan(*a, **k)) or p
    with torch.no_grad(), torch.compiler.config.patch(dynamic_sources=START_FRAME_IS_A_VALUE):
        paged = run_session(model, kv, calls=calls, frame_hw=frame_hw)
    err = max((dense[k] - paged[k]).abs().max().item() for k in ("video", "actions"))
    assert err <= ATOL, err
    assert dense["resets"] == paged["resets"] and backend.frames == 3
    if "max_chunk_size" in model_kw:
        assert any(row.kv_gap != (0, 0) for p in gaps for row in p.rows), "the sliding window never hid a key"
