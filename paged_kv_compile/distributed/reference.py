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

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts)

    def forward(self, latents, actions, timestep, start_frame, kv_caches, cross_kvs, update_kv_cache):
        b = slice(self.branch, self.branch + 1)
        video, action, _ = self.model(latents[b], actions[b], timestep[b], start_frame, [c[:, b] for c in kv_caches],
                                      [c[:, b] for c in cross_kvs], update_kv_cache)
        return self._gather(video), self._gather(action), kv_caches


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
