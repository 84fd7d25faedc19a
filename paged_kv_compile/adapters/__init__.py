"""Adapters for public model code that cannot be paged as written (each imports its package lazily).

`vllm_omni_hunyuan`: vllm-omni's HunyuanImage-3 `ImageKVCacheManager` (prefix cache built with `.item()`).
`tencent_hunyuan`: cache stand-ins for Tencent's HunyuanImage-3.0 `HunyuanStaticCache` (pages as written).
`vllm_omni_ar_diffusion`: our runtime as the session KV state vllm-omni's DreamZero pipeline drives (no vllm import).
`vllm_omni_ar_lingbot`: the same for vllm-omni's LingBot-World pipeline (its cursor stand-ins, its sink check; no
vllm import).
`vllm_omni_ar_runner`: vllm-omni's `ARDiffusionModelRunner` over those states, chosen by `diffusion_model_runner_cls`
(imports vllm-omni; docs/vs_vllm_omni.md).
`vllm_omni_ar_capture`: that runner's graph capture at startup (`cuda_graphs: block`; no vllm import).
`vllm_omni_ar_batch`: that runner's `execute_model_batch` (several sessions per forward, `max_num_seqs > 1`);
`vllm_omni_ar_lockstep`: the pipeline loops it runs in lockstep, model calls batched (no vllm import).
"""
