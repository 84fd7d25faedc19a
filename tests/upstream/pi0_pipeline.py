"""vllm-omni 0.30.0's pi0 and pi0.5 (`vllm_omni/diffusion/models/pi0/modeling_pi0.py`, `pi05/modeling_pi05.py`, its
own copy with AdaRMS norms and no state token) at tiny sizes on this CPU, and the driver that pages their
flow-matching steps.

The model is the package's `Pi0ForActionPrediction` (`Pi05ForActionPrediction`), built unchanged from its config;
three construction-time
shims make it tiny (none touches a model line, and each is undone once the model is built):

* `get_gemma_config` knows two tiny variants besides `gemma_2b` / `gemma_300m` (the config names its variants);
* the PaliGemma config `CONFIG_MAPPING["paligemma"]()` gives has a one-layer 16-wide SigLIP over 28x28 images (4
  image tokens per camera) instead of the 27-layer 1152-wide default;
* the model hard-codes `projection_dim = 2048` (the width of `gemma_2b`, the only PaliGemma it ships): at the tiny
  width the projector is rebuilt at the text width, what `projection_dim` is at the real sizes.

`Pi0PagedDriver` pages `sample_actions` as the pipeline calls it (its own loop, unchanged), by standing in for
`PaliGemmaWithActionExpert.forward`, the one method both phases go through:

* the prefix forward (`inputs_embeds=[prefix, None]`) admits a conditioning-prefix request whose layout is read
  from the model's own masks (which prefix columns are real: padded camera slots and prompt tokens are not; how
  many suffix tokens each suffix token sees), runs compiled (the same `torch.compile`d forward: its graph reads no
  stand-in, so it stays dense as written), and hands the per-layer post-RoPE ``(k, v)``
  it returns (head-major, (B, Hkv, P, D)) to `store_prefix` (token-major) ONCE; the model gets the stand-ins back
  (head-major views) as its ``past_key_values``;
* every flow-matching step (`inputs_embeds=[None, suffix]`) runs the compiled forward (`backend="paged_kv"`) inside
  ``runtime.forward(rid, "step", attention_mask=mask)``, with the very mask the model built for that step.

Layer i of the runtime is PaliGemma's decoder layer i together with the action expert's layer i (the expert's
layer i attends over the prefix PaliGemma's layer i computed), bound as one container per index.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Iterator

import torch

TINY_VLM = "tiny_vlm"
TINY_EXPERT = "tiny_expert"
#: width, depth, mlp, heads, kv heads, head dim: pi0's shape (8 heads over ONE kv head, the same head dim in both
#: towers, the expert narrower) at tiny sizes
TINY_VARIANTS = {TINY_VLM: (32, 2, 64, 2, 1, 8), TINY_EXPERT: (16, 2, 32, 2, 1, 8)}
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
IMAGE_TOKENS = (VISION["image_size"] // VISION["patch_size"]) ** 2


#: per model: its modeling module, model class, config class (pi0.5 is its own copy of pi0's code)
MODELS = {"pi0": ("pi0.modeling_pi0", "Pi0ForActionPrediction", "pi0.config", "Pi0Config"),
          "pi05": ("pi05.modeling_pi05", "Pi05ForActionPrediction", "pi05.config", "Pi05Config")}


def _module(name: str):
    import importlib

    return importlib.import_module(f"vllm_omni.diffusion.models.{name}")


@contextlib.contextmanager
def _tiny_construction(modeling_pi0) -> Iterator[None]:
    from transformers import PaliGemmaConfig
    from transformers.models.auto import CONFIG_MAPPING

    real_variants, real_mapping = modeling_pi0.get_gemma_config, modeling_pi0.CONFIG_MAPPING

    def variants(name: str):
        if name in TINY_VARIANTS:
            return modeling_pi0.GemmaVariantConfig(*TINY_VARIANTS[name])
        return real_variants(name)

    class Mapping:
        def __getitem__(self, key: str):
            if key == "paligemma":
                return lambda: PaliGemmaConfig(vision_config=dict(VISION))
            return CONFIG_MAPPING[key]

    modeling_pi0.get_gemma_config, modeling_pi0.CONFIG_MAPPING = variants, Mapping()
    try:
        yield
    finally:
        modeling_pi0.get_gemma_config, modeling_pi0.CONFIG_MAPPING = real_variants, real_mapping


def tiny_pi0(which: str = "pi0", *, chunk_size: int = 4, action_dim: int = 6, state_dim: int = 5, steps: int = 3,
             seed: int = 0):
    """The package's `Pi0ForActionPrediction` (or pi0.5's `Pi05ForActionPrediction`) at tiny sizes, random weights,
    fp32, eval."""
    modeling, model_class, config_module, config_class = MODELS[which]
    modeling = _module(modeling)
    extra = {"n_action_steps": chunk_size} if which == "pi05" else {}  # pi0.5's serving returns whole chunks
    config = getattr(_module(config_module), config_class)(
        paligemma_variant=TINY_VLM, action_expert_variant=TINY_EXPERT, chunk_size=chunk_size,
        max_action_dim=action_dim, max_state_dim=state_dim, num_inference_steps=steps, **extra)
    torch.manual_seed(seed)
    with _tiny_construction(modeling):
        model = getattr(modeling, model_class)(config)
    paligemma = model.paligemma_with_expert.paligemma
    paligemma.model.multi_modal_projector.linear = torch.nn.Linear(VISION["hidden_size"], TINY_VARIANTS[TINY_VLM][0])
    return model.eval()


@dataclass
class Observation:
    """What `sample_actions` takes, as `processor_pi0.build_model_inputs` builds it (cameras padded to
    `max_cameras` with -1 images and a False mask, the prompt right-padded)."""

    images: list[torch.Tensor]
    image_masks: list[torch.Tensor]
    lang_tokens: torch.Tensor
    lang_masks: torch.Tensor
    state: torch.Tensor
    noise: torch.Tensor

    def arguments(self, model) -> dict[str, Any]:
        """`sample_actions`' arguments; pi0.5 takes no state (its state rides in the prompt tokens)."""
        args = dict(images=self.images, image_masks=self.image_masks, lang_tokens=self.lang_tokens,
                    lang_masks=self.lang_masks, noise=self.noise)
        if "state" in inspect.signature(model.sample_actions).parameters:
            args["state"] = self.state
        return args


