"""vllm-omni's `DiffusionModelRunner` serving its `HunyuanImage3Pipeline` on a CPU, at a tiny size.

The closest real objects of vllm-omni's HunyuanImage-3 stack that run here (vllm-omni 0.30.0):

* the runner is the package's `DiffusionModelRunner` (or the subclass `diffusion_model_runner_cls` names), built by
  its own constructor; `load_model` is replaced by handing it the pipeline (loading reads an 80B checkpoint);
  `execute_model(request)` serves requests as the worker calls it;
* the pipeline is `HunyuanImage3Pipeline` with everything but its tokenizer unchanged (`forward`, `_generate`): the denoise loop of
  `HunyuanImage3Text2ImagePipeline.__call__` (its scheduler, bf16 latents and autocast, CFG), the pipeline's
  `_prepare_attention_mask_for_generation`, `prepare_inputs_for_generation`, `forward_call`,
  `_update_model_kwargs_for_generation`, `instantiate_*_tokens`, `ragged_final_layer`, and the real
  `HunyuanImage3Model` (2 decoder layers, GQA 4/2 heads, random weights, bf16 as `od_config.dtype`).

Stubbed, and why: `__init__` builds only those modules (the checkpoint's config, tokenizer, Siglip2 vision
tower and VAE are not here); `prepare_model_inputs` (the tokenizer) returns the layout it produces: per CFG row
`[prompt | <timestep> | image | <eoi>]`, rows RIGHT-padded to the longest (the conditional and the unconditional
prompt differ in length), the request's prompt text carrying both rows' token ids; the VAE decode returns the
latents. `forward`, `prepare_encode`, `denoise_step`, `step_scheduler` and `post_decode` are the package's.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch
from torch import nn

from . import vllm_omni_cpu

#: image 8x8 pixels, VAE factor 4, patch 1: 2x2 latent tokens; prompts (conditional, unconditional) per request
IMAGE, LATENT_HW = 8, (2, 2)


def tiny_config():
    return vllm_omni_cpu.tiny_hunyuan_config(num_hidden_layers=2, vae={"latent_channels": 4},
                                             vae_downsample_factor=(4, 4), patch_size=1, patch_embed_hidden_dim=32)


class _LatentsVae(nn.Module):
    """The VAE slot: `decode` returns the latents (the image is not what is compared)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(scaling_factor=None, shift_factor=None)
        self.device = torch.device("cpu")

    def decode(self, latents, return_dict=False, generator=None):
        return (latents.float(),)


def _pipeline_class():
    vllm_omni_cpu.install()
    from transformers import GenerationConfig
    from vllm_omni.diffusion.models.hunyuan_image3 import hunyuan_image3_transformer as ht
    from vllm_omni.diffusion.models.hunyuan_image3.pipeline_hunyuan_image3 import HunyuanImage3Pipeline

    class TinyHunyuanImage3Pipeline(HunyuanImage3Pipeline):
        """`HunyuanImage3Pipeline` over a tiny model, fed the tokenizer's layout (see the module docstring)."""

        def __init__(self, od_config, hf_config) -> None:
            ht.HunyuanImage3PreTrainedModel.__init__(self, hf_config)
            self.hf_config, self.od_config = hf_config, od_config
            self.generation_config = GenerationConfig(flow_shift=3.0)
            self.model = ht.HunyuanImage3Model(hf_config)
            self.transformer = self.model
            self.vae = _LatentsVae()
            self._tkwrapper = types.SimpleNamespace(pad_token_id=0)  # the tokenizer: its pad id, as model_inputs pads
            self._pipeline = None
            hidden, latent = hf_config.hidden_size, hf_config.vae["latent_channels"]
            self.timestep_emb = ht.TimestepEmbedder(hidden_size=hidden)
            self.patch_embed = ht.UNetDown(patch_size=hf_config.patch_size, emb_channels=hidden, in_channels=latent,
                                           hidden_channels=hf_config.patch_embed_hidden_dim, out_channels=hidden)
            self.time_embed = ht.TimestepEmbedder(hidden_size=hidden)
            self.final_layer = ht.UNetUp(patch_size=hf_config.patch_size, emb_channels=hidden, in_channels=hidden,
                                         hidden_channels=hf_config.patch_embed_hidden_dim, out_channels=latent,
                                         out_norm=True)
            self.time_embed_2 = ht.TimestepEmbedder(hidden_size=hidden)
            self.vllm_config = vllm_omni_cpu.vllm_config()

        def prepare_model_inputs(self, prompt=None, generator=None, image_size=None, num_inference_steps=50,
                                 guidance_scale=5.0, **_unused):
            """The tokenizer's output for the prompt (`prompt_text`: the token ids of the conditional and the
            unconditional prompt) with the keys `prepare_model_inputs` returns."""
            text = prompt[0] if isinstance(prompt, list) else prompt
            return model_inputs(prompt_ids_of(text), generator, num_inference_steps, guidance_scale)

    return TinyHunyuanImage3Pipeline


