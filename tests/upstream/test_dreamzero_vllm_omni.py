"""vllm-omni's DreamZero (`CausalWanModel`, 0 changed model lines) paged under backend="paged_kv".

Driven as its pipeline drives it (dreamzero_pipeline.py): a 1-frame first commit, `num_frame_per_block`-frame
commits without registers, denoising forwards with them, CFG branches as separate batch-1 forwards with
separate caches, window resets. The oracle is the same model's dense path, eager, fp32. The blocks are compiled
as the pipeline's `setup_compile` does (`block.forward = torch.compile(block.forward, fullgraph=True,
dynamic=False)`); `current_start_frame`, a Python int, is marked a value with torch's
`compiler.config.dynamic_sources` so that one compiled frame serves each bucket (phase) at every start frame.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend

from paged_kv_compile.config import PagedKVConfig
from paged_kv_compile.families.dreamzero import DreamZeroSpec, session_blocks_per_row
from paged_kv_compile.runtime import PagedKVRuntime

from .dreamzero_pipeline import DenseKV, PagedKV, run_session

START_FRAME_IS_A_VALUE = "L['current_start_frame']"  # torch.compiler.config.dynamic_sources entry
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _pair(omni, inner: str, calls: int, *, block_size: int | None = None, plans: list | None = None, **model_kw):
    """The same session dense (eager) and paged (compiled, `inner` inside): `block_size` (default: a frame) pages the
    pool; `plans`, when given, collects each forward's plan."""
    frame_hw = model_kw.get("frame_hw", (4, 8))
    model_d = omni.tiny_dreamzero_model(**model_kw)
    with torch.no_grad():
        dense = run_session(model_d, DenseKV(model_d), calls=calls, frame_hw=frame_hw)
    model = omni.tiny_dreamzero_model(**model_kw)
    spec = DreamZeroSpec.from_vllm_omni(model)
    attn = model.blocks[0].self_attn
    block = block_size or spec.frame_seqlen
    rt = PagedKVRuntime(PagedKVConfig(
        num_layers=len(model.blocks), num_kv_heads=attn.tp_num_heads, head_dim=attn.head_dim, block_size=block,
        blocks_per_layer=2 * session_blocks_per_row(spec, block), max_rows=2,  # what admission reserves: no more
        scratch_tokens_per_row=spec.tokens_per_forward, buckets=spec.buckets(rows=1), kernel="reference"))
    rt.bind(model.blocks)
    rt.admit("s", spec, rows=2)  # two CFG branches, one cache each
    backend = CountingBackend({"inner_compiler": inner, "strict": True})
    for block in model.blocks:  # as DreamZeroPipeline.setup_compile does
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=True, dynamic=False)
    kv = PagedKV(model, rt, "s", lambda kind, branch: rt.forward("s", "commit" if kind == "commit" else "denoise",
                                                                 branch=branch))
    if plans is not None:
        plan = rt.scheduler.plan
        rt.scheduler.plan = lambda *a, **k: plans.append(p := plan(*a, **k)) or p
    with torch.no_grad(), torch.compiler.config.patch(dynamic_sources=START_FRAME_IS_A_VALUE):
        paged = run_session(model, kv, calls=calls, frame_hw=frame_hw)
    return dense, paged, backend, spec


def _max_err(dense, paged) -> float:
    err = max((dense[k] - paged[k]).abs().max().item() for k in ("video", "actions"))
    print(f"[figure] paged vs dense eager max abs error {err:.2e} over {len(paged['forwards'])} forwards")
    return err


def test_dreamzero_pages_with_parity_one_frame_per_bucket(omni, omni_ctx):
    dense, paged, backend, spec = _pair(omni, "aot_eager", calls=5)
    assert dense["resets"] == paged["resets"] == [2, 4], "window resets at local_attn_size"
    assert dense["forwards"] == paged["forwards"]
    assert _max_err(dense, paged) <= ATOL
    # three phases, three buckets: first commit (1 frame), commit (nfpb frames), denoise (chunk + registers);
    # one compiled frame each, for both layers, both CFG branches and every start frame
    assert backend.frames == 3
    fs, chunk, regs = spec.frame_seqlen, spec.chunk_tokens, spec.action_tokens
    got = sorted((r.expect.chunk_tokens, r.expect.action_tokens) for r in backend.results)
    assert got == sorted([(fs, 0), (chunk, 0), (chunk, regs)])
    assert all(rep.status in ("rewritten", "dense") for r in backend.results for rep in r.reports)
    assert all([rep.status for rep in r.reports].count("rewritten") == 1 for r in backend.results)


def test_dreamzero_unbounded_window_slides(omni, omni_ctx):
    """max_chunk_size=-1: a 21-frame window that slides (no resets): history is evicted block by block."""
    dense, paged, backend, spec = _pair(omni, "aot_eager", calls=12, max_chunk_size=-1, frame_hw=(2, 4))
    assert dense["resets"] == [] and spec.window_frames == 21
    assert 1 + 11 * spec.chunk_frames > spec.window_frames - spec.chunk_frames, "the window must slide"
    assert _max_err(dense, paged) <= ATOL
    assert backend.frames == 3


def test_dreamzero_inductor_parity(omni, omni_ctx):
    """Parity through Inductor, one frame per bucket with Inductor's FX graph cache off. With the cache on and
    warm (any earlier run on the machine), a cache hit re-evaluates the cached graph's guard expression
    (`max(0, (current_start_frame - 1) // 2) <= 1024`, from the RoPE rows) on the symbolic start frame
    (torch/_inductor/codecache.py: FxGraphCache._lookup_graph), which adds `current_start_frame <= 2` to the
    denoise frame: the first later start frame compiles a 4th frame (docs/models.md)."""
    with torch._inductor.config.patch(fx_graph_cache=False):
        dense, paged, backend, _ = _pair(omni, "inductor", calls=3)
    assert _max_err(dense, paged) <= ATOL
    assert all([rep.status for rep in r.reports].count("rewritten") == 1 for r in backend.results)
    assert backend.frames == 3, dict(torch._dynamo.utils.guard_failures)