def observation(model, *, cameras: list[list[bool]], prompt_lens: list[int], prompt_capacity: int = 5,
                seed: int = 1) -> Observation:
    """Rows of random observations: `cameras[r]` says which camera slots row r has, `prompt_lens[r]` its prompt's
    real tokens out of `prompt_capacity`."""
    g = torch.Generator().manual_seed(seed)
    rows, slots = len(cameras), len(cameras[0])
    side = VISION["image_size"]
    images, masks = [], []
    for c in range(slots):
        present = torch.tensor([cameras[r][c] for r in range(rows)])
        pixels = torch.rand(rows, 3, side, side, generator=g) * 2 - 1
        images.append(torch.where(present[:, None, None, None], pixels, torch.full_like(pixels, -1.0)))
        masks.append(present)
    tokens = torch.randint(0, 1000, (rows, prompt_capacity), generator=g)
    lang_masks = torch.arange(prompt_capacity)[None, :] < torch.tensor(prompt_lens)[:, None]
    state = torch.randn(rows, model.max_state_dim, generator=g)
    noise = torch.randn(rows, model.action_horizon, model.action_dim, generator=g)
    return Observation(images, masks, tokens, lang_masks, state, noise)


class CharTokenizer:
    """A stand-in for the PaliGemma tokenizer (not on this machine): one id per character, right-padded to
    `max_length` with a 0/1 attention mask, as `processor_pi0.tokenize_prompt` asks of it."""

    def __call__(self, text: str, *, padding: str, max_length: int, truncation: bool, add_special_tokens: bool,
                 return_tensors: None) -> dict[str, list[int]]:
        assert padding == "max_length" and truncation and return_tensors is None
        ids = [2] + [3 + ord(c) % 997 for c in text]  # a BOS, then the characters
        ids = ids[:max_length]
        return {"input_ids": ids + [0] * (max_length - len(ids)),
                "attention_mask": [1] * len(ids) + [0] * (max_length - len(ids))}


