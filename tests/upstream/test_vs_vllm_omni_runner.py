"""vllm-omni's own `ARDiffusionModelRunner` serving DreamZero sessions from our runtime (and from its own pool).

The runner is the package's (`PagedKVARDiffusionModelRunner` subclasses it; selected by
`od_config.diffusion_model_runner_cls`), the pipeline is `DreamZeroPipeline`'s KV and denoising code over a
tiny `CausalWanModel` (tests/upstream/dreamzero_runner.py says what is stubbed). The oracle is the same runner
and pipeline with dense caches (the model's own dense path), eager, fp32.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from paged_kv_compile.adapters.vllm_omni_ar_runner import RUNNER_PATH

from . import dreamzero_runner as dr

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

ATOL = 1e-5
GEOMETRY = dr.TinyGeometry()
BUDGET = 8 << 30  # "free device memory": with DreamZero's 603 MiB of model state per session, one session
TWO_SESSIONS = 13 << 30  # 10% of it holds two sessions (the state dominates at this size)
OURS = {"paged_kv": {"inner_compiler": "aot_eager", "kernel": "reference"}}


def _runner(omni, runner_cls, *, available_bytes=BUDGET, model_config=None):
    od = dr.diffusion_config(runner_cls=runner_cls, model_config=dict(model_config or {}))
    with omni.model_context(od):
        pipeline = dr.build_pipeline(GEOMETRY, od)
        return dr.build_runner(pipeline, od, available_bytes=available_bytes), od


def _serve(omni, runner, od, requests):
    with omni.model_context(od):
        return dr.serve(runner, requests)


def _max_err(got: list[dict], want: list[dict]) -> float:
    assert len(got) == len(want)
    return max((a[k] - b[k]).abs().max().item() for a, b in zip(got, want) for k in ("video", "actions"))


def _requests(session: str, inputs, first: int = 0, *, reset_at: tuple[int, ...] = ()):
    return [dr.make_request(f"{session}-r{first + i}", session, extra, reset=first + i in reset_at)
            for i, extra in enumerate(inputs)]


def test_runner_serves_our_session_through_a_reset_and_requests(omni):
    """Two requests, an explicit reset (`extra_args["reset"]`), three more (the last crosses the window reset):
    every output equals the dense runner's; one compiled frame per phase serves every start frame."""
    inputs = dr.request_inputs(GEOMETRY, 5)
    plan = _requests("s0", inputs, reset_at=(2,))
    dense_runner, dense_od = _runner(omni, dr.DENSE_RUNNER)
    dense = _serve(omni, dense_runner, dense_od, plan)

    torch._dynamo.reset()
    counters.clear()
    runner, od = _runner(omni, RUNNER_PATH, model_config=OURS)
    runtime = runner.kv_cache.runtime
    paged = _serve(omni, runner, od, plan[:2])
    first_owner = runner._sessions["s0"]._owner
    assert runtime.owner_ids() == [first_owner] and runtime.active is None
    assert all(len(row) > 0 for row in runtime.owner(first_owner).rows), "both CFG branches hold history blocks"
    assert runtime.pool.tensor.abs().sum() > 0, "the K/V lives in our pool"
    paged += _serve(omni, runner, od, plan[2:])
    second_owner = runner._sessions["s0"]._owner
    assert second_owner != first_owner and runtime.owner_ids() == [second_owner], "the reset released the session"

    err = _max_err(paged, dense)
    print(f"[figure] our runtime behind vllm-omni's runner vs dense: max abs error {err:.2e} over 5 requests")
    assert err <= ATOL
    # first commit (1 frame), commit (nfpb frames), denoise (chunk + registers): three buckets, three frames
    assert counters["stats"]["unique_graphs"] == 3
    assert not counters["graph_break"]


def test_vllm_omni_own_paged_kv_matches_dense(omni):
    """Column 2: vllm-omni's `ARDiffusionKVCache` (vLLM's KVCacheManager, its CPU reference attention) through the
    same runner and requests, against the dense runner."""
    inputs = dr.request_inputs(GEOMETRY, 5)
    plan = _requests("s0", inputs, reset_at=(2,))
    dense_runner, dense_od = _runner(omni, dr.DENSE_RUNNER)
    theirs_runner, theirs_od = _runner(omni, None)
    assert type(theirs_runner.kv_cache).__name__ == "ARDiffusionKVCache"
    err = _max_err(_serve(omni, theirs_runner, theirs_od, plan), _serve(omni, dense_runner, dense_od, plan))
    print(f"[figure] vllm-omni's own paged KV vs dense: max abs error {err:.2e}")
    assert err <= ATOL


def test_runner_lru_warmup_and_fail_closed(omni):
    """The base runner's session policy over our runtime: warm-up requests leave the pool as they found it, the
    least recently used session is evicted at capacity (its blocks freed), a forward that raises releases its
    session and rolls the runtime back, and each later request matches the dense runner under the same policy."""
    runner, od = _runner(omni, RUNNER_PATH, available_bytes=TWO_SESSIONS, model_config=OURS)
    dense_runner, dense_od = _runner(omni, dr.DENSE_RUNNER)
    dense_runner._session_capacity = runner._session_capacity
    assert runner._session_capacity == 2
    runtime = runner.kv_cache.runtime
    free = runtime.scheduler.allocator.num_free

    served = []  # the runner's warm-up logs and swallows a failed request: count the ones that ran
    forward = runner.pipeline.forward
    runner.pipeline.forward = lambda req, **kw: served.append(forward(req, **kw)) or served[-1]
    with omni.model_context(od):
        runner._warmup_ar_rollout()  # the pipeline's warm-up requests, as load_model runs them
    del runner.pipeline.forward
    assert len(served) == 3, "one warm-up request per window-fill shape (1 + ceil((5 - 1) / 2))"
    assert runtime.owner_ids() == [] and runtime.scheduler.allocator.num_free == free and not runner._sessions

    inputs = {s: dr.request_inputs(GEOMETRY, 3, seed=n) for n, s in enumerate(("a", "b", "c"))}
    plan = [*_requests("a", inputs["a"][:1]), *_requests("b", inputs["b"][:1]), *_requests("c", inputs["c"][:1]),
            *_requests("a", inputs["a"][1:2], 1)]  # "a" was evicted by "c": it starts again
    paged = _serve(omni, runner, od, plan)
    assert list(runner._sessions) == ["c", "a"] and len(runtime.owner_ids()) == 2
    assert _max_err(paged, _serve(omni, dense_runner, dense_od, plan)) <= ATOL

    block = runner.pipeline.transformer.blocks[1]
    compiled = block.forward

    def fail_once(*args, **kwargs):
        block.forward = compiled
        raise RuntimeError("injected failure in block 1")

    block.forward = fail_once  # the next forward (the commit of "c"'s second request) fails in its last block
    with pytest.raises(RuntimeError, match="injected failure"):
        _serve(omni, runner, od, _requests("c", inputs["c"][1:2], 1))
    assert "c" not in runner._sessions and runtime.active is None and runtime.scheduler.in_flight is None
    a_owner = runner._sessions["a"]._owner
    assert runtime.owner_ids() == [a_owner], "the failed session was released"
    held = sum(len(row) for row in runtime.owner(a_owner).rows)
    assert runtime.scheduler.allocator.num_free == free - held, "its blocks (and the failed commit's) are free"
    again = _serve(omni, runner, od, _requests("c", inputs["c"][:1], 5))  # starts afresh, like a new session
    dense_runner.close_session("c")
    want = _serve(omni, dense_runner, dense_od, _requests("c", inputs["c"][:1], 5))
    assert _max_err(again, want) <= ATOL


def test_unknown_paged_kv_option_is_refused(omni):
    with pytest.raises(ValueError, match="unknown keys \\['kernal'\\]"):
        _runner(omni, RUNNER_PATH, model_config={"paged_kv": {"kernal": "triton"}})


class _StatesKV:
    """`dreamzero_pipeline.run_session`'s cache interface over session states of the adapter: CFG branch b's
    forwards go to `states[b]` (one state for both branches on one rank; one per rank under CFG-parallel), each
    forward announced as `_kv_get` announces it and closed as the runner closes an invocation."""

    def __init__(self, model, states, names=("positive", "negative")) -> None:
        self.states, self.names = states, names
        self.fs, self.nfpb = model.frame_seqlen, model.num_frame_per_block
        self.first = {0: True, 1: True}
        self.kind = None

    def reset(self) -> None:
        for state in {id(s): s for s in self.states.values()}.values():
            state.reset()
        self.first = {0: True, 1: True}

    def forward(self, kind: str, branch: int):
        import contextlib

        self.kind, self.seq_len = kind, self.fs if kind == "commit" and self.first[branch] else self.nfpb * self.fs
        if kind == "commit":
            self.first[branch] = False
        return contextlib.nullcontext()

    def get(self, branch: int):
        return self.states[branch].get_kv_caches(self.names[branch], seq_len=self.seq_len,
                                                 commit_current=self.kind == "commit")

    def done(self, kind: str, branch: int, updated) -> None:
        if kind == "commit":
            self.states[branch].commit_paged_context(self.names[branch])
        self.states[branch].end_invocation()


def test_cfg_parallel_shape_one_row_per_rank(omni, omni_ctx):
    """Under CFG-parallel DreamZero's spec gives both branches local index 0 (`ar_diffusion_kv_cache_spec`:
    `negative_local_index = 0 if cfg_world >= 2`), so each rank's runtime holds one row and runs only its branch.
    Two such ranks (each its own model copy and runtime, the branch's forwards as batch-1 forwards) and one rank
    holding both rows give the dense outputs, through two window resets."""
    import dataclasses

    from paged_kv_compile.adapters.vllm_omni_ar_diffusion import DreamZeroPagedKV

    from .dreamzero_pipeline import DenseKV, run_session

    def ranks_spec(spec):
        return dataclasses.replace(spec, kv_branches=tuple(dataclasses.replace(b, local_index=0)
                                                           for b in spec.kv_branches))

    def paged_model(cfg_parallel: bool):
        pipeline = dr.build_pipeline(GEOMETRY, omni_ctx)
        spec = pipeline.ar_diffusion_kv_cache_spec()
        kv = DreamZeroPagedKV.build(pipeline.transformer, ranks_spec(spec) if cfg_parallel else spec,
                                    available_bytes=BUDGET, memory_fraction=0.1, dtype=torch.float32,
                                    kernel="reference", inner_compiler="aot_eager")
        for block in pipeline.transformer.blocks:
            block.forward = torch.compile(block.forward, backend="paged_kv", fullgraph=True, dynamic=False)
        return pipeline.transformer, kv

    model = omni.tiny_dreamzero_model()
    with torch.no_grad():
        dense = run_session(model, DenseKV(model), calls=5)
    (m0, kv0), (m1, kv1) = paged_model(True), paged_model(True)
    one, kv_one = paged_model(False)
    assert kv0.rows == kv1.rows == 1 and kv_one.rows == 2
    rank0, rank1 = kv0.begin_session("s"), kv1.begin_session("s")
    both = kv_one.begin_session("s")
    with torch.no_grad(), torch.compiler.config.patch(dynamic_sources="L['current_start_frame']"):
        # rank 0 runs the positive branch, rank 1 the negative one; run_session interleaves them per step
        split = run_session(_TwoRanks(m0, m1), _StatesKV(m0, {0: rank0, 1: rank1}), calls=5)
        torch._dynamo.reset()  # one process holds pools of two geometries here (ranks are processes when serving)
        together = run_session(one, _StatesKV(one, {0: both, 1: both}), calls=5)
    assert dense["resets"] == split["resets"] == [2, 4]
    for got in (split, together):
        assert max((dense[k] - got[k]).abs().max().item() for k in ("video", "actions")) <= ATOL
    assert kv0.runtime.owner(rank0._owner).num_rows == 1


class _TwoRanks(torch.nn.Module):
    """Two model copies as one callable: a branch-0 forward runs on rank 0's copy, a branch-1 forward on rank 1's
    (the branch is read from the state behind the cache contexts)."""

    def __init__(self, rank0, rank1) -> None:
        super().__init__()
        self.ranks = (rank0, rank1)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.ranks[0], name)

    def forward(self, *args, **kwargs):
        branch = args[4][0].forward_ctx.kv_branch
        return self.ranks[0 if branch == "positive" else 1](*args, **kwargs)


def _session_kv(omni_ctx):
    """Our paged KV for a fresh tiny vllm-omni DreamZero pipeline (fp32, reference kernel, aot_eager), driven by hand
    through its session state (no model runs)."""
    from paged_kv_compile.adapters.vllm_omni_ar_diffusion import DreamZeroPagedKV

    pipeline = dr.build_pipeline(GEOMETRY, omni_ctx)
    return DreamZeroPagedKV.build(pipeline.transformer, pipeline.ar_diffusion_kv_cache_spec(), available_bytes=BUDGET,
                                  memory_fraction=0.1, dtype=torch.float32, kernel="reference",
                                  inner_compiler="aot_eager")


def test_session_state_refuses_bad_calls_and_leaves_the_runtime_as_it_was(omni, omni_ctx):
    """What the pipeline could get wrong is refused with the problem named, and the runtime does not change:
    an unknown branch, a frame-misaligned forward, a forward whose size disagrees with the session's window (rolled
    back), a commit never confirmed before the next forward (rolled back)."""
    from paged_kv_compile.errors import RequestError

    kv = _session_kv(omni_ctx)
    state = kv.begin_session("s")
    fs = GEOMETRY.frame_seqlen
    before = kv.runtime.state()

    with pytest.raises(RequestError, match="unknown KV branch 'neutral'.*'positive', 'negative'"):
        state.get_kv_caches("neutral", seq_len=fs, commit_current=True)
    with pytest.raises(AssertionError, match="frame-aligned"):
        state.get_kv_caches("positive", seq_len=fs + 1, commit_current=True)
    # the first commit of an empty window is one frame; announcing two is refused when the blocks would run
    layers = state.get_kv_caches("positive", seq_len=2 * fs, commit_current=True)
    with pytest.raises(RequestError, match=f"planned {fs} tokens .* model runs {2 * fs}"):
        layers[0].forward_ctx.prepare(torch.device("cpu"), 0, 2 * fs)
    assert kv.runtime.state() == before and kv.runtime.active is None

    first = state.get_kv_caches("positive", seq_len=fs, commit_current=True)
    first[0].forward_ctx.prepare(torch.device("cpu"), 0, fs)
    assert kv.runtime.active is not None
    other = state.get_kv_caches("negative", seq_len=fs, commit_current=True)
    with pytest.raises(RuntimeError, match="'positive' commit forward was not committed"):
        other[0].forward_ctx.prepare(torch.device("cpu"), 0, fs)
    assert kv.runtime.state() == before and kv.runtime.active is None


def test_session_state_refuses_a_context_reused_after_its_forward_ended(omni, omni_ctx):
    """A branch's context whose forward was closed (the other branch's forward started) must not run its layers
    inside the forward now open: refused, and the open forward is left as it was."""
    kv = _session_kv(omni_ctx)
    state = kv.begin_session("s")
    fs = GEOMETRY.frame_seqlen
    every_layer = range(kv.runtime.config.num_layers)  # what the compiled sites record (no model runs here)
    for branch in ("positive", "negative"):  # the first chunk, committed on both branches
        state.get_kv_caches(branch, seq_len=fs, commit_current=True)[0].forward_ctx.prepare(torch.device("cpu"), 0, fs)
        kv.runtime.active.record_layers(every_layer)
        state.commit_paged_context(branch)
    chunk, registers = GEOMETRY.num_frame_per_block * fs, GEOMETRY.num_action_per_block + GEOMETRY.num_state_per_block
    first = state.get_kv_caches("positive", seq_len=chunk)  # a denoising step of the next chunk, per branch
    first[0].forward_ctx.prepare(torch.device("cpu"), registers, chunk + registers)
    kv.runtime.active.record_layers(every_layer)
    second = state.get_kv_caches("negative", seq_len=chunk)
    second[0].forward_ctx.prepare(torch.device("cpu"), registers, chunk + registers)  # closes the positive forward
    active = kv.runtime.active
    with pytest.raises(RuntimeError, match="'positive' reused after its forward ended"):
        first[1].forward_ctx.prepare(torch.device("cpu"), registers, chunk + registers)
    assert kv.runtime.active is active, "the open forward changed"
    kv.runtime.active.record_layers(every_layer)
    state.end_invocation()


def test_unconfirmed_commit_fails_the_invocation_closed(omni):
    """A pipeline that runs a commit forward and never confirms it: the runner's invocation raises, the commit is
    rolled back and the session released, and the runtime holds nothing."""
    runner, od = _runner(omni, RUNNER_PATH, model_config=OURS)
    runner.pipeline._kv_commit = lambda is_negative: None  # a pipeline that forgets _kv_commit
    with pytest.raises(RuntimeError, match="'positive' commit forward was not committed"):
        _serve(omni, runner, od, _requests("s", dr.request_inputs(GEOMETRY, 1)))
    runtime = runner.kv_cache.runtime
    assert not runner._sessions and runtime.owner_ids() == [] and runtime.active is None
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer
