"""Run vllm-omni's real model classes (DreamZero, HunyuanImage-3) on a CPU-only machine.

vllm-omni 0.30.0 has no CPU platform. Three shims make its layers run here, at tiny sizes, unchanged:

* its platform object becomes a `CpuOmniPlatform` (torch SDPA as the diffusion attention backend, one
  device, gloo, no peak-memory statistics): the instance `import vllm_omni` resolved changes class, so every
  module that bound it agrees;
* `SDPAImpl.forward` calls `_forward_impl(..., mask_mode="broadcast_k")`, which is what its CUDA path
  (`forward_cuda`) does; the base class only dispatches to named GPU platforms;
* vLLM's `dispatch_unquantized_gemm` returns `default_unquantized_gemm` (plain `F.linear`), as vllm-omni's
  own CPU tests do (tests/diffusion/models/dreamzero/test_qkv_fusion.py upstream): vLLM's CPU GEMM needs
  weights prepacked by a model loader.

Plus a stub for `torchvision.transforms` (imported by the HunyuanImage-3 module for its image preprocessor
only; torchvision's wheels here link CUDA libraries), a gloo process group through vllm-omni's own
`parallel_state`, and `model_context()` (forward context + diffusion config + vLLM config) to build and run
layers in. Nothing here changes a model line: the classes under test are the package's.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import os
import socket
import sys
import types
from typing import Any, Iterator

import torch

_INSTALLED = False
_DIST_READY = False


def _stub_torchvision() -> None:
    """A `torchvision.transforms` placeholder when torchvision is absent (only its import is needed)."""
    try:
        import torchvision  # noqa: F401
        return
    except Exception:  # absent, or a CUDA build that fails to load here
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    tv = types.ModuleType("torchvision")
    tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
    tv.__path__ = []  # a package, so `from torchvision import transforms` resolves the submodule
    transforms = types.ModuleType("torchvision.transforms")
    transforms.__spec__ = importlib.machinery.ModuleSpec("torchvision.transforms", None)

    def _unavailable(*_a: Any, **_k: Any):
        raise RuntimeError("torchvision is stubbed in this test environment (image preprocessing is not tested)")

    for name in ("Compose", "ToTensor", "Normalize"):  # what hunyuan_image3_transformer.py names
        setattr(transforms, name, _unavailable)
    tv.transforms = transforms
    sys.modules["torchvision"] = tv
    sys.modules["torchvision.transforms"] = transforms


def _make_cpu_platform():
    from vllm_omni.platforms.interface import UnspecifiedOmniPlatform

    class CpuOmniPlatform(UnspecifiedOmniPlatform):
        """vllm-omni's platform interface on CPU: SDPA attention, one device, gloo."""

        device_name = "cpu"
        device_type = "cpu"
        dispatch_key = "CPU"
        dist_backend = "gloo"

        @classmethod
        def get_diffusion_attn_backend_cls(cls, selected_backend, head_size, allow_trtllm_default=False) -> str:
            return "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend"

        @classmethod
        def get_device_count(cls) -> int:
            return 1

        @classmethod
        def set_device(cls, device) -> None:
            return None

        @classmethod
        def synchronize(cls) -> None:
            return None

        @classmethod
        def supports_torch_inductor(cls) -> bool:
            return True

        # The diffusion runner samples the device's peak memory around every request (torch.cpu keeps no
        # such statistics): report none, as a platform without a caching allocator would.
        @classmethod
        def reset_peak_memory_stats(cls, device=None) -> None:
            return None

        @classmethod
        def max_memory_reserved(cls, device=None) -> int:
            return 0

        @classmethod
        def max_memory_allocated(cls, device=None) -> int:
            return 0

    return CpuOmniPlatform


def install() -> None:
    """Apply the shims (idempotent). Must run before any other vllm-omni import in the process."""
    global _INSTALLED
    if _INSTALLED:
        return
    import vllm_omni.platforms as platforms  # imports transformers, which must not see the stub

    _stub_torchvision()

    # `import vllm_omni` already resolved the platform (UnspecifiedOmniPlatform here) and modules bound that
    # instance by name: turn that very object into the CPU platform instead of replacing it.
    platform = platforms.current_omni_platform
    platform.__class__ = _make_cpu_platform()

    from vllm_omni.diffusion.attention.backends import sdpa

    def forward(self, query, key, value, attn_metadata=None):
        return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")

    sdpa.SDPAImpl.forward = forward

    import vllm.model_executor.layers.linear as linear
    from vllm.model_executor.layers.utils import default_unquantized_gemm

    linear.dispatch_unquantized_gemm = lambda *_a, **_k: default_unquantized_gemm
    _INSTALLED = True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(*, rank: int = 0, world_size: int = 1, init_method: str | None = None) -> None:
    """Join a gloo world through vllm-omni's own `parallel_state` (once per process).

    One rank (the default): model-parallel groups of size 1 are made too. Several ranks (`multirank.py`): each
    worker passes its rank, the world size and a shared `init_method` (a `file://` store), and sets up the
    model-parallel groups it needs afterwards (`multirank.setup_model_parallel`)."""
    global _DIST_READY
    install()
    if _DIST_READY:
        return
    from vllm_omni.diffusion.distributed import parallel_state as ps

    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        init_method = "env://"
    ps.init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank,
                                    distributed_init_method=init_method, backend="gloo")
    if world_size == 1 and not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(backend="gloo")
    _DIST_READY = True


def diffusion_config(**overrides: Any):
    """A default `OmniDiffusionConfig` (SDPA attention on this platform, no parallelism)."""
    install()
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    return OmniDiffusionConfig(**overrides)


_VLLM_CONFIG = None


def vllm_config():
    """One default `VllmConfig` for the process (vLLM's layers read it at construction)."""
    global _VLLM_CONFIG
    install()
    if _VLLM_CONFIG is None:
        from vllm.config import VllmConfig

        _VLLM_CONFIG = VllmConfig()
    return _VLLM_CONFIG


@contextlib.contextmanager
def model_context(od_config=None) -> Iterator[Any]:
    """Build and run vllm-omni layers inside this: vLLM config, diffusion config, forward context."""
    init_distributed()
    from vllm.config import set_current_vllm_config
    from vllm_omni.diffusion.config import set_current_diffusion_config
    from vllm_omni.diffusion.forward_context import set_forward_context

    od = od_config if od_config is not None else diffusion_config()
    with set_current_vllm_config(vllm_config()), set_current_diffusion_config(od), \
            set_forward_context(omni_diffusion_config=od):
        yield od


# ---- tiny real layers ----------------------------------------------------------------------------------


