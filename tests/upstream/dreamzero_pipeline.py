"""vllm-omni's `CausalWanModel` driven the way its `pipeline_dreamzero.py` (0.30.0) drives it.

Per pipeline call (`DreamZeroPipeline.forward`, `_prefill_kv_cache`, `diffuse`):
  1. when `current_start_frame >= local_attn_size` the window resets (history cleared, start frame 0);
  2. at start frame 0: a commit of ONE observed frame (`current_start_frame=0`, no action/state registers),
     then the start frame becomes 1;
  3. otherwise: a commit of the last `num_frame_per_block` observed frames at `current_start_frame - nfpb`
     (no registers);
  4. `steps` denoising forwards of the chunk at `current_start_frame`, with the action/state registers,
     whose K/V is thrown away;
  5. the start frame advances by `num_frame_per_block`.
Every forward runs once per CFG branch (positive, negative) as a separate batch-1 forward with that branch's
own KV cache; under CFG-parallel (vllm-omni's CFG group of 2) each rank runs its own branch only (rank 0 the
positive one) and the predictions are exchanged with the CFG group's `all_gather`, as `CFGParallelMixin.
predict_noise_maybe_with_cfg` does; the cross-attention K/V dicts are filled once per session per branch before the first forward
(`_kv_populate_cross`). The model code is the package's; only the cache a forward gets differs between the
dense oracle (`DenseKV`: the tensors the blocks return, carried forward on commits) and paged mode
(`PagedKV`: fixed-shape stand-ins, the runtime's plan around each forward).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

BRANCHES = (0, 1)  # positive, negative prompt


class DenseKV:
    """The dense legacy idiom: a growing (2, 1, L, H, D) cache per layer and branch, replaced on commit."""

    def __init__(self, model) -> None:
        attn = model.blocks[0].self_attn
        self.empty = torch.zeros(2, 1, 0, attn.tp_num_heads, attn.head_dim)
        self.num_layers = len(model.blocks)
        self.reset()

    def reset(self) -> None:
        self.caches = {b: [self.empty] * self.num_layers for b in BRANCHES}

    def get(self, branch: int) -> list[torch.Tensor]:
        return self.caches[branch]

    def forward(self, kind: str, branch: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def done(self, kind: str, branch: int, updated: list[torch.Tensor]) -> None:
        if kind == "commit":
            self.caches[branch] = updated


class PagedKV:
    """Paged mode: the runtime's stand-ins instead of caches, one planned forward per model call."""

    def __init__(self, model, runtime, session_id: str, forward: Callable[[str, int], Any]) -> None:
        attn = model.blocks[0].self_attn
        self.runtime, self.session_id, self._forward = runtime, session_id, forward
        self.standin = runtime.standin(2, 1, attn.max_attention_size, attn.tp_num_heads, attn.head_dim)
        self.num_layers = len(model.blocks)

    def reset(self) -> None:
        self.runtime.reset(self.session_id)

    def get(self, branch: int) -> list[torch.Tensor]:
        return [self.standin] * self.num_layers

    def forward(self, kind: str, branch: int) -> contextlib.AbstractContextManager:
        return self._forward(kind, branch)

    def done(self, kind: str, branch: int, updated) -> None:
        pass


def cross_attention_caches(model, context: torch.Tensor) -> list[dict]:
    """Per-layer text K/V dicts filled once, as `_kv_populate_cross` does (the blocks only read them)."""
    projected = model.text_embedding(context)
    out = []
    for block in model.blocks:
        ca = block.cross_attn
        n, d = ca.tp_num_heads, ca.head_dim
        out.append({"is_init": True, "k": ca.norm_k(ca.k(projected)).unflatten(2, (n, d)),
                    "v": ca.v(projected).unflatten(2, (n, d))})
    return out