def tiny_pipeline(model, *, cameras: tuple[str, ...], prompt_capacity: int):
    """vllm-omni's `Pi0Pipeline` around `model`, its `forward` unchanged. Its constructor resolves a checkpoint
    directory and downloads the PaliGemma tokenizer, so the instance is made without it and given what it sets:
    the model's config (the checkpoint's camera order `cameras`, the tiny image size, a short prompt), the
    tokenizer stand-in, the device and the model."""
    from vllm_omni.diffusion.models.pi0.pipeline_pi0 import Pi0Pipeline

    config = model.config
    config.image_feature_keys = list(cameras)
    config.max_cameras = len(cameras)
    config.image_resolution = (VISION["image_size"], VISION["image_size"])
    config.tokenizer_max_length = prompt_capacity
    pipeline = Pi0Pipeline.__new__(Pi0Pipeline)
    torch.nn.Module.__init__(pipeline)
    pipeline.od_config, pipeline.prefix, pipeline.model_dir, pipeline.config = None, "", None, config
    pipeline.tokenizer, pipeline._torch_dtype, pipeline._device = CharTokenizer(), torch.float32, torch.device("cpu")
    pipeline.model = model
    return pipeline


def robot_request(model, *, images: dict[str, Any], prompt: str, seed: int = 2):
    """An `OmniDiffusionRequest`-shaped request as the OpenPI serving layer sends one: the raw robot observation
    (HWC uint8 images by camera, the prompt, the state) and the initial noise in `extra_args`."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    state = torch.randn(model.max_state_dim - 1, generator=g).tolist()  # shorter than max: the pipeline pads it
    noise = torch.randn(1, model.action_horizon, model.action_dim, generator=g)
    extra = {"robot_obs": {"images": images, "prompt": prompt, "state": state}, "noise": noise}
    return SimpleNamespace(prompts=[prompt], sampling_params=SimpleNamespace(extra_args=extra))


def camera_image(seed: int):
    """One camera frame, HWC uint8 at the tiny image size."""
    g = torch.Generator().manual_seed(seed)
    side = VISION["image_size"]
    return torch.randint(0, 256, (side, side, 3), generator=g, dtype=torch.uint8).numpy()


def step_visibility(model, rows: int) -> tuple[int, ...]:
    """Per suffix token, how many suffix tokens it sees, read from the model's own suffix masks (`embed_suffix`'s
    autoregressive mask through `make_att_2d_masks`): pi0's ``[1, 1, 0, ...]`` (its state token sees itself, every
    action token the state and all actions), pi0.5's ``[1, 0, ...]`` (no state token: every action sees all).
    Each step's real mask is checked against it before the step runs."""
    make_att_2d_masks = inspect.getmodule(type(model)).make_att_2d_masks
    actions = torch.zeros(rows, model.action_horizon, model.action_dim)
    if "state" in inspect.signature(model.embed_suffix).parameters:
        _, pad, att = model.embed_suffix(torch.zeros(rows, model.max_state_dim), actions, torch.ones(rows))
    else:
        _, pad, att, _ = model.embed_suffix(actions, torch.ones(rows))
    seen = make_att_2d_masks(pad, att).sum(-1)
    if not bool((seen == seen[:1]).all()):
        raise AssertionError("pi0's suffix visibility differs between rows")
    return tuple(int(v) for v in seen[0])