def tiny_dreamzero_block(
    *, dim: int = 32, num_heads: int = 2, ffn_dim: int = 64, frame_seqlen: int = 8, num_frame_per_block: int = 2,
    max_chunk_size: int = 2, num_action_per_block: int = 3, num_state_per_block: int = 1, seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """vllm-omni's `CausalWanAttentionBlock` (t2v) with random weights, geometry as `CausalWanModel` sets it.

    The window is `local_attn_size = max_chunk_size * num_frame_per_block + 1` frames (CausalWanModel);
    call inside `model_context()`.
    """
    from vllm_omni.diffusion.models.dreamzero.causal_wan_model import CausalWanAttentionBlock

    torch.manual_seed(seed)
    local_attn_size = max_chunk_size * num_frame_per_block + 1
    block = CausalWanAttentionBlock(
        "t2v_cross_attn", dim, ffn_dim, num_heads, frame_seqlen, local_attn_size, 0, num_frame_per_block,
        True, True, 1e-6, num_action_per_block, num_state_per_block,
    )
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return block.to(dtype).eval()


def dreamzero_freqs(head_dim: int, *, frames: int, height: int, width: int, start_frame: int):
    """The RoPE tables `CausalWanModel` passes its blocks (video `freqs` for the chunk, action, state)."""
    from vllm_omni.diffusion.models.dreamzero.causal_wan_model import rope_params

    d = head_dim
    tables = [rope_params(1024, d - 4 * (d // 6)), rope_params(1024, 2 * (d // 6)), rope_params(1024, 2 * (d // 6))]
    f, h, w = frames, height, width
    freqs = torch.cat(
        [
            tables[0][start_frame : start_frame + f].view(f, 1, 1, -1).expand(f, h, w, -1),
            tables[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            tables[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(f * h * w, 1, -1)
    return freqs, rope_params(1024 * 10, d), rope_params(1024, d)


def tiny_hunyuan_config(**overrides: Any):
    """A tiny `HunyuanImage3Config`: 1 decoder layer, GQA 4/2 heads, dense MLP."""
    from vllm_omni.diffusion.models.hunyuan_image3.hunyuan_image3_transformer import HunyuanImage3Config

    kw = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attention_head_dim=8, num_experts=1, moe_layer_num_skipped=0,
        use_qk_norm=True, rms_norm_eps=1e-5, hidden_act="silu", max_position_embeddings=256, rope_theta=10000.0,
        attention_bias=False, use_cla=False, cla_share_factor=1,
    )
    kw.update(overrides)
    return HunyuanImage3Config(**kw)


def tiny_hunyuan_layer(config=None, *, seed: int = 0, layer_idx: int = 0):
    """vllm-omni's `HunyuanImage3DecoderLayer` with random weights; call inside `model_context()`."""
    from vllm_omni.diffusion.models.hunyuan_image3.hunyuan_image3_transformer import HunyuanImage3DecoderLayer

    torch.manual_seed(seed)
    layer = HunyuanImage3DecoderLayer(config or tiny_hunyuan_config(), None, layer_idx, prefix=f"layers.{layer_idx}")
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("layernorm.weight") else torch.randn_like(p) * 0.2)
    return layer.eval()


def tiny_dreamzero_model(
    *, num_layers: int = 2, dim: int = 32, num_heads: int = 2, frame_hw: tuple[int, int] = (4, 8),
    num_frame_per_block: int = 2, max_chunk_size: int = 2, num_action_per_block: int = 3, num_state_per_block: int = 1,
    text_len: int = 6, seed: int = 0,
):
    """vllm-omni's whole `CausalWanModel` (t2v) at a tiny size with random weights; inside `model_context()`.

    Latent frames are `frame_hw` (patch 1x2x2), so `frame_seqlen = h * w / 4`. `max_chunk_size=-1` gives the
    unbounded variant (a 21-frame window that slides, no window resets).
    """
    from vllm_omni.diffusion.models.dreamzero.causal_wan_model import CausalWanModel

    torch.manual_seed(seed)
    h, w = frame_hw
    model = CausalWanModel(
        model_type="t2v", patch_size=(1, 2, 2), frame_seqlen=h * w // 4, text_len=text_len, in_dim=4, dim=dim,
        ffn_dim=2 * dim, freq_dim=16, text_dim=8, out_dim=4, num_heads=num_heads, num_layers=num_layers,
        max_chunk_size=max_chunk_size, num_frame_per_block=num_frame_per_block, action_dim=4, max_state_dim=6,
        hidden_size=16, num_action_per_block=num_action_per_block, num_state_per_block=num_state_per_block,
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.1))
    return model.eval()


def _rope2d_keep_dtype(self, q, k, hidden_states, custom_pos_emb, **kwargs):
    """`HunYuanRotary2DEmbedder.__call__` (hunyuan_image3_transformer.py, vllm-omni 0.30.0) line for line, except
    the last two lines: q and k keep the input's dtype instead of `.to(torch.bfloat16)`."""
    hidden_states_shape = hidden_states.shape
    hidden_states = hidden_states.reshape(-1, hidden_states_shape[-1])
    if kwargs.get("mode", "gen_text") != "gen_image":
        return q, k
    first_step = kwargs.get("first_step", False)
    cos, sin = self._prepare_cos_sin(custom_pos_emb, first_step, q.device)
    query_lens = kwargs.get("query_lens")
    bs, q_len = len(query_lens), query_lens[0]
    assert hidden_states.shape[0] == bs * q_len, f"{hidden_states.shape[0]} != {bs * q_len}"
    dtype = q.dtype
    q = q.reshape(bs, q_len, self.num_heads, self.head_dim)
    k = k.reshape(bs, q_len, self.num_kv_heads, self.head_dim)
    q = self.rope(q.to(torch.float32), cos, sin)
    k = self.rope(k.to(torch.float32), cos, sin)
    q = q.reshape(hidden_states.shape[0], self.num_heads * self.head_dim).to(dtype)
    k = k.reshape(hidden_states.shape[0], self.num_kv_heads * self.head_dim).to(dtype)
    return q, k


@contextlib.contextmanager
def hunyuan_fp32_rope() -> Iterator[None]:
    """HunyuanImage-3's 2-D RoPE without its final bf16 cast, so that an fp32 run stays fp32 end to end (the
    oracle's dtype). The class's `__call__` is swapped for the block, then restored."""
    from vllm_omni.diffusion.models.hunyuan_image3.hunyuan_image3_transformer import HunYuanRotary2DEmbedder

    original = HunYuanRotary2DEmbedder.__call__
    HunYuanRotary2DEmbedder.__call__ = _rope2d_keep_dtype
    try:
        yield
    finally:
        HunYuanRotary2DEmbedder.__call__ = original