def prompt_text(prompt_ids: list[torch.Tensor]) -> str:
    """A request's prompt as this tiny tokenizer reads it: each CFG row's token ids, rows split by '|'."""
    return "|".join(" ".join(str(int(t)) for t in row) for row in prompt_ids)


def prompt_ids_of(text: str) -> list[torch.Tensor]:
    return [torch.tensor([int(t) for t in row.split()]) for row in text.split("|")]


def model_inputs(prompt_ids: list[torch.Tensor], generator, steps: int, guidance_scale: float) -> dict[str, Any]:
    """What `prepare_model_inputs` returns for one prompt and its CFG pair (`prompt_ids`: per row, the tokens
    before <timestep>), right-padded; `batch_gen_image_info` is the generated image's `ImageInfo`."""
    from vllm_omni.diffusion.models.hunyuan_image3 import hunyuan_image3_transformer as ht

    h, w = LATENT_HW
    hw, lens = h * w, [int(p.numel()) for p in prompt_ids]
    S = max(lens) + 1 + hw + 1
    ids = torch.zeros(len(lens), S, dtype=torch.long)  # pad id 0
    image_mask = torch.zeros(len(lens), S, dtype=torch.bool)
    slices, rope = [], []
    for r, (p, tokens) in enumerate(zip(lens, prompt_ids)):
        ids[r, :p] = tokens
        ids[r, p:p + hw + 2] = torch.tensor([1] + [2] * hw + [3])  # <timestep>, image placeholders, <eoi>
        image = slice(p + 1, p + 1 + hw)
        image_mask[r, image] = True
        slices.append([image])
        rope.append([(image, (h, w))])
    cos, sin = ht.build_batch_2d_rope(S, tiny_config().attention_head_dim, image_infos=rope)
    tokenizer_output = types.SimpleNamespace(joint_image_slices=[[] for _ in lens], gen_image_slices=slices)
    info = ht.ImageInfo(image_type="gen_image", image_width=IMAGE, image_height=IMAGE, token_width=w, token_height=h)
    return dict(input_ids=ids, position_ids=torch.arange(S).expand(len(lens), -1), past_key_values=None,
                custom_pos_emb=(cos, sin), mode="gen_image", num_inference_steps=steps, guidance_scale=guidance_scale,
                image_mask=image_mask, gen_timestep_scatter_index=torch.tensor([[p] for p in lens]),
                tokenizer_output=tokenizer_output, batch_gen_image_info=[info],
                generator=generator)


class _CpuAutocastOff(torch.autocast):
    """`torch.autocast` with CPU autocast left off (CUDA untouched)."""

    def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
        if device_type == "cpu":
            kwargs["enabled"] = False
        super().__init__(device_type, *args, **kwargs)


@contextlib.contextmanager
def fp32_pipeline() -> Iterator[None]:
    """The pipeline's denoise loop in fp32 end to end (the oracle's dtype), for the block: its latents keep the
    requested dtype instead of `prepare_latents(dtype=torch.bfloat16)`, CPU autocast stays off (its loop enters
    `torch.autocast("cpu", bfloat16)`, its decode float16) and the 2-D RoPE keeps fp32
    (`vllm_omni_cpu.hunyuan_fp32_rope`). Every other line of the pipeline runs as written."""
    from vllm_omni.diffusion.models.hunyuan_image3.hunyuan_image3_transformer import HunyuanImage3Text2ImagePipeline

    prepare = HunyuanImage3Text2ImagePipeline.prepare_latents

    def prepare_fp32(self, batch_size, latent_channel, image_size, dtype, device, generator, latents=None):
        return prepare(self, batch_size, latent_channel, image_size, torch.float32, device, generator, latents)

    saved_autocast = torch.autocast
    HunyuanImage3Text2ImagePipeline.prepare_latents = prepare_fp32
    torch.autocast = _CpuAutocastOff
    try:
        with vllm_omni_cpu.hunyuan_fp32_rope():
            yield
    finally:
        torch.autocast = saved_autocast
        HunyuanImage3Text2ImagePipeline.prepare_latents = prepare


