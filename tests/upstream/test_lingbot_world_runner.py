"""vllm-omni's own `ARDiffusionModelRunner` serving LingBot-World sessions from our runtime, chosen by configuration.

The runner is the package's (`PagedKVARDiffusionModelRunner` subclasses it; `diffusion_model_runner_cls`), the
pipeline `LingBotWorldCausalDMDPipeline`'s realtime tick path over a tiny transformer (tests/upstream/lingbot_runner.py
says what is stubbed). The oracle is the same runner and pipeline whose sessions keep LingBot's own dense cache.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from paged_kv_compile.adapters.vllm_omni_ar_lingbot import LingBotPagedKV
from paged_kv_compile.adapters.vllm_omni_ar_runner import RUNNER_PATH
from paged_kv_compile.errors import ConfigError

from . import lingbot_runner as lr

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

OURS = {"paged_kv": {"inner_compiler": "aot_eager", "kernel": "reference"}}


def _plan(inputs: dict[str, list]) -> list:
    """Fresh request objects (the runner seeds each request's generator in place): session "a" through 4 ticks (the
    3-frame cache with its 1-frame sink slides from the fourth), "b" interleaved, then "a" reset and 2 more ticks."""
    a, b = inputs["a"], inputs["b"]
    return [*lr.requests("a", a[:2]), *lr.requests("b", b[:1]), *lr.requests("a", a[2:4], first_chunk=2),
            *lr.requests("b", b[1:2], first_chunk=1), *lr.requests("a", a[4:6], reset=True, seed=7)]


def _serve(omni, runner_cls: str, plan_of, *, model_config=None):
    od = lr.diffusion_config(runner_cls=runner_cls, model_config=model_config)
    with omni.model_context(od):
        runner = lr.build_runner(od)
        return runner, od, lr.latents(lr.serve(runner, plan_of()))


def _max_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    assert len(got) == len(want) and got
    return max((a - b).abs().max().item() for a, b in zip(got, want))


def test_lingbot_world_through_the_runner_matches_the_dense_runner_one_frame_per_phase(omni):
    """Two sessions through vllm-omni's runner and LingBot's tick path (4 DMD probes + 1 commit per tick, the cache
    sliding past its sink, the second session interleaved, a reset): every tick's latents equal the dense runner's
    (fp32, the reference kernel). Frames: 4 in all (probe and commit, each for the patch embedding's transposed
    input of the first block and the contiguous input of the later ones), none per chunk, session or reset; the
    K/V lives in our pool, and closing the sessions leaves it at its baseline."""
    inputs = {"a": lr.session_inputs(6, seed=1), "b": lr.session_inputs(2, seed=2)}
    _, _, dense = _serve(omni, lr.DENSE_RUNNER, lambda: _plan(inputs))

    torch._dynamo.reset()
    counters.clear()
    runner, od, paged = _serve(omni, RUNNER_PATH, lambda: _plan(inputs), model_config=OURS)
    assert type(runner.kv_cache) is LingBotPagedKV
    runtime = runner.kv_cache.runtime
    err = _max_err(paged, dense)
    print(f"[figure] LingBot-World through vllm-omni's runner, ours vs dense: max abs error {err:.2e} over "
          f"{len(paged)} ticks ({len(paged) * 5} transformer forwards)")
    assert err <= 1e-5, err
    assert counters["stats"]["unique_graphs"] == 4 and not counters["graph_break"]
    assert sorted(runner._sessions) == ["a", "b"] and len(runtime.owner_ids()) == 2
    assert runtime.pool.tensor.abs().sum() > 0, "the K/V lives in our pool"
    with omni.model_context(od):
        runner.close_session("a")
        runner.close_session("b")
    assert runtime.owner_ids() == [] and runtime.active is None
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def test_lingbot_world_runner_refuses_a_model_sink_its_sessions_do_not_keep(omni):
    """The compiled graph cannot show LingBot's sink, so the session state checks it before every forward: a model
    whose `sink_size` no longer matches the sessions' window is refused before anything is planned, naming the
    sink and the fix; the runner releases the session (fail closed), the runtime holds no block and no forward,
    and once the sink is restored a new session is served equal to the dense runner."""
    inputs = lr.session_inputs(2, seed=3)
    od = lr.diffusion_config(runner_cls=RUNNER_PATH, model_config=OURS)
    with omni.model_context(od):
        runner = lr.build_runner(od)
        runtime = runner.kv_cache.runtime
        lr.serve(runner, lr.requests("a", inputs[:1]))
        config = runner.pipeline.transformer.config
        config.sink_size = 0
        with pytest.raises(ConfigError, match=r"session 'a' keeps a 4-token sink but the LingBot model's is 0 tokens "
                                              r"\(config.sink_size=0 frames of 4 tokens\): admit it with "
                                              r"DreamZeroSpec.from_lingbot_world"):
            lr.serve(runner, lr.requests("a", inputs[1:], first_chunk=1))
        assert "a" not in runner._sessions and runtime.owner_ids() == []
        assert runtime.active is None and runtime.scheduler.in_flight is None
        assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer
        config.sink_size = 1
        again = lr.latents(lr.serve(runner, lr.requests("c", inputs)))
    _, _, want = _serve(omni, lr.DENSE_RUNNER, lambda: lr.requests("c", inputs))
    assert _max_err(again, want) <= 1e-5


@pytest.mark.parametrize("case", ["spec_sink", "cuda_graphs", "max_num_seqs"])
def test_lingbot_world_runner_refuses_what_it_cannot_serve_at_startup(omni, case):
    """At startup, before any session: a pipeline spec whose sink disagrees with its transformer (the pool would keep
    another history), CUDA graphs (LingBot's pipeline has no warm-up requests to capture from), several sessions per
    forward (its pipeline refuses request batches): each refused naming the cause."""
    model_config, overrides = dict(OURS), {}
    if case == "cuda_graphs":
        model_config = {"paged_kv": {**OURS["paged_kv"], "cuda_graphs": "block"}}
    if case == "max_num_seqs":
        overrides["max_num_seqs"] = 2
    od = lr.diffusion_config(runner_cls=RUNNER_PATH, model_config=model_config, **overrides)
    with omni.model_context(od):
        pipeline = lr.build_pipeline(od)
        if case == "spec_sink":
            spec = pipeline.ar_diffusion_kv_cache_spec()
            pipeline.ar_diffusion_kv_cache_spec = lambda: dataclasses.replace(spec, sink_frames=0, window_frames=3)
        want = {"spec_sink": r"does not describe its LingBot transformer's cache: "
                             r"sink_frames \(spec 0, transformer 1\)",
                "cuda_graphs": r"cuda_graphs needs the pipeline's warm-up requests",
                "max_num_seqs": r"max_num_seqs=2: LingBot-World's pipeline serves one request per forward"}[case]
        with pytest.raises(ConfigError, match=want):
            lr.dr.build_runner(pipeline, od, available_bytes=1 << 26)


def test_lingbot_world_vllm_omni_own_runner_matches_the_dense_runner(omni):
    """The benchmark's middle column through the runner is trusted: vllm-omni's own runner (no
    `diffusion_model_runner_cls`: `ARDiffusionKVCache` over vLLM's KVCacheManager, `paged_write_attn`'s CPU reference
    path) serves the same two sessions and reset within 1e-5 of the dense runner."""
    inputs = {"a": lr.session_inputs(6, seed=1), "b": lr.session_inputs(2, seed=2)}
    _, _, dense = _serve(omni, lr.DENSE_RUNNER, lambda: _plan(inputs))
    runner, _, theirs = _serve(omni, None, lambda: _plan(inputs))
    assert type(runner.kv_cache).__name__ == "ARDiffusionKVCache"
    err = _max_err(theirs, dense)
    print(f"[figure] LingBot-World through vllm-omni's own runner vs dense: max abs error {err:.2e}")
    assert err <= 1e-5, err


def test_lingbot_world_fp8_runner_is_within_the_fp8_bound_of_the_fp32_dense_runner(omni):
    """`kv_dtype: float8_e4m3fn` for LingBot (default scales 1.0): five ticks through the cache's slide within the FP8
    tests' bound of the fp32 dense runner (tests/test_fp8_runtime.py: mean error < 0.1, max < 1.0 on outputs of mean
    |x| about 1) and not equal to it (the pool really quantizes); its blocks cost under a third of the fp32 pool's
    bytes per session."""
    inputs = lr.session_inputs(5, seed=1)
    _, _, dense = _serve(omni, lr.DENSE_RUNNER, lambda: lr.requests("a", inputs))
    fp32, _, _ = _serve(omni, RUNNER_PATH, lambda: [], model_config=OURS)
    torch._dynamo.reset()
    runner, _, fp8 = _serve(omni, RUNNER_PATH, lambda: lr.requests("a", inputs),
                            model_config={"paged_kv": {**OURS["paged_kv"], "kv_dtype": "float8_e4m3fn"}})
    assert runner.kv_cache.runtime.pool.tensor.dtype == torch.float8_e4m3fn
    assert runner.kv_cache.budget.kv_bytes_per_session * 3 < fp32.kv_cache.budget.kv_bytes_per_session
    diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(fp8, dense)])
    scale = torch.cat([b.abs().flatten() for b in dense]).mean().item()
    print(f"[figure] LingBot-World FP8 e4m3 runner vs fp32 dense runner: max {diffs.max().item():.3e}, mean "
          f"{diffs.mean().item():.3e} (dense mean |x| {scale:.3f})")
    assert diffs.mean().item() < 0.1 and diffs.max().item() < 1.0
    assert diffs.max().item() > 0, "the FP8 pool must actually quantize"


def test_lingbot_world_session_state_refuses_a_block_of_another_size_before_planning(omni):
    """A block whose token count is not the session's chunk (a request at another resolution than the runner's
    ar_diffusion_height/width) and an unknown KV branch are refused by the session state before the runtime plans a
    forward; closing the session gives its blocks back."""
    from paged_kv_compile.errors import RequestError

    od = lr.diffusion_config(runner_cls=RUNNER_PATH, model_config=OURS)
    with omni.model_context(od):
        runner = lr.build_runner(od)
    runtime = runner.kv_cache.runtime
    state = runner.kv_cache.begin_session("x")
    with pytest.raises(RequestError, match=r"LingBot block of 8 tokens, but session 'x' was sized for blocks of 4 "
                                           r"\(1 frames of 4 tokens\)"):
        state.get_kv_caches("main", seq_len=8)
    with pytest.raises(RequestError, match=r"unknown KV branch 'negative'; this pipeline declares \('main',\)"):
        state.get_kv_caches("negative", seq_len=4)
    assert runtime.active is None and runtime.scheduler.in_flight is None and len(runtime.owner_ids()) == 1
    state.close()
    assert runtime.owner_ids() == [] and runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer
