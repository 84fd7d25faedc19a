"""How far vllm-omni's own HunyuanImage-3 paged KV (`diffusion_kv`, `diffusion_kv_mode="paged_scheduler"`) runs here.

Driven as its runner and scheduler drive it, step by step, on the tiny decoder layers of `hunyuan_pipeline`:
the layers built in paged mode (their `Attention` resolves the paged-capable FLASH_ATTN selector), the worker's
vLLM config (`create_diffusion_vllm_config`), `DiffusionModelRunner.get_kv_cache_spec` (registers each layer
with vLLM's native attention: on this CPU vLLM resolves FLASH_ATTN to CPU_ATTN), `set_kv_cache_config`
(native KV tensors and vLLM's GPU-runner `BlockTables`), the scheduler's `DiffusionKVCacheManager.reserve_request`
for the two CFG rows, `install_diffusion_kv_metadata`, then prefill + steps under the runner's forward context.

`probe(uva=...)` returns the steps reached and where it stopped. vLLM reports UVA available here, so its
`BlockTables` allocates pinned buffers and fails; `uva=False` takes vLLM's own non-UVA fallback
(`NonUvaBuffer`) to see the next wall: `BlockTables` writes its rows with Triton kernels
(`vllm/v1/worker/gpu/buffer_utils.py: _apply_write_kernel`, `block_table.py: _gather_block_tables_kernel`), and
vLLM disables Triton on a machine without a GPU driver (`vllm.triton_utils.HAS_TRITON` is False), which leaves
those kernels as plain placeholder functions.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from . import hunyuan_pipeline as hp
from . import vllm_omni_cpu


def probe(*, uva: bool = True) -> dict[str, Any]:
    vllm_omni_cpu.install()
    vllm_omni_cpu.init_distributed()
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm_omni.diffusion.data import TransformerConfig
    from vllm_omni.diffusion.diffusion_kv.config import DiffusionKVCacheMode
    from vllm_omni.diffusion.diffusion_kv.layout import build_kv_cache_tensor
    from vllm_omni.diffusion.diffusion_kv.manager import DiffusionKVCacheManager
    from vllm_omni.diffusion.diffusion_kv.request import DiffusionKVRequest
    from vllm_omni.diffusion.forward_context import set_forward_context, set_forward_context_denoise_step_idx
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    reached: list[str] = []
    od = vllm_omni_cpu.diffusion_config(
        tf_model_config=TransformerConfig.from_dict(vllm_omni_cpu.tiny_hunyuan_config().to_dict()),
        dtype=torch.bfloat16, diffusion_kv_mode=DiffusionKVCacheMode.PAGED_SCHEDULER,
        diffusion_kv_max_rows_per_request=len(hp.LENS), max_model_len=64,
    )
    step = "worker vLLM config"
    saved_uva = buffer_utils.is_uva_available
    try:
        if not uva:
            buffer_utils.is_uva_available = lambda: False
        vc = create_diffusion_vllm_config(torch.device("cpu"), od)
        reached.append(step)
        with vllm_omni_cpu.model_context(od), set_current_vllm_config(vc):
            step = "layers in paged mode"
            layers = [vllm_omni_cpu.tiny_hunyuan_layer(seed=10 + i, layer_idx=i) for i in range(hp.LAYERS)]
            runner = DiffusionModelRunner(vc, od, torch.device("cpu"))
            runner.pipeline = torch.nn.ModuleList(layers)
            reached.append(step)
            step = "get_kv_cache_spec (native attention per layer)"
            specs = runner.get_kv_cache_spec()
            names = list(specs)
            spec = specs[names[0]]
            backend = runner.diffusion_kv_backend._kv_cache_layer_adapters[names[0]].attn_backend.get_name()
            reached.append(f"{step}: {len(names)} layers, block_size {spec.block_size}, native backend {backend}")
            step = "set_kv_cache_config (native KV + BlockTables)"
            blocks = 16
            config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[build_kv_cache_tensor(spec, blocks, [n])
                                                                        for n in names],
                                   kv_cache_groups=[KVCacheGroupSpec(names, spec)])
            runner.set_kv_cache_config(config)
            reached.append(step)
            step = "scheduler reserve_request (two CFG rows)"
            from vllm.v1.core import single_type_kv_cache_manager

            single_type_kv_cache_manager.register_all_kvcache_specs(vc)  # as initialization.py's control plane does
            manager = DiffusionKVCacheManager(config, max_model_len=64, scheduler_block_size=spec.block_size,
                                              hash_block_size=spec.block_size)
            req = hp.request_inputs()
            target = req["step"]["position_ids"].shape[1]
            rows = tuple(DiffusionKVRequest(f"r/diffusion-kv/{i}", sequence_id=i, prefix_len=p, target_len=target,
                                            seq_len=p + target + 1) for i, p in enumerate(hp.LENS))
            metadata = manager.reserve_request("r", rows)
            reached.append(step)
            step = "install_diffusion_kv_metadata"
            runner.install_diffusion_kv_metadata(metadata)
            reached.append(step)
            step = "prefill + steps"
            paged = runner._build_paged_attention_metadata([metadata])
            rt, ctx = runner.diffusion_kv_backend.activate_paged_attention_metadata(paged)
            outs = []
            with set_forward_context(vllm_config=vc, omni_diffusion_config=od, paged_kv_runtime=rt), ctx:
                for i, hidden in enumerate(req["hidden"]):
                    set_forward_context_denoise_step_idx(i)
                    kwargs = hp.layer_kwargs(req, i == 0)
                    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                        for layer in layers:
                            (hidden,) = layer(hidden, **kwargs)
                    outs.append(hidden.float())
            reached.append(step)
            return {"reached": reached, "stopped_at": None, "error": None, "outputs": outs}
    except Exception as exc:  # noqa: BLE001 - the point is to report where it stops
        from vllm.triton_utils import HAS_TRITON  # False here: vLLM finds no active GPU driver for Triton

        return {"reached": reached, "stopped_at": step, "error": f"{type(exc).__name__}: {exc}"[:300],
                "vllm_has_triton": HAS_TRITON}
    finally:
        buffer_utils.is_uva_available = saved_uva
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