def prefix_columns(prefix_mask: torch.Tensor) -> tuple[tuple[bool, ...], ...]:
    """Per row, which prefix tokens are real, read from the prefix forward's own (B, 1, P, P) additive mask: the
    columns some query attends (pi0 masks a padded camera slot's or prompt token's column for every query)."""
    return tuple(tuple(bool(c) for c in row) for row in (prefix_mask[:, 0] == 0).any(dim=1))


class Pi0PagedDriver:
    """Pages `model.sample_actions` (called unchanged, directly or by `Pi0Pipeline.forward`) through `runtime`:
    see the module docstring. Each prefix forward is one request (`request_ids`), admitted with the layout read
    from the model's own masks and released when the next one starts or the driver is uninstalled."""

    def __init__(self, model, runtime, *, backend: Any, new_visible: tuple[int, ...] | None = None) -> None:
        from paged_kv_compile.families.conditioning_prefix import store_prefix

        self.model, self.runtime = model, runtime
        self._store_prefix = store_prefix
        self.experts = model.paligemma_with_expert
        self._dense = self.experts.forward
        self.compiled = torch.compile(self._dense, backend=backend, fullgraph=True, dynamic=False)
        self.new_visible = new_visible  # None: read from the model (`step_visibility`)
        self.request_ids: list[str] = []
        self.specs: list[Any] = []
        self.steps = 0
        self.bound = self.layers(model)  # held: the runtime keeps only weak references to the layers it binds
        runtime.bind(self.bound)

    @staticmethod
    def layers(model) -> torch.nn.ModuleList:
        """One container per runtime layer: PaliGemma's decoder layer i and the expert's layer i."""
        pwe = model.paligemma_with_expert
        pairs = zip(pwe.paligemma.model.language_model.layers, pwe.gemma_expert.model.layers)
        return torch.nn.ModuleList(torch.nn.ModuleDict({"prefix": p, "expert": e}) for p, e in pairs)

    @contextlib.contextmanager
    def installed(self) -> Iterator["Pi0PagedDriver"]:
        self.experts.forward = self._forward
        try:
            yield self
        finally:
            del self.experts.forward
            self._release()

    def _release(self) -> None:
        if self.request_ids and self.runtime.owner(self.request_ids[-1]) is not None:
            self.runtime.release(self.request_ids[-1])

    def _admit(self, prefix_mask: torch.Tensor, rows: int) -> str:
        from paged_kv_compile.families.conditioning_prefix import ConditioningPrefixSpec

        self._release()
        columns = prefix_columns(prefix_mask)
        visible = self.new_visible if self.new_visible is not None else step_visibility(self.model, rows)
        spec = ConditioningPrefixSpec(prefix_lens=tuple(sum(c) for c in columns), max_new_tokens=len(visible),
                                      prefix_columns=columns, new_visible=visible)
        request_id = f"pi0-{len(self.request_ids)}"
        self.runtime.admit(request_id, spec)
        self.request_ids.append(request_id)
        self.specs.append(spec)
        return request_id

    def _forward(self, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                 use_cache=False, **extra):
        """`forward`'s stand-in (`extra`: pi0.5's `adarms_cond`, passed through)."""
        if inputs_embeds[1] is None:  # the prefix forward: dense, as written; its K/V stored once
            request_id = self._admit(attention_mask, inputs_embeds[0].shape[0])
            outputs, kv = self.compiled(attention_mask=attention_mask, position_ids=position_ids,
                                        past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                        use_cache=use_cache, **extra)
            key, value = self._store_prefix(self.runtime, request_id,
                                            [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in kv])
            return outputs, [(key.transpose(1, 2), value.transpose(1, 2)) for _ in kv]
        self.steps += 1
        with self.runtime.forward(self.request_ids[-1], "step", new_tokens=inputs_embeds[1].shape[1],
                                  attention_mask=attention_mask):
            return self.compiled(attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                                 **extra)
