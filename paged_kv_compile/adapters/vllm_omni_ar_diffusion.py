"""Our runtime behind vllm-omni's AR-Diffusion runner: the KV state its DreamZero pipeline drives.

vllm-omni 0.30.0's `ARDiffusionModelRunner` owns sessions (LRU, reset, warm-up requests, fail-closed release)
and binds one session's KV state to the pipeline per invocation (`bind_ar_diffusion_state`). The pipeline
reaches that state only through a few calls (`pipeline_dreamzero.py`: `_kv_get`, `_kv_commit`, `_kv_get_cross`,
`_kv_populate_cross`, `_kv_reset`), and its model asks the per-layer contexts `_kv_get` returns for exactly
two things (`causal_wan_model.py: CausalWanModel._forward_blocks`): `forward_ctx.prepare(device, action_len,
query_len)` once per branch forward, right before the blocks run, and `to_layer_inputs()` per layer.

`DreamZeroPagedKV` (the runner's `kv_cache`) and `PagedKVSessionState` (a session's state) answer those same
calls with our runtime: `to_layer_inputs()` hands each block a cache stand-in, so the block takes its dense
branch (`kv_cache[0]`/`kv_cache[1]`, the window idiom) and the `paged_kv` backend rewrites it into
`paged_kv::write_attend` over our pool; `prepare` opens the runtime's forward for that CFG branch (one batch-1
row, as the pipeline runs them), a commit closes it through `commit_paged_context`, and a denoising forward is
closed when the next forward starts or the runner's invocation ends (`end_invocation`, called by
`vllm_omni_ar_runner.PagedKVARDiffusionModelRunner`). Branch names map to rows through the pipeline's own
`ARDiffusionKVBranchSpec.local_index`: two rows on one rank, one row per rank under CFG-parallel.

Nothing here imports vllm or vllm-omni (the runner subclass, which must, lives in `vllm_omni_ar_runner`).
Cross-attention K/V stay per session and branch, as vllm-omni keeps them (`populate_cross_attention`): the
model reads them from a dict, so they are not paged.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterable, Sequence

import torch

from ..config import FP8_DTYPES, PagedKVConfig
from ..errors import CapacityError, ConfigError, KernelUnavailableError, RequestError
from ..families.dreamzero import DreamZeroSpec, session_blocks_per_row
from ..pool import KVPool
from ..runtime import PagedKVRuntime

START_FRAME_SOURCE = "L['current_start_frame']"  # torch.compiler.config.dynamic_sources entry (docs/models.md)


def parse_kv_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A configuration's pool dtype ("float8_e4m3fn", "float8_e5m2", a torch dtype, or None: the compute dtype)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"kv_dtype={name!r} is not a torch dtype; use float8_e4m3fn, float8_e5m2 or leave it unset")
    return dtype


def dreamzero_spec(transformer) -> DreamZeroSpec:
    """The session spec of vllm-omni's `CausalWanModel` as its pipeline drives it (window reset at
    `local_attn_size`, so a row never holds more than the commits before the reset)."""
    spec = DreamZeroSpec.from_vllm_omni(transformer)
    if transformer.local_attn_size != -1:
        spec = dataclasses.replace(spec, reset_frames=int(transformer.local_attn_size))
    return spec


@dataclasses.dataclass(frozen=True)
class KVBudget:
    """What one session costs and how many fit: vllm-omni's budget rule applied to our pool."""

    kv_bytes_per_session: int  # managed self-attention blocks of every local branch, all layers
    cross_bytes_per_session: int  # cross-attention K/V, every branch (kept per session, as vllm-omni does)
    model_state_bytes_per_session: int  # what the pipeline declares it keeps per session outside KV
    fixed_bytes: int  # scratch rows and the pad block
    budget_bytes: int
    session_capacity: int
    blocks_per_layer: int


class _BlockPoolView:
    """`kv_cache.manager.block_pool.get_num_free_blocks()`, which the base runner's warm-up reads."""

    def __init__(self, runtime: PagedKVRuntime) -> None:
        self._runtime = runtime

    def get_num_free_blocks(self) -> int:
        return self._runtime.scheduler.allocator.num_free


