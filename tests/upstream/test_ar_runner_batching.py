"""Several DreamZero sessions in one model call on our runtime: the call a batched AR runner would make.

Not through the runner: vllm-omni's DreamZero pipeline runs one session per forward and its model refuses batch > 1
on its paged path (docs/vs_vllm_omni.md, "Several sessions in one forward"). What is checked here is the part of
that path below the pipeline: vllm-omni's `CausalWanModel`, handed our stand-ins as a batch of two sessions (one
`runtime.forward_batch` per CFG branch and phase), gives each session what it gives that session alone, through
a 1-frame commit, a denoise, a 2-frame commit and a denoise (`benchmarks.vs_vllm_omni.dreamzero_batched_sessions`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.vs_vllm_omni import dreamzero_batched_sessions  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_two_sessions_in_one_model_call_each_equal_to_alone(omni):
    (row,) = dreamzero_batched_sessions((2,), repeats=1)
    assert row["model_calls_batched"] * 2 == row["model_calls_sequential"] == 16, "one call per branch and phase"
    assert row["max_abs_err_vs_alone"] <= 1e-5, row
