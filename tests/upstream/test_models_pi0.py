"""pi0's (and pi0.5's) attention function as vllm-omni 0.30.0 wrote it, read by the passes as the SDPA it computes.

`vllm_omni/diffusion/models/pi0/modeling_pi0.py: _attend` is hand-written attention (its own `_repeat_kv` by
expand + reshape, ``matmul(q, k.transpose(2, 3)) * scaling``, an additive mask sliced to the key length, a float32
softmax cast back, ``matmul(probs, v)``), used by pi0 over a prefix of K/V computed once and every flow-matching
step's suffix. Here it is the attention of our HunyuanImage-3 reference's prefix idiom (a prefix stored at the
prefill and concatenated before every step's keys, with its mask): the function is called unchanged.
What this does not show: pi0's own model and pipeline paged (its prefix K/V are a Python list the pipeline passes
back, not a cache the runtime hands in; docs/models.md).
"""

from __future__ import annotations

import pytest
import torch
from helpers import hunyuan_qkv_cached
from test_pass_matching import ATOL, _run_hunyuan

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _with_pi0_attend(attend):
    def forward(self, hidden_states, rope_cos, rope_sin, attention_mask, past_key_value, prefix_valid, mode):
        b, s, _ = hidden_states.shape
        q, k, v = hunyuan_qkv_cached(self, hidden_states, rope_cos, rope_sin, past_key_value, prefix_valid, mode)
        additive = torch.zeros(attention_mask.shape, dtype=q.dtype).masked_fill(~attention_mask, float("-inf"))
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), additive, self.n_rep,
                     self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    return forward


@pytest.mark.parametrize("module", ["pi0.modeling_pi0", "pi05.modeling_pi05"])
def test_pi0_attend_pages_as_written_in_a_prefix_attention(omni, monkeypatch, module):
    """pi0's and pi0.5's own copies of `_attend` (each module has its own)."""
    import importlib

    attend = importlib.import_module(f"vllm_omni.diffusion.models.{module}")._attend
    dense, paged, backend = _run_hunyuan(monkeypatch, _with_pi0_attend(attend), {"inner_compiler": "aot_eager"})
    diff = (dense - paged).abs().max().item()
    print(f"{module} _attend in a prefix attention: max abs diff {diff:.3g}, frames {backend.frames}")
    assert diff <= ATOL
    assert backend.frames == 2  # one per bucket: the prefill and the steps
    assert sorted(r.pattern for res in backend.results for r in res.reports) == ["prefill-store", "prefix-step"]
    assert all(r.status == "rewritten" for res in backend.results for r in res.reports)
