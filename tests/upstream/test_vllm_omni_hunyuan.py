"""vllm-omni's real HunyuanImage-3 decoder layers, paged through `paged_kv_compile.adapters.vllm_omni_hunyuan`.

Driven as vllm-omni's pipeline_hunyuan_image3.py drives them: bf16 under CPU autocast, CFG rows RIGHT-padded
([prompt | timestep + image | <eoi> | pad], the mask of `_prepare_attention_mask_for_generation`: causal with
each image span bidirectional), RoPE tables from `build_batch_2d_rope` gathered by position (`get_pos_emb`),
and every later step's position_ids and mask made by the pipeline's own `_update_model_kwargs_for_generation`
(the <eoi> the prefill has is not fed again). The paged run must match dense eager within what dense
compilation itself changes (bf16).
"""

from __future__ import annotations

import pytest
import torch

from paged_kv_compile import PagedKVConfig, PagedKVRuntime
from paged_kv_compile.adapters import vllm_omni_hunyuan

from .hunyuan_pipeline import LENS, LAYERS, max_err, request_inputs, run_layers, tiny_layers

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_vllm_omni_hunyuan_pages_right_padded_cfg_rows(omni, omni_ctx):
    from helpers import CountingBackend, compile_blocks

    req = request_inputs()
    # every prefill token of every row is a real or causal-pad token: all are compared
    valid = torch.ones(len(LENS), req["mask"].shape[-1], dtype=torch.bool)
    dense = run_layers(tiny_layers(omni), req)

    compiled = tiny_layers(omni)
    for layer in compiled:
        layer.compile(backend="inductor", dynamic=False)  # dense, as written (graph breaks at the .item() cache)
    bound = max_err(dense, run_layers(compiled, req), valid)
    torch._dynamo.reset()

    layers = tiny_layers(omni)
    runtime = PagedKVRuntime(PagedKVConfig(num_layers=LAYERS, num_kv_heads=2, head_dim=8, block_size=4,
                                           blocks_per_layer=8, max_rows=2, scratch_tokens_per_row=16,
                                           dtype=torch.bfloat16, kernel="reference"))
    adapter = vllm_omni_hunyuan.install(layers, runtime)
    backend = CountingBackend({"inner_compiler": "aot_eager", "check_mask": True})
    compile_blocks(torch.nn.ModuleList(layers), backend)
    spec = adapter.spec(req["mask"], req["scatter"], req["step"]["position_ids"].shape[1])
    runtime.admit("r", spec)

    def around(phase, mask):
        return adapter.forward("r", phase=phase, attention_mask=mask)

    paged = run_layers(layers, req, around)
    runtime.release("r")
    err = max_err(dense, paged, valid)
    print(f"vllm-omni HunyuanImage-3 paged vs dense eager: max {err:.3e}; dense compiled vs eager: {bound:.3e}")
    assert err <= max(bound, 2 ** -8)  # bf16: within what dense compilation changes (floor: one bf16 ulp at 1)
    # Both layers share each frame. The step bucket compiles twice because the dense code itself differs
    # between the first step and later ones: HunYuanRotary2DEmbedder caches the step's cos/sin on itself
    # (`self.custom_pos_emb`) at the first step and reads the cache afterwards.
    assert backend.frames == 3
    patterns = sorted(r.pattern for res in backend.results for r in res.reports)
    assert patterns == ["prefill-store"] + ["prefix-step"] * 2
    assert all(r.status == "rewritten" for res in backend.results for r in res.reports)
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer
