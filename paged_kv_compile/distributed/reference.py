"""Our reference models split across ranks the way vllm-omni splits the real ones (for examples/multirank.py and
the multi-rank tests: they are simpler to read than vllm-omni's layers when something fails).

* `shard_heads(model, parallel, group)`: tensor parallel, in place. Each self-attention keeps its rank's heads
  (vLLM's `QKVParallelLinear` split: query heads `[r*H/TP, (r+1)*H/TP)`, KV heads `Hkv/TP`, or, when TP > Hkv, the
  one KV head those query heads read, replicated) and its output projection becomes row-parallel: the rank's input
  columns, then an all-reduce over `group` (the bias added once, on TP rank 0). The rest of the model is
  replicated. The cache stand-ins follow, because the families size them from the attention modules.
* `CfgBranch(model, parallel, group)`: CFG-parallel for DreamZero's loop, which runs both CFG rows in one batch:
  the wrapper runs this rank's branch (vllm-omni's round robin: branch i on CFG rank i) as a batch-1 forward and
  all-gathers the branch outputs over `group`, so the loop's CFG combine sees both, as `CFGParallelMixin` does.
* `shard_sequence(model, parallel, group)`: Ulysses sequence parallel for DreamZero, in place. The model's
  tokens are split across the Ulysses group (rank order is sequence order) before the blocks and gathered after;
  in each self-attention an all-to-all trades this rank's tokens with every head for every token with H/U heads,
  which are attended and cached (the pool holds those heads), and a second one trades them back. Cross-attention
  runs on the rank's tokens with every head (its K/V are the dense per-session ones, not a shared region).
* `rank_run(model, runtime, rows=..., **loop)`: `driver.paged_run` for a rank that holds `rows` of the owner's rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..driver import PagedHooks, paged_run
from ..models.dreamzero import DreamZeroModel
from ..models.hunyuan_image3 import HunyuanImage3Model
from .parallel_config import ParallelConfig


class RowParallelLinear(nn.Module):
    """`linear` over this rank's slice of the input features, summed over the tensor-parallel group."""

    def __init__(self, linear: nn.Linear, columns: slice, first_rank: bool, group: Any) -> None:
        super().__init__()
        self.linear = nn.Linear(columns.stop - columns.start, linear.out_features, bias=linear.bias is not None)
        self.group = group
        with torch.no_grad():
            self.linear.weight.copy_(linear.weight[:, columns])
            if linear.bias is not None:
                self.linear.bias.copy_(linear.bias if first_rank else torch.zeros_like(linear.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        dist.all_reduce(out, group=self.group)
        return out


def _rows(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A Linear keeping the output features `rows` of `linear`."""
    out = nn.Linear(linear.in_features, len(rows), bias=linear.bias is not None)
    with torch.no_grad():
        out.weight.copy_(linear.weight[rows])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[rows])
    return out


def _heads(first: int, count: int, head_dim: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset + first * head_dim, offset + (first + count) * head_dim)


def shard_heads(model: nn.Module, parallel: ParallelConfig, group: Any) -> nn.Module:
    """Tensor-parallel `model` in place (a DreamZeroModel or HunyuanImage3Model); see the module docstring."""
    tp, r = parallel.tensor_parallel, parallel.tp_rank
    if tp == 1:
        return model
    if isinstance(model, DreamZeroModel):
        attns = [block.self_attn for block in model.blocks]
        for attn in attns:
            H, D = attn.num_heads, attn.head_dim
            local = H // tp
            if H % tp:
                raise ValueError(f"{H} heads cannot be split across tensor_parallel={tp}")
            rows = torch.cat([_heads(r * local, local, D, part * H * D) for part in range(3)])  # [q | k | v]
            attn.qkv = _rows(attn.qkv, rows)
            attn.o = RowParallelLinear(attn.o, slice(r * local * D, (r + 1) * local * D), r == 0, group)
            attn.num_heads = local
        return model
    if isinstance(model, HunyuanImage3Model):
        for layer in model.layers:
            attn = layer.self_attn
            Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
            q_local, kv_local = Hq // tp, parallel.tp_kv_heads(Hkv)
            kv_first = r * Hkv // tp if Hkv >= tp else r // (tp // Hkv)  # vLLM's replicated KV head of this rank
            rows = torch.cat([_heads(r * q_local, q_local, D), _heads(kv_first, kv_local, D, Hq * D),
                              _heads(kv_first, kv_local, D, (Hq + Hkv) * D)])
            attn.qkv_proj = _rows(attn.qkv_proj, rows)
            attn.o_proj = RowParallelLinear(attn.o_proj, slice(r * q_local * D, (r + 1) * q_local * D), r == 0, group)
            attn.num_heads, attn.num_kv_heads, attn.n_rep = q_local, kv_local, q_local // kv_local
        return model
    raise TypeError(f"shard_heads knows DreamZeroModel and HunyuanImage3Model, not {type(model).__name__}")


class CfgBranch(nn.Module):
    """This rank's CFG branch of a DreamZeroModel, for the loop that batches both branches (module docstring)."""

    def __init__(self, model: DreamZeroModel, parallel: ParallelConfig, group: Any) -> None:
        super().__init__()
        if parallel.cfg_parallel != 2:
            raise ValueError(f"DreamZero has 2 CFG branches; CfgBranch needs cfg_parallel=2, got {parallel.cfg_parallel}")
        self.model, self.group = model, group
        self.branch = parallel.local_branches(2)[0]
        self.cfg, self.blocks = model.cfg, model.blocks

    def prepare_cross_kv(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        return self.model.prepare_cross_kv(*args, **kwargs)

    def forward(self, latents, actions, timestep, start_frame, kv_caches, cross_kvs, update_kv_cache):
        b = slice(self.branch, self.branch + 1)
        video, action, _ = self.model(latents[b], actions[b], timestep[b], start_frame, [c[:, b] for c in kv_caches],
                                      [c[:, b] for c in cross_kvs], update_kv_cache)
        return _all_gather(video, self.group, 0), _all_gather(action, self.group, 0), kv_caches


def _all_gather(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Every rank's `x` of `group`, joined along `dim` in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


class _TokensToHeads(nn.Module):
    """Ulysses' first all-to-all: (B, S/U, H, D), this rank's tokens -> (B, S, H/U, D), this rank's heads; the
    layout of vllm-omni's `all_to_all_4D` (diffusion/distributed/comm.py): the received buffer is
    (U, S/U, B, H/U, D), read sequence-major. Inside the compiled blocks (dynamo traces `dist.all_to_all_single`
    as a functional collective)."""

    def __init__(self, group: Any, degree: int) -> None:
        super().__init__()
        self.group, self.degree = group, degree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h, d = x.shape
        send = x.reshape(b, s, self.degree, h // self.degree, d).transpose(0, 2).contiguous()  # (U, s, B, h/U, d)
        got = self.exchange(send)  # got[j]: rank j's tokens, this rank's heads
        return got.reshape(self.degree * s, b, h // self.degree, d).transpose(0, 1)

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        """send[j] to rank j; returns what rank j sent at [j] (as vllm-omni: into a buffer, in place)."""
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send, group=self.group)
        return got


class _HeadsToTokens(_TokensToHeads):
    """Ulysses' second all-to-all, the inverse: (B, S, H/U, D) -> (B, S/U, H, D) (`all_to_all_4D`'s other way)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h, d = x.shape
        send = x.reshape(b, self.degree, s // self.degree, h, d).permute(1, 3, 2, 0, 4).contiguous()  # U, h, s/U, B, d
        got = self.exchange(send)  # got[j]: this rank's tokens, rank j's heads
        return got.reshape(self.degree * h, s // self.degree, b, d).transpose(0, 2)


class _ShardTokens(nn.Module):
    """This rank's contiguous share of the tokens (B, S, dim) -> (B, S/U, dim): rank order is sequence order."""

    def __init__(self, rank: int, degree: int) -> None:
        super().__init__()
        self.rank, self.degree = rank, degree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] % self.degree:
            raise ValueError(f"{x.shape[1]} tokens per forward cannot be split across ulysses={self.degree} ranks; "
                             "make frame_seqlen x frames + action_register_length a multiple of the degree")
        share = x.shape[1] // self.degree
        return x[:, self.rank * share:(self.rank + 1) * share].contiguous()  # blocks see one stride: one frame


class _GatherTokens(nn.Module):
    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_gather(x, self.group, 1)


def shard_sequence(model: DreamZeroModel, parallel: ParallelConfig, group: Any) -> DreamZeroModel:
    """Ulysses sequence parallel for a DreamZeroModel, in place (module docstring); `group`: the Ulysses group."""
    u = parallel.ulysses
    if u == 1:
        return model
    if not isinstance(model, DreamZeroModel):
        raise TypeError(f"shard_sequence knows DreamZeroModel, not {type(model).__name__}")
    for block in model.blocks:
        attn = block.self_attn
        if attn.num_heads % u:
            raise ValueError(f"{attn.num_heads} heads cannot be split across ulysses={u}")
        attn.tokens_to_heads, attn.heads_to_tokens = _TokensToHeads(group, u), _HeadsToTokens(group, u)
        attn.num_heads //= u
    model.shard_tokens, model.gather_tokens = _ShardTokens(parallel.ulysses_rank, u), _GatherTokens(group)
    return model


def _inner(model: nn.Module) -> nn.Module:
    return model.model if isinstance(model, CfgBranch) else model


class RankHooks(PagedHooks):
    """`PagedHooks` for a model this rank holds part of (its family found through a CfgBranch wrapper)."""

    def caches(self, model: nn.Module, batch: int, **geometry: Any) -> list:
        return super().caches(_inner(model), batch, **geometry)


def rank_run(model: nn.Module, runtime: Any, *, rows: int | None = None, owner_id: str = "owner", **loop: Any) -> Any:
    """One session/request of the model's loop on this rank's runtime, admitted with this rank's `rows`."""
    return paged_run(model, runtime, owner_id=owner_id, make_hooks=RankHooks, rows=rows, family_model=_inner(model),
                     **loop)
