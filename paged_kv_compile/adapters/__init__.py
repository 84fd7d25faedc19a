"""Adapters for public model code that cannot be paged as written (each imports its package lazily).

`vllm_omni_hunyuan`: vllm-omni's HunyuanImage-3 `ImageKVCacheManager` (prefix cache built with `.item()`).
`tencent_hunyuan`: cache stand-ins for Tencent's HunyuanImage-3.0 `HunyuanStaticCache` (pages as written).
"""
