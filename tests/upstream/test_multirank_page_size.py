"""Two gloo ranks (vllm-omni's parallel_state) serving DreamZero at block sizes that divide neither the frame nor the
chunk: the two-rank differential fuzzer (fuzz/ranks.py) on a geometry whose window starts inside a block and whose
sink ends inside one (so rows carry a kv_gap), under TP 2 and CFG-parallel 2. Every rank's outputs equal the one-rank
runtime's, every refusal changes nothing on any rank, the ranks agree on every block table."""

from __future__ import annotations

import pytest

from fuzz import ranks as fuzz_ranks
from paged_kv_compile.families.dreamzero import RowWindow, history_tokens

STEPS = 40
TIMEOUT_S = 900.0  # bounds a hung call only: a loaded machine must never reach it
LAYOUTS = {"tp": {"tensor_parallel_size": 2}, "cfg": {"cfg_parallel_size": 2}}
GEOMETRY = (5, 1, 1, 2)  # frames of 5 tokens, chunk 1 frame, a 1-frame sink, blocks of 2


def test_multirank_page_size_geometry_has_gaps():
    """The geometry below is one where the layout needs kv_gap (checked on the window rule itself)."""
    frame, chunk, sink, block = GEOMETRY
    cfg = fuzz_ranks.CFG.__class__(**{**fuzz_ranks.CFG.__dict__, "frame_seqlen": frame, "num_frame_per_block": chunk,
                                      "sink_size": sink})
    spec = fuzz_ranks.DreamZeroSpec.from_model_config(cfg)
    gaps = []
    for commits in range(1, 8):
        w = RowWindow.of(spec, history_tokens(spec, commits), block, spec.chunk_tokens)
        gaps.append(w.logical(w.first_recent)[1])
    assert frame % block and any(g != (0, 0) for g in gaps), gaps


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_multirank_page_size_fuzz_finds_nothing_wrong(omni, ranks, layout):
    ranks.setup(**LAYOUTS[layout])
    outs = ranks.run(fuzz_ranks.rank_task, layout, 0, STEPS, None, True, False, GEOMETRY, timeout=TIMEOUT_S)
    for out in outs:
        assert out["wrong"] is None, out
        figures = out["figures"]
        assert figures["operations"] == STEPS and figures["forwards_compared"] > 0, figures