class DreamZeroPagedKV:
    """The runner's `kv_cache`: our runtime sized for vllm-omni's `ARDiffusionKVCacheSpec` and budget.

    The pool, budget, branches and cross-attention K/V are the capability's, shared by every AR-Diffusion model; what
    is per model is the session spec (`session_spec`), the session state (`begin_session`), the cache stand-in and
    the block arguments dynamo must treat as values (`dynamic_sources`). This class serves DreamZero;
    `vllm_omni_ar_lingbot.LingBotPagedKV` serves LingBot-World."""

    #: the blocks' int arguments that are values, not shapes (torch.compiler.config.dynamic_sources entries)
    dynamic_sources: tuple[str, ...] = (START_FRAME_SOURCE,)
    #: whether the model writes its cache stand-in in place (a real buffer the passes stop writing), else zero-stride
    writable_standin: bool = False

    def __init__(self, runtime: PagedKVRuntime, ar_spec: Any, spec: DreamZeroSpec, budget: KVBudget,
                 transformer: Any = None) -> None:
        self.runtime = runtime
        self.transformer = transformer
        self.ar_spec = ar_spec
        self.spec = spec
        self.budget = budget
        self.kv_branches = tuple(ar_spec.kv_branches)
        self.rows = max(b.local_index for b in self.kv_branches) + 1
        self.branch_rows = {b.name: b.local_index for b in self.kv_branches}
        self.cross_attention_lengths = dict(ar_spec.cross_attention_lengths)
        self.cross_attention_kv_heads = {
            name: int(ar_spec.cross_attention_kv_heads.get(name, ar_spec.num_kv_heads))
            for name in self.cross_attention_lengths
        }
        self.session_capacity = budget.session_capacity
        self.num_blocks = runtime.pool.blocks_per_layer
        self.manager = type("_Manager", (), {})()
        self.manager.block_pool = _BlockPoolView(runtime)
        self._owner_ids = itertools.count()
        self.standin = runtime.standin(2, 1, spec.window_tokens, ar_spec.num_kv_heads, ar_spec.head_size,
                                       writable=self.writable_standin)
        self._batch_standins = {1: self.standin}

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def build(cls, transformer, ar_spec, *, available_bytes: int, memory_fraction: float, dtype: torch.dtype,
              device: str | torch.device = "cpu", block_size: int | None = None, kernel: str = "auto",
              inner_compiler: str = "inductor", kv_dtype: torch.dtype | None = None,
              kv_scales: dict | None = None, sessions_per_forward: int = 1) -> "DreamZeroPagedKV":
        """Size the pool as vllm-omni sizes its own (`ARDiffusionKVCache.__init__`): the budget is
        `available_bytes * memory_fraction`, raised to one session if that fits the device, and every resident
        session needs its whole window in every local branch, its cross-attention K/V and the model state the
        pipeline declares; the session count is capped by the spec's `session_capacity`.

        An FP8 `kv_dtype` halves the blocks' bytes (more sessions in the same budget); `kv_scales` {"k", "v"}
        sets its static scales (1.0 by default). `sessions_per_forward` > 1 sizes the scratch and the shape buckets
        for forwards that carry that many sessions' rows of one branch (`run_batched`). A kernel that cannot read
        the pool is refused here, naming why."""
        spec = cls.session_spec(transformer, ar_spec)
        block_size = block_size or spec.frame_seqlen  # any size: a block holds tokens of any frames
        rows = max(b.local_index for b in ar_spec.kv_branches) + 1
        if sessions_per_forward < 1:
            raise ConfigError(f"sessions_per_forward must be >= 1, got {sessions_per_forward}")
        base = PagedKVConfig(
            num_layers=ar_spec.num_layers, num_kv_heads=ar_spec.num_kv_heads, head_dim=ar_spec.head_size,
            block_size=block_size, blocks_per_layer=1, max_rows=max(rows, sessions_per_forward),
            scratch_tokens_per_row=spec.tokens_per_forward,
            buckets=tuple(b for k in range(1, sessions_per_forward + 1) for b in spec.buckets(rows=k)), dtype=dtype,
            device=str(device), kernel=kernel,
            inner_compiler=inner_compiler, kv_dtype=kv_dtype, kv_gaps=spec.has_gaps(block_size),
        )
        budget = plan_budget(ar_spec, spec, base, available_bytes=available_bytes, memory_fraction=memory_fraction,
                             rows=rows)
        runtime = cls.group_runtime(PagedKVRuntime(dataclasses.replace(base, blocks_per_layer=budget.blocks_per_layer)))
        _check_kernel(runtime, kernel, ar_spec)
        if kv_scales is not None:
            _set_scales(runtime, kv_scales)
        runtime.bind(transformer.blocks)
        return cls(runtime, ar_spec, spec, budget, transformer)

    @classmethod
    def group_runtime(cls, runtime: PagedKVRuntime) -> Any:
        """The runtime the sessions use: this rank's own (here), or one whose decisions the ranks vote on."""
        return runtime

    @classmethod
    def session_spec(cls, transformer, ar_spec) -> DreamZeroSpec:
        """The spec every session of this pipeline is admitted with, refused where the pipeline's
        `ARDiffusionKVCacheSpec` does not describe its transformer."""
        spec = dreamzero_spec(transformer)
        if ar_spec.tokens_per_frame != spec.frame_seqlen or ar_spec.num_layers != len(transformer.blocks):
            raise ConfigError(
                f"the pipeline's ARDiffusionKVCacheSpec ({ar_spec.num_layers} layers, {ar_spec.tokens_per_frame} "
                f"tokens/frame) does not describe its transformer ({len(transformer.blocks)} blocks, "
                f"{spec.frame_seqlen} tokens/frame)"
            )
        return spec

    # ---- sessions ---------------------------------------------------------------------------------
    def begin_session(self, session_id: str) -> "PagedKVSessionState":
        return PagedKVSessionState(self, session_id)

    def row_of(self, kv_branch: str) -> int:
        try:
            return self.branch_rows[kv_branch]
        except KeyError:
            raise RequestError(
                f"unknown KV branch {kv_branch!r}; this pipeline declares {tuple(self.branch_rows)}"
            ) from None

    # ---- several sessions' rows in one model call ---------------------------------------------------
    def run_batched(self, transformer, calls: Sequence[dict]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One model call for the parked `_predict_noise_eager` calls of several sessions (same signature:
        `batch_signature`): rows stacked in call order, one `runtime.forward_batch` over their owners (a failure
        rolls every owner back), each call's (video, action) rows back. The model gets batch-K stand-ins, not the
        flagged per-session contexts, so it takes its dense cache branch, which the compiled blocks rewrite."""
        forwards = [_branch_forward_of(c) for c in calls]
        for forward in forwards:
            forward.state._start_batched(forward)
        k = len(calls)
        if k not in self._batch_standins:
            self._batch_standins[k] = self.runtime.standin(2, k, self.spec.window_tokens, self.ar_spec.num_kv_heads,
                                                           self.ar_spec.head_size)
        first = calls[0]
        stacked = {name: _stack([c.get(name) for c in calls], name) for name in _BATCHED_TENSORS}
        cross = [
            {key: (True if key == "is_init" else torch.cat([c["crossattn_cache"][layer][key] for c in calls]))
             for key in first["crossattn_cache"][layer]}
            for layer in range(len(first["crossattn_cache"]))
        ] if first.get("crossattn_cache") else None
        items = [(f.state._live_owner(), "commit" if f.commit_current else "denoise",
                  {"branch": self.row_of(f.kv_branch)}) for f in forwards]
        registers = 0 if stacked["action"] is None else stacked["action"].shape[1] + stacked["state_features"].shape[1]
        with self.runtime.forward_batch(items) as active:
            if active.plan.tokens != first["seq_len"] + registers:
                raise RequestError(
                    f"the runtime planned {active.plan.tokens} tokens for this batched {active.plan.kind} forward of "
                    f"branch {forwards[0].kv_branch!r} but the model runs {first['seq_len'] + registers}: the "
                    "sessions' windows and the pipeline disagree (a commit outside the window, or a missed reset)"
                )
            video, action, _ = transformer(
                x=stacked["hidden_states"], timestep=stacked["timestep_video"],
                context=stacked["encoder_hidden_states"], seq_len=first["seq_len"],
                kv_cache=[self._batch_standins[k]] * len(transformer.blocks), crossattn_cache=cross,
                current_start_frame=first["current_start_frame"], y=stacked["y"],
                clip_feature=stacked["clip_feature"], action=stacked["action"],
                timestep_action=stacked["timestep_action"], state=stacked["state_features"],
                embodiment_id=stacked["embodiment_id"],
            )
        return [(video[i:i + 1], None if action is None else action[i:i + 1]) for i in range(k)]

    # The runtime calls of this adapter, in one place.
    def _admit(self, session_id: str) -> str:
        owner = f"{session_id}#{next(self._owner_ids)}"  # runtime ids are single-use; vllm-omni reuses names
        self.runtime.admit(owner, self.spec, rows=self.rows)
        return owner

    def _forward(self, owner: str, *, commit: bool, row: int):
        return self.runtime.forward(owner, "commit" if commit else "denoise", branch=row)

    def _drop_history(self, owner: str) -> None:
        self.runtime.reset(owner)

    def _release(self, owner: str) -> None:
        self.runtime.release(owner)


def _check_kernel(runtime: PagedKVRuntime, kernel: str, ar_spec) -> None:
    """Refuse at startup a kernel that cannot read this pool (an FP8 pool on flash-attn 2, e4m3 on old GPUs...)."""
    from ..ops import resolve_kernel

    pool = runtime.pool.tensor
    query = torch.empty(1, 1, ar_spec.num_kv_heads, ar_spec.head_size, dtype=runtime.config.dtype, device=pool.device)
    try:
        resolve_kernel(kernel, query, pool)
    except KernelUnavailableError as exc:
        runtime.close()
        raise ConfigError(f"kernel={kernel!r} cannot serve this runner's {pool.dtype} pool: {exc}") from exc


def _set_scales(runtime: PagedKVRuntime, kv_scales: dict) -> None:
    if runtime.config.kv_dtype not in FP8_DTYPES:
        raise ConfigError(f"kv_scales are the scales of an FP8 pool; this pool stores {runtime.pool.tensor.dtype}: "
                          "set kv_dtype to float8_e4m3fn or float8_e5m2, or drop kv_scales")
    unknown = set(kv_scales) - {"k", "v"}
    if unknown:
        raise ConfigError(f"kv_scales has unknown keys {sorted(unknown)}; known: k, v")
    runtime.pool.set_scales(torch.as_tensor(kv_scales.get("k", 1.0), dtype=torch.float32),
                            torch.as_tensor(kv_scales.get("v", 1.0), dtype=torch.float32))


def plan_budget(ar_spec, spec: DreamZeroSpec, cfg: PagedKVConfig, *, available_bytes: int,
                memory_fraction: float, rows: int | None = None) -> KVBudget:
    """How many sessions of this pipeline our pool holds in vllm-omni's budget (see `DreamZeroPagedKV.build`);
    `rows` is a session's rows (its local CFG branches; `cfg.max_rows` when None), the scratch is per forward row."""
    if not 0.0 < memory_fraction <= 1.0:
        raise ConfigError(f"gpu_memory_fraction must be in (0, 1], got {memory_fraction}")
    rows = cfg.max_rows if rows is None else rows
    per_block = KVPool.bytes_per_block_all_layers(cfg)
    blocks_per_session = rows * session_blocks_per_row(spec, cfg.block_size)
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    cross = sum(
        2 * len(ar_spec.kv_branches) * length * int(ar_spec.cross_attention_kv_heads.get(name, ar_spec.num_kv_heads))
        * ar_spec.head_size * itemsize * ar_spec.num_layers
        for name, length in ar_spec.cross_attention_lengths.items()
    )
    model_state = int(ar_spec.model_owned_state_bytes_per_session)
    fixed = (cfg.max_rows * cfg.scratch_blocks_per_row + 1) * per_block

    def need(sessions: int) -> int:
        return fixed + sessions * (blocks_per_session * per_block + cross + model_state)

    if need(1) > available_bytes:
        raise CapacityError(
            f"available device memory cannot fit one session: available={available_bytes} bytes, required="
            f"{need(1)} bytes (self-attention blocks + cross-attention + scratch + model-owned state)"
        )
    budget = max(int(available_bytes * memory_fraction), need(1))
    capacity = next(n for n in range(int(ar_spec.session_capacity), 0, -1) if need(n) <= budget)
    return KVBudget(
        kv_bytes_per_session=blocks_per_session * per_block, cross_bytes_per_session=cross,
        model_state_bytes_per_session=model_state, fixed_bytes=fixed, budget_bytes=budget,
        session_capacity=capacity, blocks_per_layer=capacity * blocks_per_session,
    )


_BATCHED_TENSORS = ("hidden_states", "timestep_video", "encoder_hidden_states", "y", "clip_feature", "action",
                    "timestep_action", "state_features", "embodiment_id")


def _stack(values: list, name: str) -> torch.Tensor | None:
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise RuntimeError(f"sessions batched in one model call disagree on whether {name!r} is given")
    return torch.cat(values, dim=0)


def _branch_forward_of(call: dict) -> "_BranchForward":
    kv_cache = call.get("kv_cache") or []
    if not kv_cache or not isinstance(kv_cache[0], _LayerContext):
        raise RuntimeError("a batched model call carries no paged context of this runtime (_kv_get)")
    return kv_cache[0].forward_ctx


def batch_signature(call: dict) -> tuple:
    """What must agree for parked model calls to share one forward: branch, commit or denoise, sequence length,
    start frame, and every row's shape and dtype."""
    forward = _branch_forward_of(call)
    shapes = tuple((name, None if call.get(name) is None else (tuple(call[name].shape[1:]), call[name].dtype))
                   for name in _BATCHED_TENSORS)
    return (forward.kv_branch, forward.commit_current, int(call["seq_len"]), int(call["current_start_frame"]),
            shapes)


class _LayerContext:
    """What `_kv_get` returns per layer: the model checks the flag, then asks for `to_layer_inputs()`."""

    is_ar_diffusion_paged_context = True

    def __init__(self, forward_ctx: "_BranchForward") -> None:
        self.forward_ctx = forward_ctx

    def to_layer_inputs(self) -> torch.Tensor:
        return self.forward_ctx.state.kv_cache.standin


class _BranchForward:
    """One CFG branch's next forward, as `_kv_get` announced it; `prepare` starts it in the runtime."""

    def __init__(self, state: "PagedKVSessionState", kv_branch: str, seq_len: int, commit_current: bool) -> None:
        self.state = state
        self.kv_branch = kv_branch
        self.seq_len = seq_len
        self.commit_current = commit_current
        self.started = False

    def prepare(self, device: torch.device, action_len: int, query_len: int) -> None:
        self.state._start(self, int(action_len), int(query_len))


class PagedKVSessionState:
    """One runner session in our runtime: duck-types `ARDiffusionKVState` (vllm-omni's
    `experimental/ar_diffusion/kv_cache/state.py`) for the calls DreamZero's pipeline makes."""

    def __init__(self, kv_cache: DreamZeroPagedKV, session_id: str) -> None:
        self.kv_cache = kv_cache
        self.session_id = session_id
        self.num_layers = kv_cache.ar_spec.num_layers
        self._owner: str | None = kv_cache._admit(session_id)
        self._cross: dict[str, dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}
        self._pending: dict[str, _BranchForward] = {}
        self._running: tuple[_BranchForward, Any] | None = None  # (forward, the runtime's context manager)

    @property
    def kv_branch_names(self) -> tuple[str, ...]:
        return tuple(self.kv_cache.branch_rows)

    def _live_owner(self) -> str:
        if self._owner is None:
            raise RuntimeError(f"AR-Diffusion session {self.session_id!r} is closed")
        return self._owner

    # ---- self-attention ---------------------------------------------------------------------------
    def get_kv_caches(self, kv_branch: str, seq_len: int | None = None,
                      commit_current: bool = False) -> list[_LayerContext]:
        self._live_owner()
        self.kv_cache.row_of(kv_branch)
        if seq_len is None:
            raise ValueError("AR-Diffusion paged self-attention requires seq_len in get_kv_caches()")
        if int(seq_len) % self.kv_cache.spec.frame_seqlen:
            raise AssertionError(
                f"AR-Diffusion expects frame-aligned seq_len (multiple of {self.kv_cache.spec.frame_seqlen}), "
                f"got {seq_len}"
            )
        forward = self._announce(kv_branch, int(seq_len), bool(commit_current))
        return [_LayerContext(forward)] * self.num_layers

    def _announce(self, kv_branch: str, seq_len: int, commit_current: bool) -> _BranchForward:
        """The branch's next forward, replacing the one announced before (refused while a commit it ran waits for
        `commit_paged_context`)."""
        pending = self._pending.get(kv_branch)
        if pending is not None and pending.commit_current and pending.started:
            raise RuntimeError("AR-Diffusion paged context replaced before its managed current chunk was committed")
        forward = _BranchForward(self, kv_branch, seq_len, commit_current)
        self._pending[kv_branch] = forward
        return forward

    def prepare_paged_context(self, kv_branch: str, seq_len: int, commit_current: bool) -> list[_LayerContext]:
        return self.get_kv_caches(kv_branch, seq_len, commit_current)

    def _start(self, forward: _BranchForward, action_len: int, query_len: int) -> None:
        """The model is about to run `forward`'s blocks: close the forward before it, open this one."""
        if forward.started:
            if self._running is not None and self._running[0] is forward:
                return  # the next layer of the forward already open
            raise RuntimeError(
                f"AR-Diffusion paged context of branch {forward.kv_branch!r} reused after its forward ended (another "
                "forward started since): its layers would run inside that forward; call _kv_get for a new context")
        if self._pending.get(forward.kv_branch) is not forward:
            raise RuntimeError("AR-Diffusion paged context prepared after it was replaced by a newer _kv_get")
        if self._running is not None and self._running[0].commit_current:
            stale = self._running[0]
            self._stop(RuntimeError("commit not confirmed"))
            raise RuntimeError(
                f"the {stale.kv_branch!r} commit forward was not committed (commit_paged_context) before the next "
                "forward started: it was rolled back"
            )
        self._stop(None)
        if query_len != forward.seq_len + action_len:
            raise ValueError(
                f"the model runs {query_len} query tokens but announced {forward.seq_len} video tokens and "
                f"{action_len} register tokens"
            )
        cm = self.kv_cache._forward(self._live_owner(), commit=forward.commit_current,
                                    row=self.kv_cache.row_of(forward.kv_branch))
        active = cm.__enter__()
        self._running = (forward, cm)
        forward.started = True
        if active.plan.tokens != query_len:
            self._stop(RequestError("token count"))
            raise RequestError(
                f"the runtime planned {active.plan.tokens} tokens for this {active.plan.kind} forward of branch "
                f"{forward.kv_branch!r} but the model runs {query_len}: the session's window and the pipeline "
                "disagree (a commit outside the window, or a missed reset)"
            )

    def _start_batched(self, forward: _BranchForward) -> None:
        """`forward` is about to run as one row of a batched forward (`DreamZeroPagedKV.run_batched`), which
        opens and closes it in the runtime: here only the checks of `_start` on the session's side."""
        if self._pending.get(forward.kv_branch) is not forward or forward.started:
            raise RuntimeError("AR-Diffusion paged context prepared after it was replaced by a newer _kv_get")
        if self._running is not None:
            raise RuntimeError(f"session {self.session_id!r} has a forward of its own in flight; it cannot also run "
                               "as a row of a batched forward")
        forward.started = True

    def _stop(self, error: BaseException | None) -> None:
        """Finish (error None) or roll back the forward in flight, if any."""
        if self._running is None:
            return
        forward, cm = self._running
        self._running = None
        if error is None:
            cm.__exit__(None, None, None)
            return
        if self._pending.get(forward.kv_branch) is forward:
            del self._pending[forward.kv_branch]  # rolled back: nothing of it is left to commit
        cm.__exit__(type(error), error, error.__traceback__)

    def commit_paged_context(self, kv_branch: str) -> None:
        """After a successful commit forward of `kv_branch`: its K/V becomes the branch's history."""
        self._live_owner()
        forward = self._pending.pop(kv_branch, None)
        if forward is None or not forward.started:
            return  # announced but never run here (another rank's CFG branch), as vllm-omni's state does
        if self._running is not None and self._running[0] is forward:
            self._stop(None)

    def end_invocation(self, error: BaseException | None = None) -> None:
        """The runner invocation ended: finish (or, on `error`, roll back) the forward still open. A commit the
        pipeline never confirmed (`commit_paged_context`) is rolled back and raised: its K/V must not become
        history unconfirmed, and the runner then releases the session (fail closed)."""
        unconfirmed = self._running is not None and error is None and self._running[0].commit_current
        if unconfirmed:
            branch = self._running[0].kv_branch
            error = RuntimeError(f"the invocation ended before the {branch!r} commit was confirmed "
                                 "(commit_paged_context): it was rolled back")
        self._stop(error)
        self._pending.clear()
        if unconfirmed:
            raise error

    # ---- cross-attention (kept per session and branch, like vllm-omni's pools) ----------------------
    def is_cross_attention_populated(self, kv_branch: str, cache_name: str) -> bool:
        self.kv_cache.row_of(kv_branch)
        self._check_cache_name(cache_name)
        return kv_branch in self._cross.get(cache_name, {})

    def populate_cross_attention(self, kv_branch: str, cache_name: str,
                                 layer_kv: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy one branch's per-layer `(1, length, heads, D)` K/V; published only once every layer is copied."""
        self._live_owner()
        self.kv_cache.row_of(kv_branch)
        self._check_cache_name(cache_name)
        shape = (1, self.kv_cache.cross_attention_lengths[cache_name],
                 self.kv_cache.cross_attention_kv_heads[cache_name], self.kv_cache.ar_spec.head_size)
        keys, values = [], []
        for layer, (k, v) in enumerate(layer_kv):
            if tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise ValueError(f"cross-attention {cache_name!r} layer {layer}: expected k/v {shape}, got "
                                 f"{tuple(k.shape)} and {tuple(v.shape)}")
            keys.append(k[0].to(self.kv_cache.runtime.config.dtype).clone())
            values.append(v[0].to(self.kv_cache.runtime.config.dtype).clone())
        if len(keys) != self.num_layers:
            raise ValueError(f"cross-attention {cache_name!r} expected {self.num_layers} layers, got {len(keys)}")
        self._cross.setdefault(cache_name, {})[kv_branch] = (keys, values)

    def get_cross_attention_kv(self, kv_branch: str, cache_name: str) -> list[dict[str, torch.Tensor | bool]]:
        if not self.is_cross_attention_populated(kv_branch, cache_name):
            raise RuntimeError(f"cross-attention cache {cache_name!r} of KV branch {kv_branch!r} was read before "
                               "it was populated")
        keys, values = self._cross[cache_name][kv_branch]
        return [{"is_init": True, "k": k.unsqueeze(0), "v": v.unsqueeze(0)} for k, v in zip(keys, values)]

    def clear_cross_attention(self) -> None:
        self._live_owner()
        self._cross.clear()

    def _check_cache_name(self, cache_name: str) -> None:
        if cache_name not in self.kv_cache.cross_attention_lengths:
            raise KeyError(f"unknown cross-attention cache {cache_name!r}; expected "
                           f"{tuple(self.kv_cache.cross_attention_lengths)}")

    # ---- lifecycle ----------------------------------------------------------------------------------
    def reset(self, *, keep_cross_attention: Sequence[str] = ()) -> None:
        """Drop the session's history (rows stay admitted); keep the named cross-attention caches."""
        unknown = set(keep_cross_attention) - set(self.kv_cache.cross_attention_lengths)
        if unknown:
            raise KeyError(f"unknown cross-attention caches to keep: {sorted(unknown)}")
        self.end_invocation(RuntimeError("reset") if self._running is not None else None)
        self.kv_cache._drop_history(self._live_owner())
        self._cross = {name: caches for name, caches in self._cross.items() if name in keep_cross_attention}

    def close(self) -> None:
        """Release the session's blocks and cross-attention K/V (idempotent; a forward in flight is rolled back)."""
        if self._owner is None:
            return
        self._stop(RuntimeError("session closed") if self._running is not None else None)
        self._pending.clear()
        owner, self._owner = self._owner, None
        self._cross.clear()
        self.kv_cache._release(owner)

