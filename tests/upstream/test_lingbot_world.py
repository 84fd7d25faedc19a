"""vllm-omni's LingBot-World paged as written (0 model lines), through its own DMD probe and commit schedule.

Dense oracle: the same package classes with LingBot's own request-local cache, eager, fp32 (lingbot_world.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend

from . import lingbot_world as lb

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

BLOCKS = 5  # 5 one-frame blocks through a 3-frame window with a 1-frame sink: the window slides twice


def _paged(model, geometry, inputs, backend):
    """The rollout paged; also the frame count after the first block (history empty, then one frame)."""
    rt = lb.paged_runtime(geometry, model)
    rt.admit("s", geometry.spec(model), rows=1)
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=True, dynamic=False)
    recorder = lb.Recorder(model, runtime=rt)
    cache = lb.standin_cache(rt, model, geometry, inputs["prompt_embeds"])
    generator = torch.Generator().manual_seed(0)
    with torch.compiler.config.patch(dynamic_sources=lb.DYNAMIC_SOURCES):
        latents = lb.rollout(recorder, cache, geometry, inputs, blocks=range(1), generator=generator)
        first_frames = backend.frames
        latents += lb.rollout(recorder, cache, geometry, inputs, blocks=range(1, BLOCKS), generator=generator)
    return rt, recorder, latents, first_frames


def test_lingbot_world_pages_as_written_with_parity_and_one_frame_per_phase(omni_ctx):
    """Every forward of 5 AR blocks (4 probes + 1 commit each; the first block's history empty, the window sliding
    past its sink twice) paged equals LingBot's dense cache path within 1e-5, each block's final latents too.
    Frames: one per phase (probe, commit) and input layout: the first transformer block receives the patch
    embedding's transposed tokens (another stride than the later blocks' inputs, a dynamo guard), so 2 x 2 = 4, all
    compiled in the first AR block; none per chunk (the first, whose history is empty, included) or per layer
    beyond that. The pool ends holding the window."""
    geometry = lb.TinyLingBot()
    inputs = lb.block_inputs(geometry, BLOCKS)
    with torch.no_grad():
        model = lb.build(geometry)
        dense = lb.Recorder(model)
        expected = lb.rollout(dense, lb.dense_cache(model, geometry, inputs["prompt_embeds"]), geometry, inputs)
        backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
        rt, paged, got, first_frames = _paged(model, geometry, inputs, backend)
    assert len(paged.outputs) == len(dense.outputs) == BLOCKS * (len(lb.SCHEDULE) + 1)
    err = max((a - b).abs().max().item() for a, b in zip(paged.outputs, dense.outputs))
    latent_err = max((a - b).abs().max().item() for a, b in zip(got, expected))
    print(f"[figure] LingBot-World paged vs dense: max abs error {err:.2e} over {len(dense.outputs)} forwards, "
          f"{latent_err:.2e} on the blocks' latents")
    assert err <= 1e-5 and latent_err <= 1e-5, (err, latent_err)
    assert first_frames == backend.frames == 4, (first_frames, backend.frames)
    patterns = {r.pattern for result in backend.results for r in result.reports if r.status == "rewritten"}
    assert patterns == {"capacity-window"}, patterns
    held = geometry.window_frames - geometry.frames_per_block  # after a commit the window keeps room for the next
    assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer - held, rt.scheduler.allocator.num_free


def test_lingbot_world_session_with_another_sink_is_refused_before_any_forward(omni_ctx):
    """The capacity-window graph shows LingBot's cache capacity, not its sink: a session admitted with another sink
    would keep other history (measured: wrong from the first slide of the window), so the driver refuses it before
    the first forward, naming the fix; nothing was planned (the session holds no block)."""
    import dataclasses

    geometry = lb.TinyLingBot()
    inputs = lb.block_inputs(geometry, 1)
    with torch.no_grad():
        model = lb.build(geometry)
        rt = lb.paged_runtime(geometry, model)
        rt.admit("s", dataclasses.replace(geometry.spec(model), sink_frames=0), rows=1)
        free = rt.scheduler.allocator.num_free
        recorder = lb.Recorder(model, runtime=rt)
        cache = lb.standin_cache(rt, model, geometry, inputs["prompt_embeds"])
        with pytest.raises(ValueError, match=r"keeps a 0-token sink but the LingBot model's is 4 tokens .*"
                                             r"DreamZeroSpec.from_lingbot_world"):
            lb.rollout(recorder, cache, geometry, inputs)
    assert recorder.outputs == [] and rt.scheduler.allocator.num_free == free


def test_lingbot_world_first_chunk_on_its_own_fresh_cursor_names_nothing_to_page(omni_ctx):
    """As a new user tries it (the issue's report): stand-ins behind LingBot's own fresh cursor (`last_start=None`).
    Its first chunk attends over its new tokens only and its probes write no cache, so the compiled blocks have
    nothing to page: the runtime refuses the forward naming that cause, not stand-ins read outside a compiled
    graph, and rolls it back."""
    from paged_kv_compile.errors import RequestError

    lb.install()
    from vllm_omni.diffusion.models.lingbot_world.transformer import LingBotAttentionCache

    geometry = lb.TinyLingBot()
    inputs = lb.block_inputs(geometry, 1)
    with torch.no_grad():
        model = lb.build(geometry)
        rt = lb.paged_runtime(geometry, model)
        rt.admit("s", geometry.spec(model), rows=1)
        free = rt.scheduler.allocator.num_free
        for block in model.blocks:
            block.compile(backend=CountingBackend({"inner_compiler": "aot_eager"}), fullgraph=True, dynamic=False)
        cache = lb.standin_cache(rt, model, geometry, inputs["prompt_embeds"])
        cache.self_attention = [LingBotAttentionCache(key=c.key, value=c.value) for c in cache.self_attention]

        def fresh_cursor(**kwargs):
            with rt.forward("s", "commit" if kwargs["update_cache"] else "denoise"):
                return model(**kwargs)

        fresh_cursor.config = model.config
        with pytest.raises(RequestError) as err:
            lb.rollout(fresh_cursor, cache, geometry, inputs)
    message = str(err.value)
    assert "no paged attention ran in this denoise forward of 's': its blocks ran compiled with backend='paged_kv', " \
           "but the graphs they ran had nothing to page" in message, message
    assert "outside a compiled graph" not in message
    assert rt.scheduler.allocator.num_free == free


def test_lingbot_world_vllm_omni_own_paged_path_runs_on_cpu_near_dense(omni_ctx):
    """The benchmark's middle column is trusted: vllm-omni's own paged path for LingBot (`ARDiffusionKVState` over
    its `ARDiffusionKVCache`, built as its runner builds it; `paged_write_attn` in every self-attention) through the
    same DMD schedule is within 1e-5 of the dense cache path at every forward."""
    geometry = lb.TinyLingBot()
    inputs = lb.block_inputs(geometry, BLOCKS)
    with torch.no_grad():
        model = lb.build(geometry)
        dense = lb.Recorder(model)
        lb.rollout(dense, lb.dense_cache(model, geometry, inputs["prompt_embeds"]), geometry, inputs)
        native = lb.Recorder(model)
        lb.native_rollout(native, model, lb.native_state(model, geometry), geometry, inputs)
    err = max((a - b).abs().max().item() for a, b in zip(native.outputs, dense.outputs))
    print(f"[figure] LingBot-World vllm-omni paged vs dense: max abs error {err:.2e}")
    assert len(native.outputs) == len(dense.outputs) == BLOCKS * 5 and err <= 1e-5, err
