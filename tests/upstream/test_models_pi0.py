"""vllm-omni 0.30.0's pi0 and pi0.5: their attention function read as the SDPA it computes, and pi0's own model and
pipeline paged as they run.

`vllm_omni/diffusion/models/pi0/modeling_pi0.py: _attend` is hand-written attention (its own `_repeat_kv` by
expand + reshape, ``matmul(q, k.transpose(2, 3)) * scaling``, an additive mask sliced to the key length, a float32
softmax cast back, ``matmul(probs, v)``), used by pi0 over a prefix of K/V computed once and every flow-matching
step's suffix. The first test calls it unchanged as the attention of our HunyuanImage-3 reference's prefix idiom.

The others drive pi0 itself (`pi0_pipeline.py`: the real classes at tiny sizes, random weights, fp32):
`sample_actions` and `Pi0Pipeline.forward` unchanged, the prefix forward dense with its returned K/V stored once
in a conditioning-prefix request (`families/conditioning_prefix.py`), every step's
``cat([k_prefix.to(dtype), k_suf], dim=2)`` + `_attend` compiled paged (the prefix-step idiom with pi0's own
additive mask, checked against the request's layout before every step and, with `check_mask`, as the graph sees it).
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, hunyuan_qkv_cached
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


# ---- pi0's own model and pipeline, paged (pi0_pipeline.py) ----------------------------------------------------


def _pi0_runtime(model, rows: int):
    from paged_kv_compile import PagedKVConfig, PagedKVRuntime

    expert = model.paligemma_with_expert.gemma_expert.config
    return PagedKVRuntime(PagedKVConfig(num_layers=expert.num_hidden_layers, num_kv_heads=expert.num_key_value_heads,
                                        head_dim=expert.head_dim, block_size=4, blocks_per_layer=32, max_rows=rows,
                                        scratch_tokens_per_row=16, kernel="reference"))


def _assert_every_site_paged(backend, layers: int) -> None:
    reports = [r for res in backend.results for r in res.reports]
    assert backend.frames == 2  # one per bucket: the prefix forward (compiled dense: no stand-in) and the steps
    assert len(reports) == layers and all(r.status == "rewritten" and r.pattern == "prefix-step" for r in reports)


@pytest.mark.parametrize("which", ["pi0", "pi05"])
def test_pi0_sample_actions_pages_its_flow_matching_steps(omni, which):
    """Two rows with different padding inside the prefix (the empty camera slot differs, and the prompt length):
    `sample_actions` unchanged, its prefix stored once per request and released with it. pi0.5 (AdaRMS-conditioned
    expert, no state token) the same way."""
    from .pi0_pipeline import IMAGE_TOKENS, Pi0PagedDriver, observation, tiny_pi0

    model = tiny_pi0(which)
    obs = observation(model, cameras=[[True, False, True], [False, True, True]], prompt_lens=[3, 5])
    with torch.no_grad():
        dense = model.sample_actions(**obs.arguments(model))
        runtime = _pi0_runtime(model, rows=2)
        free = runtime.state()["num_free"]
        backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True, "check_mask": True})
        driver = Pi0PagedDriver(model, runtime, backend=backend)
        held = []
        store = driver._store_prefix

        def store_once(*a, **k):
            out = store(*a, **k)
            held.append([len(row) for row in runtime.owner(driver.request_ids[-1]).rows])
            return out

        driver._store_prefix = store_once
        with driver.installed():
            paged = model.sample_actions(**obs.arguments(model))
    diff = (dense - paged).abs().max().item()
    print(f"{which} sample_actions paged ({driver.steps} steps, 2 rows): max abs diff {diff:.3g}, "
          f"frames {backend.frames}")
    assert diff <= ATOL
    assert driver.steps == model.num_inference_steps
    _assert_every_site_paged(backend, layers=2)
    spec = driver.specs[0]
    assert spec.prefix_lens == (2 * IMAGE_TOKENS + 3, 2 * IMAGE_TOKENS + 5)  # the real prefix tokens, pads not stored
    T = model.action_horizon + (which == "pi0")  # pi0's suffix leads with its state token
    assert spec.new_visible == ((1,) + (T,) * (T - 1) if which == "pi0" else (T,) * T)
    assert held == [[-(-p // 4) for p in spec.prefix_lens]]  # stored once, in the request's own blocks
    assert runtime.owner_ids() == [] and runtime.state()["num_free"] == free  # released with the request


def test_pi0_pipeline_forward_pages_as_served(omni):
    """`Pi0Pipeline.forward` unchanged, on a robot observation as OpenPI serving sends it (one camera of three
    missing, the pipeline's own preprocessing, state padding and normalization): the actions it returns, paged."""
    import numpy as np
    from .pi0_pipeline import Pi0PagedDriver, camera_image, robot_request, tiny_pi0, tiny_pipeline

    model = tiny_pi0()
    pipeline = tiny_pipeline(model, cameras=("base", "left_wrist", "right_wrist"), prompt_capacity=12)
    request = robot_request(model, images={"base": camera_image(0), "right_wrist": camera_image(1)}, prompt="pick")
    dense = pipeline.forward(request).output["actions"]
    runtime = _pi0_runtime(model, rows=1)
    backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True, "check_mask": True})
    driver = Pi0PagedDriver(model, runtime, backend=backend)
    with driver.installed():
        paged = [pipeline.forward(request).output["actions"] for _ in range(2)]  # two requests, one frame
    diff = max(float(np.abs(dense - p).max()) for p in paged)
    print(f"pi0 pipeline.forward paged (2 requests): max abs diff {diff:.3g}, frames {backend.frames}")
    assert dense.shape == (model.action_horizon, model.action_dim)
    assert diff <= ATOL
    _assert_every_site_paged(backend, layers=2)
    assert len(driver.request_ids) == 2 and runtime.owner_ids() == []


def test_pi0_step_visibility_other_than_its_mask_is_refused(omni):
    """A request whose layout says every suffix token sees every other (the family's default) disagrees with the
    mask pi0 builds (its state token does not see the actions): refused before the step, nothing computed, and
    the request's blocks return to the pool when it is released."""
    from .pi0_pipeline import Pi0PagedDriver, observation, tiny_pi0

    from paged_kv_compile import RequestError

    model = tiny_pi0()
    obs = observation(model, cameras=[[True, True]], prompt_lens=[4])
    runtime = _pi0_runtime(model, rows=1)
    free = runtime.state()["num_free"]
    backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
    T = model.action_horizon + 1
    driver = Pi0PagedDriver(model, runtime, backend=backend, new_visible=(T,) * T)
    with pytest.raises(RequestError, match=r"the step's mask disagrees with the request's layout \(query 0, key "
                                           r"column \d+: mask False, layout True\)"):
        with torch.no_grad(), driver.installed():
            model.sample_actions(**obs.arguments(model))
    assert backend.frames == 1 and driver.steps == 1  # the prefix forward's frame; the step never compiled
    assert all(not res.sites for res in backend.results)
    assert runtime.owner_ids() == [] and runtime.state()["num_free"] == free
