"""vllm-omni 0.30.0's Cosmos3 (`Cosmos3VFMTransformer`, the real class at tiny size), driven by its pipeline's CFG
loop (`cosmos3_pipeline.py`): the understanding tower's text K/V, computed once per CFG branch and kept in
`cached_kv`, stored once in a conditioning-prefix request per branch; every step's GEN cross-attention,
``cat([k_und, k])`` with no mask through vllm-omni's `Attention`, compiled paged.

Its pipeline module cannot be imported here (it pulls vllm-omni's OpenAI entrypoints and engine: `janus` and
torchvision are not in the lock); the last test pins that blocker, so that it fails the day it goes away.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import CountingBackend

from paged_kv_compile import PagedKVConfig, PagedKVRuntime

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_grad")

ATOL = 1e-5
LATENT_SHAPE = (1, 4, 2, 4, 4)  # (B, C, t, h, w): 2 latent frames of 2x2 patches, 8 GEN tokens
COND_LEN, UNCOND_LEN, PROMPT_CAPACITY = 5, 3, 7


def _runtime(transformer) -> PagedKVRuntime:
    return PagedKVRuntime(PagedKVConfig(num_layers=transformer.num_hidden_layers,
                                        num_kv_heads=transformer.num_key_value_heads, head_dim=transformer.head_dim,
                                        block_size=4, blocks_per_layer=16, max_rows=1, scratch_tokens_per_row=16,
                                        kernel="reference"))


def test_cosmos3_cfg_denoising_pages_its_gen_layers(omni):
    """Two CFG branches of different prompt lengths, 3 steps: the transformer's outputs paged vs dense eager."""
    from .cosmos3_pipeline import Cosmos3PagedDriver, cfg_denoise, diffusion_config, prompt, tiny_cosmos3

    od_config = diffusion_config(omni)
    with omni.model_context(od_config):
        transformer = tiny_cosmos3(od_config)
        latents = torch.randn(LATENT_SHAPE, generator=torch.Generator().manual_seed(3))
        cond = prompt(COND_LEN, PROMPT_CAPACITY, seed=4)
        uncond = prompt(UNCOND_LEN, PROMPT_CAPACITY, seed=5)
        dense = cfg_denoise(transformer, latents, cond, uncond, steps=3)
        runtime = _runtime(transformer)
        free = runtime.state()["num_free"]
        backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
        driver = Cosmos3PagedDriver(transformer, runtime, backend=backend)
        with driver.installed():
            paged = cfg_denoise(transformer, latents, cond, uncond, steps=3)
            held = [[len(row) for row in runtime.owner(r).rows] for r in driver.requests]
    diff = (dense - paged).abs().max().item()
    print(f"cosmos3 CFG denoising paged (3 steps, 2 branches): max abs diff {diff:.3g}, frames {backend.frames}")
    assert diff <= ATOL
    assert driver.requests == ["cosmos3-0", "cosmos3-1"] and driver.steps == 6  # one request per branch
    assert held == [[-(-COND_LEN // 4)], [-(-UNCOND_LEN // 4)]]  # each branch's prefix stored once
    reports = [r for res in backend.results for r in res.reports]
    # one per bucket: the UND layers over the padded prompt (dense: no stand-in; both branches, both layers) and
    # the GEN layers at each branch's prefix length (each frame serving both layers)
    assert backend.frames == 3
    assert sorted((r.status, r.pattern, r.reason) for r in reports) == [
        ("dense", "-", "no cache stand-in among the inputs"),  # the UND causal self-attention: computes the prefix
        ("rewritten", "conditioning-prefix", ""), ("rewritten", "conditioning-prefix", "")]
    assert runtime.owner_ids() == [] and runtime.state()["num_free"] == free  # released with the requests


def test_cosmos3_pipeline_import_needs_janus_and_torchvision():
    """The blocker, pinned: importing the pipeline module fails in this environment on a package outside the lock
    (vllm-omni's engine imports `janus`; vLLM's Qwen2-VL, through transformers, `torchvision.transforms.v2`), by
    way of the OpenAI entrypoints `pipeline_cosmos3` imports `positive_float` from."""
    code = "import vllm_omni.diffusion.models.cosmos3.pipeline_cosmos3"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0, "the Cosmos3 pipeline imports now: drive Cosmos3Pipeline.diffuse itself"
    assert "vllm_omni/entrypoints/openai/__init__.py" in done.stderr
    assert "ModuleNotFoundError: No module named 'torchvision'" in done.stderr or \
        "ModuleNotFoundError: No module named 'janus'" in done.stderr
