"""ParallelConfig: which parallelism the engine runs, this rank's place in it, and the pool this rank holds.

A runtime runs per rank and holds what that rank's attention reads:
  * tensor parallel (TP): the rank's KV heads, `Hkv / TP`; when TP > Hkv, vLLM replicates KV heads so that every
    rank has one (`QKVParallelLinear`: `num_kv_heads = max(1, Hkv // tp)`, each head held by TP / Hkv ranks), and
    the replicated copies cost memory on each of those ranks: they are counted, not hidden;
  * Ulysses sequence parallel (U): after the all-to-all the attention sees every token with `heads / U` heads, so
    the pool holds every token for `ceil(Hkv_tp / U)` KV heads (vllm-omni's `advanced_uaa` pads KV heads up to a
    multiple of U; the padded heads are counted);
  * CFG-parallel (C): each rank holds its own CFG branches' rows (vllm-omni's round-robin `_dispatch_branches`:
    branch i on CFG rank i % C), so a one-rank configuration's `max_rows` and managed blocks split C ways.
Ring attention and KV-gather (vllm-omni's `allgather_degree`) give each rank a slice of the SEQUENCE: no rank
holds a whole row's history, so a block table cannot describe it; they are refused, as is pipeline parallel
(each stage would hold different layers; nothing here splits a pool by layer).

`ParallelConfig.from_vllm_omni()` reads vllm-omni's `parallel_state` getters; explicit arguments describe a
deployment without it (or a test). `ParallelConfig.resolve(explicit)` checks the two against each other.
Nothing here imports vLLM or vllm-omni until `from_vllm_omni` is called.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from ..config import PagedKVConfig
from ..errors import ConfigError
from ..pool import KVPool

SUPPORTED_MODES = "tensor parallel, CFG-parallel and Ulysses sequence parallel (and their products)"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the engine's parallel groups and this rank's index in each (0-based)."""

    tensor_parallel: int = 1
    cfg_parallel: int = 1
    ulysses: int = 1
    ring: int = 1
    kv_gather: int = 1
    pipeline_parallel: int = 1
    tp_rank: int = 0
    cfg_rank: int = 0
    ulysses_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "cfg_parallel", "ulysses", "ring", "kv_gather", "pipeline_parallel"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"ParallelConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")
        for rank, size in (("tp_rank", "tensor_parallel"), ("cfg_rank", "cfg_parallel"), ("ulysses_rank", "ulysses")):
            if not 0 <= getattr(self, rank) < getattr(self, size):
                raise ConfigError(
                    f"ParallelConfig.{rank}={getattr(self, rank)} is outside [0, {size}={getattr(self, size)})"
                )
        sliced = [f"{name}={getattr(self, name)}" for name in ("ring", "kv_gather") if getattr(self, name) > 1]
        if sliced:
            raise ConfigError(
                f"{' and '.join(sliced)}: ring attention and KV-gather keep a slice of each sequence per rank, which "
                f"no rank's block table can describe; paged KV supports {SUPPORTED_MODES}. Use ulysses_degree "
                "instead of ring_degree / allgather_degree"
            )
        if self.pipeline_parallel > 1:
            raise ConfigError(
                f"pipeline_parallel={self.pipeline_parallel}: a pipeline stage holds a subset of the layers and paged "
                f"KV sizes one pool over all of a model's layers; supported: {SUPPORTED_MODES}"
            )

    # ---- where the configuration comes from ---------------------------------------------------------
    @classmethod
    def from_vllm_omni(cls) -> "ParallelConfig":
        """This rank's configuration from vllm-omni's `parallel_state` (its groups must be initialised)."""
        from vllm.distributed import parallel_state as vllm_ps
        from vllm_omni.diffusion.distributed import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise ConfigError(
                "vllm-omni's model-parallel groups are not initialised: call parallel_state.initialize_model_parallel"
                "(...) first (the diffusion worker does), or pass an explicit ParallelConfig"
            )
        sp = ps.get_sp_group()
        return cls(
            tensor_parallel=vllm_ps.get_tensor_model_parallel_world_size(),
            cfg_parallel=ps.get_classifier_free_guidance_world_size(),
            ulysses=ps.get_ulysses_parallel_world_size(),
            ring=ps.get_ring_parallel_world_size(),
            kv_gather=getattr(sp, "allgather_world_size", 1),
            pipeline_parallel=ps.get_pipeline_parallel_world_size(),
            tp_rank=vllm_ps.get_tensor_model_parallel_rank(),
            cfg_rank=ps.get_classifier_free_guidance_rank(),
            ulysses_rank=ps.get_ulysses_parallel_rank(),
        )

    @classmethod
    def resolve(cls, explicit: "ParallelConfig | None" = None, *, engine: "ParallelConfig | None" = None) -> "ParallelConfig":
        """The configuration to use: `explicit`, vllm-omni's (`engine`, read with `from_vllm_omni` when vllm-omni's
        groups exist and it is not given), or both when they agree; a mismatch is a ConfigError naming each field."""
        if engine is None:
            engine = _engine_or_none()
        if explicit is None or engine is None:
            if explicit is None and engine is None:
                raise ConfigError(
                    "no parallel configuration: initialise vllm-omni's parallel_state or pass ParallelConfig(...)"
                )
            return explicit or engine
        differ = [f"{f.name}: given {getattr(explicit, f.name)}, vllm-omni has {getattr(engine, f.name)}"
                  for f in dataclasses.fields(cls) if getattr(explicit, f.name) != getattr(engine, f.name)]
        if differ:
            raise ConfigError(
                "the explicit ParallelConfig disagrees with vllm-omni's parallel_state (" + "; ".join(differ)
                + "): pass the engine's configuration (ParallelConfig.from_vllm_omni()) or none"
            )
        return explicit

    # ---- what this rank holds ----------------------------------------------------------------------------
    @property
    def head_shards(self) -> int:
        """Into how many parts the heads are split (TP x Ulysses)."""
        return self.tensor_parallel * self.ulysses

    @property
    def model_parallel_size(self) -> int:
        """Ranks that serve one request together (TP x Ulysses x CFG)."""
        return self.tensor_parallel * self.ulysses * self.cfg_parallel

    def tp_kv_heads(self, total_kv_heads: int) -> int:
        """KV heads each rank's projection produces under tensor parallel (vLLM's `QKVParallelLinear` rule)."""
        tp = self.tensor_parallel
        if total_kv_heads >= tp:
            if total_kv_heads % tp:
                raise ConfigError(f"{total_kv_heads} KV heads cannot be split across tensor_parallel={tp} ranks "
                                  "(vLLM requires Hkv % TP == 0): pick a TP that divides the KV heads")
            return total_kv_heads // tp
        if tp % total_kv_heads:
            raise ConfigError(f"tensor_parallel={tp} > {total_kv_heads} KV heads requires TP % Hkv == 0 "
                              "(vLLM replicates each KV head on TP / Hkv ranks)")
        return 1

    def local_kv_heads(self, total_kv_heads: int) -> int:
        """KV heads this rank's pool holds: the TP shard, then the Ulysses share after the all-to-all
        (padded up to a multiple of U as vllm-omni's advanced_uaa does)."""
        return _ceil_div(self.tp_kv_heads(total_kv_heads), self.ulysses)

    def kv_replication(self, total_kv_heads: int) -> float:
        """Stored KV heads over all head shards / the model's KV heads: 1.0 when nothing is replicated or padded."""
        return self.local_kv_heads(total_kv_heads) * self.head_shards / total_kv_heads

    def local_branches(self, branches: int) -> list[int]:
        """Which of `branches` CFG branches (rows of one request) this rank computes: vllm-omni's round-robin
        `_dispatch_branches` (branch i on CFG rank i % C)."""
        return [b for b in range(branches) if b % self.cfg_parallel == self.cfg_rank]

    def local_rows(self, rows: int) -> int:
        """How many of `rows` rows (CFG branches, round-robin) this rank holds; at least 1 (a rank of a CFG group
        wider than the branches still runs a forward)."""
        return max(1, len(self.local_branches(rows)))

    def rank_config(self, one_rank: PagedKVConfig) -> PagedKVConfig:
        """This rank's pool for the workload `one_rank` describes on one device: local KV heads, and under
        CFG-parallel this rank's share of the rows (`max_rows`, managed blocks or byte budget divided by C,
        rounded up: the rank with most branches must fit). With `budget_bytes` the budget scales with what the
        rank holds, so its block count equals the one-rank count (within one block per layer)."""
        rows = self.local_rows(one_rank.max_rows)
        heads = self.local_kv_heads(one_rank.num_kv_heads)
        sized: dict = {"num_kv_heads": heads, "max_rows": rows,
                       "buckets": tuple(dict.fromkeys(dataclasses.replace(b, rows=self.local_rows(b.rows)) for b in one_rank.buckets))}
        if one_rank.blocks_per_layer is not None:
            sized["blocks_per_layer"] = max(1, _ceil_div(one_rank.blocks_per_layer * rows, one_rank.max_rows))
        else:
            sized["budget_bytes"] = _ceil_div(one_rank.budget_bytes * heads * rows,
                                              one_rank.num_kv_heads * one_rank.max_rows)
        return dataclasses.replace(one_rank, **sized)

    def describe(self) -> str:
        parts = [f"TP {self.tensor_parallel}", f"CFG {self.cfg_parallel}", f"Ulysses {self.ulysses}"]
        ranks = f"tp_rank {self.tp_rank}, cfg_rank {self.cfg_rank}, ulysses_rank {self.ulysses_rank}"
        return f"{' x '.join(parts)} ({ranks})"


def _engine_or_none() -> ParallelConfig | None:
    """vllm-omni's configuration when its groups are initialised in this process, else None. Not imported here: a
    process whose engine set up groups has imported vllm-omni's parallel_state already."""
    ps = sys.modules.get("vllm_omni.diffusion.distributed.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        return None
    return ParallelConfig.from_vllm_omni()


def rank_pool_bytes(one_rank: PagedKVConfig, parallel: ParallelConfig) -> dict:
    """What one rank's pool costs next to the one-rank pool of the same workload (no allocation): for the docs'
    memory table and the per-rank bytes test."""
    local = parallel.rank_config(one_rank)
    one = KVPool.nbytes_for(one_rank)
    mine = KVPool.nbytes_for(local)
    return {
        "kv_heads": local.num_kv_heads,
        "kv_replication": parallel.kv_replication(one_rank.num_kv_heads),
        "rows": local.max_rows,
        "blocks_per_layer": KVPool.blocks_per_layer_for(local),
        "bytes": mine,
        "one_rank_bytes": one,
        "ratio": mine / one,
    }
