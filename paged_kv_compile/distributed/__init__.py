"""Several ranks: a runtime per rank, sized by what the rank holds, whose decisions every rank shares.

`ParallelConfig` (parallel_config.py) says which parallelism runs and what this rank's pool holds;
`RankRuntime` (rank_runtime.py) wraps one rank's `PagedKVRuntime` so that every state change is agreed by all
ranks of the model-parallel group (agreement.py: one small all-reduce per decision, digests of the state). Importing
this package imports neither vLLM nor vllm-omni; docs/distributed.md says how to turn it on in a deployment.
"""

from __future__ import annotations

from .parallel_config import SUPPORTED_MODES, ParallelConfig, rank_pool_bytes
from .rank_runtime import RankRuntime, model_parallel_cpu_group

__all__ = ["SUPPORTED_MODES", "ParallelConfig", "RankRuntime", "model_parallel_cpu_group", "rank_pool_bytes"]
