"""Refusals, faults and divergence on two gloo ranks: every rank ends exactly where it started, or none computes.

Each scenario runs vllm-omni's real layers on a `RankRuntime` per rank (rank_scenarios.py) and compares each rank's
whole `runtime.state()` before and after, as the one-rank reliability tests do:
  * a refusal on ONE rank -- an admission its smaller pool cannot reserve (less free memory on that GPU), a forward
    its runtime cannot serve -- is a refusal on every rank; the ranks that had applied or planned it roll back;
  * an exception inside ONE rank's forward rolls the forward back on every rank; afterwards the ranks are still
    in step: a new session on the same runtimes equals one-rank dense eager;
  * a rank whose runtime was changed outside the agreed calls makes every rank raise DivergenceError before any
    block runs (decision digest at every vote; block tables every `digest_every` forwards).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from paged_kv_compile import Bucket, PagedKVRuntime
from paged_kv_compile.distributed import ParallelConfig, RankRuntime
from paged_kv_compile.families.dreamzero import session_blocks_per_row

from . import vllm_omni_cpu as omni_cpu
from .dreamzero_pipeline import DenseKV, PagedKV, run_session
from .hunyuan_pipeline import LAYERS, request_inputs, run_layers
from .multirank import outcome
from .rank_scenarios import HUNYUAN_ONE_RANK, DreamZeroRank, HunyuanRank, start_frame_is_a_value

ATOL = 1e-5
FAULTY_RANK = 1
DIVERGE_AT = 7  # TP 2 runs both branches on every rank: the first call is 6 forwards, the 7th a commit
#: the second call's first forward (a chunk commit) by branches per rank: a call is (commit + 2 steps) per branch
FIRST_CHUNK_COMMIT = {2: 7, 1: 4}


class InjectedFault(RuntimeError):
    """What a test raises inside one rank's forward."""


def _rank() -> int:
    return torch.distributed.get_rank()


