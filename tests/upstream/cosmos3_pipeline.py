"""vllm-omni 0.30.0's Cosmos3 transformer (`vllm_omni/diffusion/models/cosmos3/transformer_cosmos3.py`) at tiny
sizes on this CPU, the pipeline's CFG denoising loop, and the driver that pages its generation pathway.

Importing the package `vllm_omni.diffusion.models.cosmos3` runs its `__init__`, which imports `pipeline_cosmos3`,
which imports `positive_float` from `vllm_omni.entrypoints.openai.video_api_utils`: that pulls the OpenAI
entrypoints package, its API server and vllm-omni's engine (`import janus`, an async queue library), and vLLM's
Qwen2-VL model (`torchvision.transforms.v2` through transformers' image processor). Neither package is in the lock;
the transformer module needs neither. `transformer_module()` registers the package as a bare package (its
directory, no `__init__` run) and imports the transformer module itself, unchanged.

The model (`Cosmos3VFMTransformer`) runs its understanding (UND) tower once per CFG branch over the prompt and
keeps its per-layer post-norm, post-RoPE K/V trimmed to the real text length in `self.cached_kv`; every step's
generation (GEN) layers attend ``cat([k_und, k_gen])`` with no mask (`Cosmos3CrossAttention._forward_local`).
The pipeline (`Cosmos3Pipeline.diffuse`, the plain CFG branch) swaps each branch's `(cached_kv, cached_freqs_gen)`
into the transformer before its forward and keeps what the forward left there: `cfg_denoise` below is that loop.

`Cosmos3PagedDriver` pages it with a conditioning-prefix request per branch (`families/conditioning_prefix.py`):
the UND and GEN decoder layers compiled (`backend="paged_kv"`, each on its own; a UND layer's graph reads no
stand-in, so it stays dense as written), and the one
point where the transformer goes from the kept K/V to the GEN stack, `_run_gen_layers`, stood in for: when the
transformer holds a prefix the UND tower has just computed (dense tensors), the driver admits a request, hands
the K/V to `store_prefix` once and puts the stand-ins where the transformer kept the tensors (`cached_kv`, which
the pipeline then keeps for the branch); when it holds stand-ins, they name the branch's request. The GEN stack
then runs inside ``runtime.forward(request, "step")``. Driver-side torch setting: `Cosmos3PagedDriver.installed`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import os
import sys
import types
from typing import Any, Iterator

import torch

PACKAGE = "vllm_omni.diffusion.models.cosmos3"
#: a Cosmos3 transformer config at tiny size: GQA (4 query heads over 2 KV heads), Qwen3-VL's interleaved M-RoPE
#: sections summing to head_dim / 2, 4-channel latents in 2x2 patches
TINY_CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   intermediate_size=64, vocab_size=100, latent_patch_size=2, latent_channel=4,
                   rope_scaling={"mrope_section": [2, 1, 1]})


def transformer_module():
    """`transformer_cosmos3`, imported without running the package's `__init__` (module docstring)."""
    import vllm_omni.diffusion.models as models

    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [os.path.join(os.path.dirname(models.__file__), "cosmos3")]
        package.__spec__ = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
        sys.modules[PACKAGE] = package
    return importlib.import_module(f"{PACKAGE}.transformer_cosmos3")


def diffusion_config(omni):
    from vllm_omni.diffusion.data import TransformerConfig

    return omni.diffusion_config(tf_model_config=TransformerConfig.from_dict(dict(TINY_CONFIG)))


def tiny_cosmos3(od_config, *, seed: int = 0):
    """The package's `Cosmos3VFMTransformer` at tiny size, random weights (std 0.2), fp32, eval; build it inside
    `model_context(od_config)`."""
    torch.manual_seed(seed)
    model = transformer_module().Cosmos3VFMTransformer(od_config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def prompt(real: int, capacity: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(text_ids, text_mask) of one prompt: `real` tokens right-padded to `capacity`, as the tokenizer gives them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, TINY_CONFIG["vocab_size"], (1, capacity), generator=g)
    mask = (torch.arange(capacity) < real).to(torch.long)[None, :]
    return ids * mask, mask


def cfg_denoise(transformer, latents: torch.Tensor, cond: tuple, uncond: tuple, *, steps: int,
                guidance: float = 3.0, fps: float = 24.0) -> torch.Tensor:
    """`Cosmos3Pipeline.diffuse`'s plain CFG loop (no CFG-parallel, no session state): per step the conditional
    then the unconditional forward, each with its branch's kept UND cache swapped in, combined as
    ``uncond + guidance * (cond - uncond)``; an Euler step over a uniform schedule stands in for its scheduler."""
    transformer.reset_cache()
    cond_cache: tuple = (None, None)
    uncond_cache: tuple = (None, None)
    shape = tuple(latents.shape[2:])
    timesteps = torch.linspace(1000.0, 1000.0 / steps, steps)
    for t in timesteps:
        transformer.cached_kv, transformer.cached_freqs_gen = cond_cache
        noise_cond = transformer(hidden_states=latents, timestep=t.unsqueeze(0), text_ids=cond[0],
                                 text_mask=cond[1], video_shape=shape, fps=fps)
        if cond_cache[0] is None:
            cond_cache = (transformer.cached_kv, transformer.cached_freqs_gen)
        transformer.cached_kv, transformer.cached_freqs_gen = uncond_cache
        noise_uncond = transformer(hidden_states=latents, timestep=t.unsqueeze(0), text_ids=uncond[0],
                                   text_mask=uncond[1], video_shape=shape, fps=fps)
        if uncond_cache[0] is None:
            uncond_cache = (transformer.cached_kv, transformer.cached_freqs_gen)
        noise = noise_uncond + guidance * (noise_cond - noise_uncond)
        latents = latents - noise / steps
    return latents


class Cosmos3PagedDriver:
    """Pages `transformer`'s GEN pathway through `runtime`, one conditioning-prefix request per kept UND prefix
    (module docstring). `requests`: every request admitted, in order; released when the driver is uninstalled."""

    def __init__(self, transformer, runtime, *, backend: Any) -> None:
        from paged_kv_compile.families.conditioning_prefix import store_prefix

        self.transformer, self.runtime = transformer, runtime
        self._store_prefix = store_prefix
        self._dense_gen_layers = transformer._run_gen_layers
        self.bound = torch.nn.ModuleList(  # held: the runtime keeps only weak references to the layers it binds
            torch.nn.ModuleDict({"und": u, "gen": g})
            for u, g in zip(transformer.language_model.layers, transformer.gen_layers))
        runtime.bind(self.bound)
        for layer in (*transformer.language_model.layers, *transformer.gen_layers):
            layer.compile(backend=backend, fullgraph=True, dynamic=False)
        self.requests: list[str] = []
        self._by_standin: dict[int, tuple[torch.Tensor, str]] = {}
        self.steps = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator["Cosmos3PagedDriver"]:
        """The stand-in for `_run_gen_layers`, and one torch setting: vllm-omni's SDPA backend logs a debug line
        when it expands GQA's K/V heads itself (this shape on CPU), which dynamo refuses under fullgraph, dense
        and paged alike, unless the logging function is ignored (as `adapters/vllm_omni_hunyuan_runner.py` does)."""
        from vllm_omni.diffusion.attention.backends import sdpa

        ignored = set(torch._dynamo.config.ignore_logging_functions) | {sdpa.logger.debug}
        self.transformer._run_gen_layers = self._run_gen_layers
        try:
            with torch._dynamo.config.patch(ignore_logging_functions=ignored):
                yield self
        finally:
            del self.transformer._run_gen_layers
            for request_id in self.requests:
                if self.runtime.owner(request_id) is not None:
                    self.runtime.release(request_id)

    def _request(self, new_tokens: int) -> str:
        """The request of the prefix the transformer holds: its stand-ins name it, or the UND tower has just
        computed it (dense) and it is admitted and stored now."""
        from paged_kv_compile.families.conditioning_prefix import ConditioningPrefixSpec

        kept = self.transformer.cached_kv
        held = self._by_standin.get(id(kept[0][0]))
        if held is not None and held[0] is kept[0][0]:
            return held[1]
        rows, length = kept[0][0].shape[:2]
        request_id = f"cosmos3-{len(self.requests)}"
        self.runtime.admit(request_id, ConditioningPrefixSpec(prefix_lens=(length,) * rows,
                                                              max_new_tokens=new_tokens))
        self.requests.append(request_id)
        key, value = self._store_prefix(self.runtime, request_id, kept)
        self.transformer.cached_kv = [(key, value) for _ in kept]
        self._by_standin[id(key)] = (key, request_id)
        return request_id

    def _run_gen_layers(self, hidden_gen: torch.Tensor, **arguments: Any) -> torch.Tensor:
        request_id = self._request(hidden_gen.shape[1])
        self.steps += 1
        with self.runtime.forward(request_id, "step", new_tokens=hidden_gen.shape[1]):
            return self._dense_gen_layers(hidden_gen, **arguments)