def build_pipeline(od_config, *, seed: int = 0):
    """A `TinyHunyuanImage3Pipeline` with seeded random weights, in `od_config.dtype` (bf16 as deployed)."""
    torch.manual_seed(seed)
    pipeline = _pipeline_class()(od_config, tiny_config())
    with torch.no_grad():
        for name, p in pipeline.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("layernorm.weight") else torch.randn_like(p) * 0.2)
    return pipeline.to(od_config.dtype).eval()


def diffusion_config(*, runner_cls: str | None = None, **overrides):
    """The `OmniDiffusionConfig` of a HunyuanImage-3 deployment (request mode), bf16."""
    kw: dict[str, Any] = dict(dtype=torch.bfloat16, model_class_name="HunyuanImage3Pipeline", enforce_eager=True)
    if runner_cls is not None:
        kw["diffusion_model_runner_cls"] = runner_cls
    kw.update(overrides)
    return vllm_omni_cpu.diffusion_config(**kw)


def build_runner(pipeline, od_config, *, available_bytes: int | None = None):
    """The runner `od_config` selects (as the worker resolves it) serving `pipeline`; ours gets its pool from
    `available_bytes` (the worker's budget after its profile run) unless `kv_cache_memory_bytes` is set."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.import_utils import resolve_obj_by_qualname

    path = od_config.diffusion_model_runner_cls or "vllm_omni.diffusion.worker.diffusion_model_runner.DiffusionModelRunner"
    runner_cls = resolve_obj_by_qualname(path)
    with set_current_vllm_config(vllm_omni_cpu.vllm_config()):
        runner = runner_cls(vllm_omni_cpu.vllm_config(), od_config, torch.device("cpu"))
    runner.pipeline = pipeline  # what load_model's loader would produce
    if hasattr(runner, "attach_paged_kv"):
        runner.attach_paged_kv(available_bytes=available_bytes)
    return runner


def make_request(request_id: str, prompt_ids: list[torch.Tensor], *, seed: int = 0, steps: int = 3,
                 cancellation_signal: str | None = None):
    """An `OmniDiffusionRequest` carrying the tokenizer's output for one prompt and its CFG pair."""
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    params = OmniDiffusionSamplingParams(seed=seed, num_inference_steps=steps,
                                         height=IMAGE, width=IMAGE, guidance_scale=5.0)
    req = OmniDiffusionRequest(prompt=prompt_text(prompt_ids), sampling_params=params, request_id=request_id)
    req.cancellation_signal = cancellation_signal
    return req


def serve(runner, req):
    """`execute_model` inside the vLLM config the worker runs under."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_omni_cpu.vllm_config()):
        return runner.execute_model(req)


def tick(runner, step_id: int, new=(), cached=(), finished=()):
    """One `execute_stepwise` call, as the engine's step scheduler builds it: `new` requests admitted this tick,
    `cached` ones advanced, `finished` ones dropped; returns {request_id: RunnerOutput}."""
    from vllm.config import set_current_vllm_config
    from vllm_omni.diffusion.sched.interface import CachedRequestData, DiffusionSchedulerOutput, NewRequestData

    out = DiffusionSchedulerOutput(
        step_id=step_id, scheduled_new_reqs=[NewRequestData(request_id=r.request_id, req=r) for r in new],
        scheduled_cached_reqs=CachedRequestData(request_ids=list(cached)), finished_req_ids=set(finished),
        num_running_reqs=len(new) + len(cached), num_waiting_reqs=0,
    )
    with set_current_vllm_config(vllm_omni_cpu.vllm_config()):
        return {o.request_id: o for o in runner.execute_stepwise(out).runner_outputs}


def serve_on_rank(full_weights: dict[str, torch.Tensor], prompt_ids: list[torch.Tensor], seed: int,
                  model_config: dict | None, available_bytes: int | None,
                  parallel: dict[str, Any] | None = None, steps: int = 3) -> dict[str, Any]:
    """A rank task (`multirank.RankPool.run`): this rank's pipeline (tensor-parallel layers at the rank's TP
    size) loaded with the one-rank weights, served one fp32 request by the runner `model_config` selects (ours
    when given, else the plain dense runner); returns the image and, for ours, the pool's bytes and KV heads.
    `parallel`: the deployment's `parallel_config` (e.g. {"ulysses_degree": 2}); with sequence parallelism the
    model gets vllm-omni's `_sp_plan` hooks as its loader applies them (`registry._apply_sequence_parallel_if_enabled`)."""
    from .multirank import load_full_weights, rank_info

    from paged_kv_compile.adapters.vllm_omni_hunyuan_runner import RUNNER_PATH

    torch._dynamo.reset()  # a rank serves several tests' tasks: each compiles afresh (dynamo's recompile limit)
    with fp32_pipeline():
        od = diffusion_config(dtype=torch.float32, **({"runner_cls": RUNNER_PATH, "model_config": model_config}
                                                      if model_config is not None else {}),
                              **({"parallel_config": dict(parallel)} if parallel else {}))
        with vllm_omni_cpu.model_context(od):
            pipeline = build_pipeline(od)
            load_full_weights(pipeline, full_weights)
            if parallel:
                from vllm_omni.diffusion.registry import _apply_sequence_parallel_if_enabled

                _apply_sequence_parallel_if_enabled(pipeline, od)
            runner = build_runner(pipeline, od, available_bytes=available_bytes)
            out = serve(runner, make_request("r", prompt_ids, seed=seed, steps=steps))
            if out.error:
                raise RuntimeError(out.error)
            report = {"image": out.output["payload"]["image"], **rank_info()}
            if model_config is not None:
                runtime = runner.paged_kv.runtime
                report.update(pool_bytes=runtime.pool.nbytes, blocks=runtime.pool.blocks_per_layer,
                              kv_heads=runtime.config.num_kv_heads,
                              rows=runtime.config.max_rows, at_baseline=runtime.owner_ids() == []
                              and runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer)
            return report


@contextlib.contextmanager
def rows_alone(model) -> Iterator[None]:
    """Inside the block, each `HunyuanImage3Model.forward` of `model` (the loaded `pipeline.model`) runs its CFG
    rows one at a time, each a batch of one with its own layer state: what a CFG-parallel rank computes for its
    row (the row sliced out at the first step, its own prompt cache and step mask after), on one rank.

    The oracle of CFG-parallel runs: a batched forward is not one, because vllm-omni's `RotaryEmbedding` applies
    `cos[0]` / `sin[0]` to every row (`_prepare_half_head_dim_cos_sin`), so with right-padded rows of different
    prompt lengths row 1 gets row 0's image positions. A step row keeps its own prompt columns of the merged step
    mask (`[its prompt | zero padding to the longest | target]`, `_update_model_kwargs_for_generation`)."""
    managers = [m for m in model.modules() if hasattr(m, "image_kv_cache_map") and hasattr(m, "_cache_prompt_kv")]
    embedders = [m.image_rope2d_emb for m in model.modules() if hasattr(m, "image_rope2d_emb")]
    states: dict[int, tuple] = {}  # row -> (each manager's prompt cache and lens, each embedder's cos/sin)
    dense = model.forward

    def swap_in(row: int) -> None:
        saved = states.get(row)
        for i, m in enumerate(managers):
            m.image_kv_cache_map, m.image_kv_cache_lens = saved[0][i] if saved else (None, None)
        for i, e in enumerate(embedders):
            e.custom_pos_emb = saved[1][i] if saved else None

    def swap_out(row: int) -> None:
        states[row] = ([(m.image_kv_cache_map, m.image_kv_cache_lens) for m in managers],
                       [e.custom_pos_emb for e in embedders])

    def forward(**kwargs):
        mask, scatter = kwargs["attention_mask"], kwargs["gen_timestep_scatter_index"]
        rows, first = int(mask.shape[0]), bool(kwargs.get("first_step"))
        target = int(kwargs["num_image_tokens"])
        if first:
            states.clear()
        outs = []
        for r in range(rows):
            row = dict(kwargs)
            for key in ("inputs_embeds", "input_ids", "position_ids", "gen_timestep_scatter_index"):
                if isinstance(row.get(key), torch.Tensor):
                    row[key] = row[key][r:r + 1]
            row["custom_pos_emb"] = tuple(t[r:r + 1] for t in kwargs["custom_pos_emb"])
            if isinstance(row.get("full_attn_spans"), list):
                row["full_attn_spans"] = row["full_attn_spans"][r:r + 1]
            row_mask = mask[r:r + 1]
            if not first:  # the merged step mask pads each prompt to the longest: keep this row's columns
                longest, own = int(mask.shape[-1]) - target, int(scatter[r, -1])
                row_mask = torch.cat([row_mask[..., :own], row_mask[..., longest:]], dim=-1)
            row["attention_mask"] = row_mask
            row["query_lens"] = [kwargs["query_lens"][r]]
            row["seq_lens"] = [int(row_mask.shape[-1])]
            swap_in(r)
            outs.append(dense(**row))
            swap_out(r)
        hidden = torch.cat([o[0] for o in outs], dim=0)
        if isinstance(outs[0], tuple):
            return (hidden, *outs[0][1:])
        outs[0].last_hidden_state = hidden
        return outs[0]

    model.forward = forward
    try:
        yield
    finally:
        model.__dict__.pop("forward", None)
        swap_in(-1)