class _Recorder(PagedKV):
    """The pipeline's paged KV, recording the runtime state before every forward (to compare after a fault)."""

    def __init__(self, *args, fault_at: int | None = None, arm=None, blocks: dict | None = None, before=None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.count, self.fault_at, self.arm, self.before = 0, fault_at, arm or (lambda on: None), None
        self.blocks, self.blocks_before = blocks or {"blocks": 0}, 0
        self.on_forward = before or (lambda count: None)  # runs before forward `count` (1-based) is planned

    @contextlib.contextmanager
    def _forward_recorded(self, kind, branch):
        self.count += 1
        self.on_forward(self.count)
        self.before, self.blocks_before = self.runtime.state(), self.blocks["blocks"]
        self.arm(self.count == self.fault_at and _rank() == FAULTY_RANK)
        with PagedKV.forward(self, kind, branch):
            yield

    def forward(self, kind, branch):
        return self._forward_recorded(kind, branch)


def _other_rank_runtime(rank: DreamZeroRank, **changes) -> None:
    """Give FAULTY_RANK a runtime whose config differs by `changes` (say a smaller pool: less free memory on that
    GPU); the other rank gets the planned one."""
    parallel = ParallelConfig.from_vllm_omni()
    cfg = parallel.rank_config(rank.one_rank)
    if _rank() == FAULTY_RANK:
        cfg = dataclasses.replace(cfg, **changes)
    rank.runtime.close()  # unbinds the model's layers
    rank.runtime = RankRuntime(PagedKVRuntime(cfg), parallel, digest_every=1)
    rank.runtime.bind(rank.model.blocks)


# ---- rank tasks -------------------------------------------------------------------------------------------


def dreamzero_fault_task(state: dict, where: str) -> dict:
    """A session whose first chunk commit (the second call's first forward: new blocks taken) raises on rank 1 only,
    `where`: inside block 1 (after block 0 wrote its K/V) or in the head after the last block (after every TP
    all-reduce). Then a fresh session on the same runtimes."""
    with omni_cpu.model_context():
        rank = DreamZeroRank(state, digest_every=1)
        armed = {"on": False}

        def hook(*_):
            if armed["on"]:
                raise InjectedFault(f"injected on rank {_rank()} in {where}")

        target = rank.model.blocks[1] if where == "block" else rank.model.head
        target.register_forward_pre_hook(hook)
        rank.admit("s")
        kv = _Recorder(rank.model, rank.runtime, "s", lambda kind, branch: rank.forward("s", kind, branch),
                       fault_at=FIRST_CHUNK_COMMIT[len(rank.branches)], arm=lambda on: armed.update(on=on))
        with torch.no_grad(), start_frame_is_a_value():
            result = outcome(lambda: run_session(rank.model, kv, calls=3))
        after = rank.runtime.state()
        armed["on"] = False
        rank.runtime.release("s")  # the pool reserves one session's loop
        rank.admit("s2")
        with torch.no_grad(), start_frame_is_a_value():
            clean = run_session(rank.model, rank.kv("s2"), calls=3)
        rank.runtime.release("s2")
        return {"outcome": result, "before": kv.before, "after": after, "failed_at": kv.count,
                "clean_video": clean["video"], "clean_actions": clean["actions"], **rank.report()}


def dreamzero_refusal_task(state: dict) -> dict:
    """Refusals on rank 1 only, each one on both ranks with every rank's state unchanged: an admission its smaller
    pool cannot reserve, then a forward its runtime cannot serve (its buckets lack the chunk commit's shape: the
    forward is refused before compute, after rank 0 had planned it)."""
    with omni_cpu.model_context():
        rank = DreamZeroRank(state)
        rows = len(rank.branches)
        per_row = session_blocks_per_row(rank.spec, rank.runtime.config.block_size)  # what admission reserves
        _other_rank_runtime(rank, blocks_per_layer=per_row * rows - 1)
        out = {}
        before = rank.runtime.state()
        out["admit"] = outcome(lambda: rank.admit("too-big"))
        out["admit_unchanged"] = rank.runtime.state() == before
        chunk_commit = Bucket(rows, rank.spec.chunk_tokens, rank.spec.window_tokens)
        _other_rank_runtime(rank, buckets=tuple(b for b in rank.runtime.config.buckets if b != chunk_commit))
        rank.admit("a")
        kv = _Recorder(rank.model, rank.runtime, "a", lambda kind, branch: rank.forward("a", kind, branch))
        with torch.no_grad(), start_frame_is_a_value():
            out["forward"] = outcome(lambda: run_session(rank.model, kv, calls=2))
        out["refused_at"] = kv.count
        out["forward_unchanged"] = rank.runtime.state() == kv.before
        rank.runtime.release("a")
        out["state"] = rank.runtime.state()
        return out


def dreamzero_divergence_task(state: dict, digest_every: int) -> dict:
    """Before the 7th forward (the second call's first commit), rank 1 changes its runtime behind the group's
    back; a forward then raises DivergenceError on both ranks before any of its blocks runs, changing nothing."""
    with omni_cpu.model_context():
        rank = DreamZeroRank(state, digest_every=digest_every)
        blocks = {"blocks": 0}
        rank.model.blocks[0].register_forward_pre_hook(lambda *_: blocks.__setitem__("blocks", blocks["blocks"] + 1))
        inner = rank.runtime.runtime

        def diverge(count: int) -> None:
            if count != DIVERGE_AT or _rank() != FAULTY_RANK:
                return
            if digest_every == 1:  # the decision state: rank 1 resets the window alone (its version moves on)
                inner.reset("s")
            else:  # block tables only: same owners and free count, but its next commit gets other block ids
                inner.scheduler.allocator.free(inner.scheduler.allocator.allocate(2)[::-1])

        rank.admit("s")
        kv = _Recorder(rank.model, rank.runtime, "s", lambda kind, branch: rank.forward("s", kind, branch),
                       blocks=blocks, before=diverge)
        with torch.no_grad(), start_frame_is_a_value():
            result = outcome(lambda: run_session(rank.model, kv, calls=3))
        return {"outcome": result, "detected_at": kv.count, "blocks_in_failed_forward": blocks["blocks"] - kv.blocks_before,
                "before": kv.before, "after": rank.runtime.state()}


def hunyuan_fault_task(states: list[dict]) -> dict:
    """TP 2 HunyuanImage-3: rank 1 raises after its last layer (after every all-reduce) in the first step, inside the
    forward (a module hook would be traced into the compiled layer); then a refusal on rank 1 only (prompts its
    smaller pool cannot hold)."""
    with omni_cpu.model_context(), omni_cpu.hunyuan_fp32_rope():
        rank = HunyuanRank(states)
        req = request_inputs()
        armed = {"on": False}

        @contextlib.contextmanager
        def faulty(phase, mask):  # the rank's forward, raising after its last layer (after every all-reduce)
            with rank.around("r")(phase, mask):
                yield
                if armed["on"] and _rank() == FAULTY_RANK:
                    raise InjectedFault(f"injected on rank {_rank()} after the last layer")

        rank.admit("r", req)
        out = {}
        run_layers(rank.layers, dict(req, hidden=req["hidden"][:1]), rank.around("r"), autocast=None)  # the prefill
        before = rank.runtime.state()
        armed["on"] = True
        first_step = dict(req, hidden=req["hidden"][:2])
        out["fault"] = outcome(lambda: run_layers(rank.layers, first_step, faulty, autocast=None, start=1))
        out["fault_unchanged"] = rank.runtime.state() == before
        armed["on"] = False
        rank.runtime.release("r")
        # rank 1 with a pool too small for the request's prefixes: admission refused on both
        parallel = ParallelConfig.from_vllm_omni()
        cfg = parallel.rank_config(HUNYUAN_ONE_RANK)
        if _rank() == FAULTY_RANK:
            cfg = dataclasses.replace(cfg, blocks_per_layer=2)
        small = RankRuntime(PagedKVRuntime(cfg), parallel)
        before = small.state()
        spec = rank.adapter.spec(req["mask"], req["scatter"], req["step"]["position_ids"].shape[1])
        out["admit"] = outcome(lambda: small.admit("r2", spec))
        out["admit_unchanged"] = small.state() == before
        out["state"] = rank.runtime.state()
        return out


# ---- tests ----------------------------------------------------------------------------------------------------


def _one_rank_dense(omni, calls: int = 3):
    model = omni.tiny_dreamzero_model()
    with torch.no_grad():
        return model.state_dict(), run_session(model, DenseKV(model), calls=calls)


def _check_fault(outs: list[dict], one: dict, branches: int) -> None:
    for r, out in enumerate(outs):
        assert out["failed_at"] == FIRST_CHUNK_COMMIT[branches], "the fault hit the chunk commit"
        name, message = out["outcome"]
        if r == FAULTY_RANK:
            assert name == "InjectedFault", out["outcome"]
        else:
            assert name == "RankFaultError" and f"rank {FAULTY_RANK} failed" in message and "InjectedFault" in message
        assert out["after"] == out["before"], f"rank {r}: the failed forward changed the runtime state"
        err = max(float((out[f"clean_{k}"] - one[k]).abs().max()) for k in ("video", "actions"))
        assert err <= ATOL, f"rank {r}: the session after the fault is not exact ({err:.2e})"
    assert outs[0]["state"] == outs[1]["state"]


def test_cfg_parallel_fault_inside_one_ranks_block_rolls_back_every_rank(omni, omni_ctx, ranks):
    state, one = _one_rank_dense(omni)
    ranks.setup(cfg_parallel_size=2)
    _check_fault(ranks.run(dreamzero_fault_task, state, "block"), one, branches=1)


def test_tensor_parallel_fault_after_one_ranks_last_collective_rolls_back_every_rank(omni, omni_ctx, ranks):
    state, one = _one_rank_dense(omni)
    ranks.setup(tensor_parallel_size=2)
    _check_fault(ranks.run(dreamzero_fault_task, state, "head"), one, branches=2)


def test_cfg_parallel_refusal_on_one_rank_is_a_refusal_on_every_rank(omni, omni_ctx, ranks):
    state, _ = _one_rank_dense(omni, calls=1)
    ranks.setup(cfg_parallel_size=2)
    outs = ranks.run(dreamzero_refusal_task, state)
    assert [out["refused_at"] for out in outs] == [FIRST_CHUNK_COMMIT[1]] * 2, "refused at the chunk commit"
    for r, out in enumerate(outs):
        for what, error in (("admit", "CapacityError"), ("forward", "RequestError")):
            name, message = out[what]
            assert name == error, (r, what, out[what])
            if r != FAULTY_RANK:
                assert f"rank {FAULTY_RANK} refused" in message and "Every rank refused it" in message
            assert out[f"{what}_unchanged"], f"rank {r}: the refused {what} changed the runtime state"
    assert outs[0]["state"] == outs[1]["state"]


def test_multirank_divergent_rank_raises_everywhere_before_computing(omni, omni_ctx, ranks):
    """Decision state (digest at every vote): caught at the very forward it diverges before. Block tables (compared
    every 2nd forward): the 7th forward's commit takes other block ids on rank 1, which its plan's geometry (compared
    at every forward) shows at once; it used to be caught by the 9th. Either way the forward that caught it ran no
    block on any rank and changed nothing."""
    state, _ = _one_rank_dense(omni, calls=1)
    ranks.setup(tensor_parallel_size=2)
    for digest_every, what, caught_by in ((1, "decision state differs", DIVERGE_AT),
                                          (2, "identical block tables", DIVERGE_AT)):
        outs = ranks.run(dreamzero_divergence_task, state, digest_every)
        for r, out in enumerate(outs):
            name, message = out["outcome"]
            assert name == "DivergenceError" and what in message, (r, out["outcome"])
            assert out["detected_at"] == caught_by, out["detected_at"]
            assert out["blocks_in_failed_forward"] == 0, "a block ran in the forward that detected the divergence"
            assert out["after"] == out["before"], "the refused forward changed the runtime state"


def test_tensor_parallel_hunyuan_fault_and_refusal_leave_both_ranks_unchanged(omni, omni_ctx, ranks):
    states = [omni.tiny_hunyuan_layer(seed=10 + i, layer_idx=i).state_dict() for i in range(LAYERS)]
    ranks.setup(tensor_parallel_size=2)
    outs = ranks.run(hunyuan_fault_task, states)
    for r, out in enumerate(outs):
        assert out["fault"][0] == ("InjectedFault" if r == FAULTY_RANK else "RankFaultError"), out["fault"]
        assert out["fault_unchanged"] and out["admit_unchanged"]
        assert out["admit"][0] == "CapacityError", out["admit"]
    assert outs[0]["state"] == outs[1]["state"]
