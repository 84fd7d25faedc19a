"""The two-rank differential fuzzer (fuzz/ranks.py), short: two gloo ranks through vllm-omni's parallel_state, one
seeded sequence per layout (TP 2, CFG-parallel 2, Ulysses 2), and one put-back defect it must catch. The long run's
command and figures: docs/reliability.md."""

from __future__ import annotations

import pytest

from fuzz import ranks as fuzz_ranks

STEPS = 40
TIMEOUT_S = 900.0  # bounds a hung call only: a loaded machine must never reach it
LAYOUTS = {"tp": {"tensor_parallel_size": 2}, "cfg": {"cfg_parallel_size": 2}, "ulysses": {"ulysses_degree": 2}}
FP8 = {"cfg"}  # one layout on FP8 pools: set_scales accepted while nothing is held, outputs read the scales


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_multirank_fuzz_short_run_finds_nothing_wrong(omni, ranks, layout):
    ranks.setup(**LAYOUTS[layout])
    outs = ranks.run(fuzz_ranks.rank_task, layout, 0, STEPS, None, True, layout in FP8, timeout=TIMEOUT_S)
    for out in outs:
        assert out["wrong"] is None, out
        figures = out["figures"]
        assert figures["operations"] == STEPS and figures["forwards_compared"] > 0, figures
        assert sum(v for k, v in figures.items() if k.startswith("refused_")) > 0, "no refusal was exercised"


def test_multirank_fuzz_catches_a_check_after_the_end_vote(omni, ranks):
    """Defect 3 put back (only the all-layers-wrote check before the end vote): a forward one rank refuses for
    running no paged attention is committed by the other; the fuzzer must report it."""
    ranks.setup(**LAYOUTS["tp"])
    outs = ranks.run(fuzz_ranks.rank_task, "tp", 0, 60, 3, timeout=TIMEOUT_S)
    assert any(out["wrong"] for out in outs), "mutant 3 survived the fuzzer"