def local_branches() -> tuple[int, ...]:
    """The CFG branches this rank computes: both, or under CFG-parallel its own (`CFGParallelMixin`: rank 0 runs
    the positive branch, rank 1 the negative one)."""
    from vllm_omni.diffusion.distributed import parallel_state as ps

    if not ps.is_cfg_group_initialized() or ps.get_classifier_free_guidance_world_size() == 1:
        return BRANCHES
    return (ps.get_classifier_free_guidance_rank(),)


def _gather_branches(preds: dict) -> dict:
    """Both branches' predictions on every rank: the CFG group's all_gather, when each rank computed one."""
    if len(preds) == len(BRANCHES):
        return preds
    from vllm_omni.diffusion.distributed.parallel_state import get_cfg_group

    (local,) = preds.values()
    gathered = [get_cfg_group().all_gather(t.contiguous(), separate_tensors=True) for t in local]
    return {b: tuple(g[b] for g in gathered) for b in BRANCHES}


def run_session(model, kv, *, calls: int, frame_hw: tuple[int, int] = (4, 8), steps: int = 2, seed: int = 0,
                cfg_scale: float = 2.0) -> dict:
    """`calls` pipeline calls of one session; returns per call the video/action predictions and resets."""
    g = torch.Generator().manual_seed(seed)
    nfpb, fs = model.num_frame_per_block, model.frame_seqlen
    local_attn_size = model.local_attn_size
    blk = model.blocks[0].self_attn
    nact, nstate = blk.num_action_per_block, blk.num_state_per_block
    h, w = frame_hw
    assert h * w // 4 == fs, f"frame_hw {frame_hw} does not give the model's frame_seqlen {fs} (patch 1x2x2)"
    text = torch.randn(1, model.text_len, model.text_embedding[0].in_features, generator=g)
    contexts = {0: text, 1: torch.zeros_like(text)}  # negative branch: the empty prompt's embedding
    mine = local_branches()
    cross = {b: cross_attention_caches(model, contexts[b]) for b in mine}
    state = torch.randn(1, nstate, model.state_encoder.layer1.W.shape[1], generator=g)
    csf, videos, actions, resets, forwards = 0, [], [], [], []

    def call(kind, x, timestep, seq_len, start, branch, **extra):
        with kv.forward(kind, branch):
            video, action, updated = model(x, timestep, contexts[branch], seq_len, kv.get(branch), start,
                                           crossattn_cache=cross[branch], **extra)
        kv.done(kind, branch, updated)
        forwards.append((kind, branch, start, seq_len + (nact + nstate if "action" in extra else 0)))
        return video, action

    for index in range(calls):
        obs = torch.randn(1, 4, nfpb, h, w, generator=g)
        if local_attn_size != -1 and csf >= local_attn_size:
            kv.reset()
            csf = 0
            resets.append(index)
        if csf == 0:
            for b in mine:
                call("commit", obs[:, :, :1], torch.zeros(1, 1, dtype=torch.long), fs, 0, b)
            csf = 1
        if csf != 1:
            for b in mine:
                call("commit", obs, torch.zeros(1, nfpb, dtype=torch.long), nfpb * fs, csf - nfpb, b)
        noisy = torch.randn(1, 4, nfpb, h, w, generator=g)
        noisy_action = torch.randn(1, nact, 4, generator=g)
        for step in range(steps):
            t = 1000 - step * (1000 // steps)
            preds = {}
            for b in mine:
                preds[b] = call("denoise", noisy, torch.full((1, nfpb), t, dtype=torch.long), nfpb * fs, csf, b,
                                action=noisy_action, timestep_action=torch.full((1, nact), t, dtype=torch.long),
                                state=state)
            preds = _gather_branches(preds)
            video = preds[1][0] + cfg_scale * (preds[0][0] - preds[1][0])
            action = preds[1][1] + cfg_scale * (preds[0][1] - preds[1][1])
            noisy, noisy_action = noisy - 0.2 * video, noisy_action - 0.2 * action
        videos.append(noisy)
        actions.append(noisy_action)
        csf += nfpb
    return {"video": torch.stack(videos), "actions": torch.stack(actions), "resets": resets, "forwards": forwards}
