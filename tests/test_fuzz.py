"""The differential fuzzer (`fuzz/differential.py`) in CI.

A short seeded run per family and pool dtype must find nothing while covering every operation; each of defects
1-6 of docs/reliability.md, put back by its mutant (`fuzz/mutants.py`: the fix's hunk reversed), must be found within a
bounded number of operations at a fixed seed, as a wrong answer, a leaked state, a deadlock or a divergence of the
two serving paths naming the operation; and the same operations must pass on the fixed code, so what was found is
the defect. Longer: ``PAGED_KV_FUZZ_STEPS=2000`` (steps of the short runs) or ``python -m fuzz``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fuzz import differential as fuzz  # noqa: E402
from fuzz.differential import Fuzzer, FuzzFailure  # noqa: E402
from fuzz.mutants import mutant  # noqa: E402

STEPS = int(os.environ.get("PAGED_KV_FUZZ_STEPS", "300"))

pytestmark = pytest.mark.usefixtures("no_grad")


# ---- found by the fuzzer -------------------------------------------------------------------------------------


def test_a_hunyuan_request_reset_must_be_prefilled_again_and_reads_its_own_prompt():
    """Found by the fuzzer: `runtime.reset` of a HunyuanImage-3 request freed its prompt blocks but left it
    prefilled, so a step was accepted and read its prompt from scratch blocks (whatever the last forward of any
    owner wrote there), and a prefill after the reset wrote the prompt into scratch (overwritten by the next
    forward): the fuzzer's shrunk case (admit, reset, prefill, step) was 1.44 off dense. Now a reset request must be
    prefilled again, and that prefill takes its prompt blocks back (within the reservation admission made)."""
    from paged_kv_compile import RequestError
    from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec, hunyuan_runtime_config
    from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config
    from paged_kv_compile.runtime import PagedKVRuntime

    cfg = HunyuanImage3Config()
    rt = PagedKVRuntime(hunyuan_runtime_config(cfg, max_prefix=8, block_size=4))
    spec = HunyuanSpec((5,), cfg.target_len, ((1, 1 + cfg.image_tokens),))
    sched = rt.scheduler
    rt.admit("r", spec)
    sched.finish_forward(sched.plan("r", "prefill", prefix_capacity=8, attention_mask=spec.padded_mask(8)))
    rt.reset("r")
    before = rt.state()
    with pytest.raises(RequestError, match="has not been prefilled"):
        rt.forward("r", "step", prefix_capacity=8)
    assert rt.state() == before
    plan = sched.plan("r", "prefill", prefix_capacity=8, attention_mask=spec.padded_mask(8))
    assert all(bool(row.managed[:2].all()) for row in plan.rows), "the prompt is written into blocks of its own"
    sched.finish_forward(plan)
    assert [len(row) for row in rt.owner("r").rows] == [2]
    step = sched.plan("r", "step", prefix_capacity=8)
    assert step.rows[0].table[:2].tolist() == rt.owner("r").rows[0]
    sched.abort_forward(step)
    rt.release("r")
    assert sched.allocator.num_free == rt.pool.blocks_per_layer


def test_the_fuzzers_reset_case_replays_clean():
    """The fuzzer's shrunk operation list of the reset defect, through both families' machinery: clean now."""
    ops = [
        {"op": "admit", "id": "r3", "lens": [6], "seed": 335601, "spec": ["mask", "right", "bool"]},
        {"op": "reset", "id": "r3"},
        {"op": "forward", "items": [["r3", "prefill", {"style": "right", "enc": "bf16.min-in-fp32"}]],
         "seed": 138773, "fault": None},
        {"op": "forward", "items": [["r3", "step", {"enc": "bf16.min-in-fp32", "give_mask": True}]], "seed": 553200,
         "fault": None},
    ]
    stats = Fuzzer("hunyuan_image3").replay(ops)
    assert stats.compared >= 2


# ---- short runs: nothing found, every operation covered ------------------------------------------------------


@pytest.mark.parametrize("family,fp8", [("dreamzero", False), ("hunyuan_image3", False), ("dreamzero", True),
                                        ("hunyuan_image3", True)],
                         ids=["dreamzero", "hunyuan_image3", "dreamzero-fp8", "hunyuan_image3-fp8"])
def test_a_short_run_compares_every_forward_and_finds_nothing(family, fp8):
    fuzzer = Fuzzer(family, seed=0, fp8=fp8)
    graphs = fuzzer.h.backend.frames
    stats = fuzzer.run(STEPS)  # raises FuzzFailure naming the operation if anything is wrong
    kinds = stats.kinds
    assert stats.steps == STEPS and stats.forwards >= STEPS // 4
    assert stats.compared >= stats.forwards, "every forward's outputs were compared with dense"
    assert stats.refusals >= STEPS // 20 and stats.faults >= 2 and stats.retries >= 1, stats
    assert stats.batched >= 3 and stats.id_reuse >= 2 and kinds["admit"] and kinds["release"] and kinds["abort"], stats
    assert kinds["reset"] and kinds["fork"], stats
    if family == "dreamzero":
        assert stats.forks >= 2 and stats.evictions >= 1, stats
    else:
        assert stats.refused_by["AmbiguousMaskValue"] >= 1, "a mask encoding the op cannot express was refused"
    if fp8:
        assert stats.set_scales >= 2 and stats.refused_by["ConfigError"] >= 1, "set_scales refused while held"
    assert stats.worst <= (fuzz.FP8_ATOL if fp8 else fuzz.ATOL) + fuzz.BATCH_INVARIANCE
    # compile hygiene: one graph per (path, bucket, argument kind) at most; no recompiles while serving
    assert fuzzer.h.backend.frames - graphs <= len(fuzzer.signatures), (fuzzer.h.backend.frames - graphs,
                                                                        sorted(map(str, fuzzer.signatures)))


# ---- the defects put back: each is found -----------------------------------------------------------------------

#: defect -> (family, FP8 pool, seed, at most this many operations, what the fuzzer reports). The seeds find the
#: defect early (docs/reliability.md lists after how many operations seeds 0-9 find each).
FOUND = {
    1: ("hunyuan_image3", False, 2, 300, "wrong answer"),  # found after 30 operations
    2: ("dreamzero", False, 1, 200, "divergence"),  # 8
    3: ("hunyuan_image3", False, 4, 400, "wrong answer"),  # 172
    4: ("dreamzero", True, 3, 200, "wrong answer"),  # 15
    5: ("dreamzero", False, 7, 400, "deadlock"),  # 158
    6: ("dreamzero", False, 4, 300, "leaked state"),  # 124
}


@pytest.mark.parametrize("defect", sorted(FOUND))
def test_the_fuzzer_finds_each_defect_put_back(defect):
    family, fp8, seed, bound, kind = FOUND[defect]
    fuzzer = Fuzzer(family, seed, fp8=fp8)
    with mutant(defect), pytest.raises(FuzzFailure) as found:
        fuzzer.run(bound)
    failure = found.value
    assert failure.kind == kind, failure
    assert failure.op == fuzzer.ops[failure.index] and f"at operation {failure.index} " in str(failure)
    # the same operations on the fixed code find nothing: what was found is the defect
    Fuzzer(family, fp8=fp8).replay(fuzzer.ops[: failure.index + 1])


def test_a_failing_operation_list_shrinks_and_still_fails():
    family, fp8, seed, bound, kind = FOUND[4]
    fuzzer = Fuzzer(family, seed, fp8=fp8)
    with mutant(4):
        with pytest.raises(FuzzFailure) as found:
            fuzzer.run(bound)
        ops = fuzzer.ops[: found.value.index + 1]
        short = fuzz.shrink(family, ops, fp8, kind)
        assert len(short) < len(ops)
        assert fuzz.fails(family, short, fp8, kind) is not None
    assert fuzz.fails(family, short, fp8, None) is None, "and passes on the fixed code"
