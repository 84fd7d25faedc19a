"""DreamZero: an autoregressive video world model with a sliding KV window per CFG branch.

A session keeps a sliding window (plus an optional resident sink) of committed history per row, as tokens in
blocks of any size (`RowWindow`: a block may hold parts of several frames; a partly filled last block is continued
by the next commit; a block is freed when none of its tokens is visible). A commit forward writes the chunk after
the history (the rest of the last block, then new managed blocks), which becomes history when it finishes; a
denoising forward writes the chunk and the action tokens after the history too (the last block's unused tail, then
per-row scratch) and throws them away. One `kv_gap` per row hides what lies between the sink and the window.
A session of `DreamZeroSpec.irregular` gives each forward's chunk length (`tokens=n`: chunks of irregular length, a
sink of any token prefix, e.g. a video-only sink beside audio tokens); its record counts its history in tokens.
The dense model reads its cache as one `(2, B, L, H, D)` tensor per layer; in paged mode it gets a zero-stride
stand-in of that shape.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..config import Bucket, PagedKVConfig
from ..errors import CapacityError, ConfigError, RequestError
from ..layout import RowLayout
from ..models.dreamzero import DREAMZERO_MID, DreamZeroConfig, DreamZeroModel, dreamzero_steps
from ..models.hooks import Forward
from ..passes.idioms import CAPACITY_WINDOW, ROLLING_CACHE, WINDOW, CapacityWindowExpect, RollingExpect, WindowExpect
from .base import BlockSource, Family, ForwardPlan, ModelRuntime, Owner, ceil_div, pool_config, reuse_layouts
from .demo import Demo, DemoForks, DemoLane

NAME = "dreamzero"


@dataclass
class DreamZeroRecord:
    """What a session keeps beyond its blocks (`Owner.state`): per row, the chunks committed since the last window
    reset (a fork needs every row at the same chunk boundary) and, for a spec with chunks of irregular length
    (`DreamZeroSpec.chunk_tokens_range`), the history tokens they hold; None: derived from the fixed phases
    (`history_tokens`)."""

    commits: list[int]
    history: list[int] | None = None

KINDS = ("commit", "denoise")


@dataclass(frozen=True)
class DreamZeroSpec:
    """Token geometry of a DreamZero session (all counts in tokens are derived from frames).

    Per phase a forward computes `windowed` tokens that pass the window with the cache (the frames it
    commits or denoises) followed by `registers` tokens that never become history (action/state):
      denoise:      chunk_frames,                          action_tokens
      commit:       chunk_frames,                          commit_action_tokens (None: action_tokens)
      first commit: first_commit_frames (None: chunk_frames), commit registers; the commit of an empty window.
    Our reference model commits with registers and whole chunks; vllm-omni's pipeline commits without them and
    starts every window with a 1-frame commit (`from_vllm_omni`).

    reset_frames: the loop resets the window when its start frame reaches this many frames, so a chunk that
    ends there is never committed (`models/dreamzero.py: dreamzero_steps`); None: the loop never resets and
    the window slides. Admission sizes a session by it (`session_blocks_per_row`).
    """

    frame_seqlen: int
    chunk_frames: int
    window_frames: int
    sink_frames: int = 0
    action_tokens: int = 0
    first_commit_frames: int | None = None
    commit_action_tokens: int | None = None
    reset_frames: int | None = None
    chunk_tokens_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.chunk_tokens_range is not None:
            lo, hi = self.chunk_tokens_range
            if not 1 <= lo <= hi or hi != self.chunk_tokens or self.first_commit_frames is not None:
                raise ConfigError(
                    f"chunk_tokens_range={self.chunk_tokens_range} with chunks of {self.chunk_tokens} tokens: a spec "
                    "with chunks of irregular length gives (shortest, longest) >= 1 with the longest as its chunk and "
                    "no first_commit_frames; build it with DreamZeroSpec.irregular(...)")

    @classmethod
    def irregular(cls, *, window_tokens: int, shortest: int, longest: int, sink_tokens: int = 0,
                  action_tokens: int = 0, commit_action_tokens: int | None = None) -> "DreamZeroSpec":
        """A session whose forwards give their chunk length (`runtime.forward(id, kind, tokens=n)`, shortest <= n
        <= longest; e.g. TaoMate-H3's 12/10/10/5 video latents plus a variable number of audio latents) and whose
        sink is any prefix of its history in tokens (a video-only sink: the video tokens of the first chunk, its
        audio then lies in the gap). Counted in tokens (frames of one token). The window keeps the most recent
        tokens that fit beside the sink and the forward's chunk (what a dense `cat`/slice cache keeps), not whole
        chunks; a finished commit keeps what a next chunk of `shortest` tokens sees."""
        return cls(frame_seqlen=1, chunk_frames=longest, window_frames=window_tokens, sink_frames=sink_tokens,
                   action_tokens=action_tokens, commit_action_tokens=commit_action_tokens,
                   chunk_tokens_range=(shortest, longest))

    @property
    def shortest_chunk(self) -> int:
        """The fewest windowed tokens a forward computes: what a finished commit keeps history for."""
        return self.chunk_tokens if self.chunk_tokens_range is None else self.chunk_tokens_range[0]

    def phase(self, kind: str, *, first: bool = False) -> tuple[int, int]:
        """(windowed tokens, register tokens) of a forward of `kind` ("commit"/"denoise")."""
        if kind == "denoise":
            return self.chunk_tokens, self.action_tokens
        registers = self.action_tokens if self.commit_action_tokens is None else self.commit_action_tokens
        frames = self.first_commit_frames if first and self.first_commit_frames is not None else self.chunk_frames
        return frames * self.frame_seqlen, registers

    def phases(self) -> list[tuple[int, int]]:
        """Every distinct (windowed, registers) a session runs: one shape bucket each (chunks of irregular length:
        one per length from the shortest to the longest)."""
        if self.chunk_tokens_range is not None:
            lo, hi = self.chunk_tokens_range
            registers = {self.phase("commit")[1], self.action_tokens}
            return [(n, a) for n in range(lo, hi + 1) for a in sorted(registers)]
        out = [self.phase("commit", first=True), self.phase("commit"), self.phase("denoise")]
        return list(dict.fromkeys(out))

    def buckets(self, rows: int = 1) -> tuple[Bucket, ...]:
        """The shape buckets of a session whose forwards carry `rows` rows (1: CFG branches run separately)."""
        return tuple(Bucket(rows, n + a, self.window_tokens) for n, a in self.phases())

    @classmethod
    def from_vllm_omni(cls, model) -> "DreamZeroSpec":
        """From vllm-omni's `CausalWanModel` (duck-typed: no vllm import), as its pipeline drives it."""
        attn = model.blocks[0].self_attn
        return cls(
            frame_seqlen=model.frame_seqlen,
            chunk_frames=model.num_frame_per_block,
            window_frames=attn.max_attention_size // model.frame_seqlen,
            action_tokens=attn.num_action_per_block + attn.num_state_per_block,
            first_commit_frames=1,
            commit_action_tokens=0,
        )

    @classmethod
    def from_lingbot_world(cls, model, latent_height: int, latent_width: int) -> "DreamZeroSpec":
        """From vllm-omni's `CausalLingBotWorldTransformer3DModel` (duck-typed) at a latent size: its cache capacity
        (`local_attn_size`, else `sliding_window_num_frames`, the sink and the current block included), its sink and
        its block. The capacity-window graph shows the capacity, not the sink: this config is where the sink is
        read from (`passes/idioms/lingbot.py`)."""
        cfg = model.config
        _, patch_h, patch_w = cfg.patch_size
        window = cfg.local_attn_size if cfg.local_attn_size != -1 else cfg.sliding_window_num_frames
        return cls(frame_seqlen=(latent_height // patch_h) * (latent_width // patch_w),
                   chunk_frames=cfg.num_frames_per_block, window_frames=window, sink_frames=cfg.sink_size)

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_frames * self.frame_seqlen

    @property
    def window_tokens(self) -> int:
        return self.window_frames * self.frame_seqlen

    @property
    def sink_tokens(self) -> int:
        return self.sink_frames * self.frame_seqlen

    def has_gaps(self, block_size: int) -> bool:
        """Whether a row's window may start, or its sink end, inside a block of `block_size` tokens (so its table
        hides keys: `RowWindow.logical`'s kv_gap). Every window bound is a frame bound (history is whole frames,
        registers never become history), so only a block that does not divide the frame makes gaps. Chunks of
        irregular length put window bounds anywhere: any block of more than one token may hide keys."""
        if self.chunk_tokens_range is not None:
            return block_size > 1
        return self.frame_seqlen % block_size != 0

    @property
    def tokens_per_forward(self) -> int:
        """The most tokens one forward computes (scratch is sized for it)."""
        return max(n + a for n, a in self.phases())

    @classmethod
    def from_model_config(cls, cfg) -> "DreamZeroSpec":
        """From a `models.dreamzero.DreamZeroConfig` (or anything with the same fields)."""
        return cls(
            frame_seqlen=cfg.frame_seqlen,
            chunk_frames=cfg.num_frame_per_block,
            window_frames=cfg.window_frames,
            sink_frames=cfg.sink_size,
            action_tokens=cfg.action_register_length,
            reset_frames=cfg.window_reset_frames,
        )


def dreamzero_buckets(model_cfg, rows: int | Sequence[int] = 2) -> tuple[Bucket, ...]:
    """DreamZero's forwards (commit and denoise alike) have one shape per row count."""
    rows = (rows,) if isinstance(rows, int) else tuple(rows)
    return tuple(Bucket(r, model_cfg.tokens_per_forward, model_cfg.max_attention_size) for r in rows)


def dreamzero_runtime_config(model_cfg, *, block_size: int | None = None, sessions: int = 1, rows: int = 2,
                             cross_regions: int = 0, spec: DreamZeroSpec | None = None, **overrides) -> PagedKVConfig:
    """A pool for `sessions` DreamZero sessions of `rows` CFG rows each, sized by what admission checks, plus
    room for `cross_regions` distinct shared cross-attention regions (`regions.py`: one per distinct row
    content, e.g. 2 for one prompt's conditional and negative rows however many sessions share them).

    Each row gets `session_blocks_per_row` blocks (the most its loop ever holds, e.g. 18 of a 21-frame window
    when the loop resets at frame 20), which admission reserves (`reserve`), so a pool built here admits exactly
    `sessions` sessions of `rows` rows, a fork counting as one, and none of them ever waits for a block.
    spec: the sessions' spec when it is not the model config's (e.g. `DreamZeroSpec.irregular`)."""
    block_size = block_size or model_cfg.frame_seqlen
    spec = spec if spec is not None else DreamZeroSpec.from_model_config(model_cfg)
    tokens_per_row = session_blocks_per_row(spec, block_size) * block_size
    cfg = pool_config(
        num_layers=model_cfg.num_layers, num_kv_heads=model_cfg.num_heads, head_dim=model_cfg.head_dim,
        block_size=block_size, owners=sessions, rows=rows, tokens_per_row=tokens_per_row,
        scratch_tokens_per_row=max(model_cfg.tokens_per_forward, spec.tokens_per_forward),
        overrides={"kv_gaps": spec.has_gaps(block_size), **overrides},
    )
    if cross_regions and "blocks_per_layer" not in overrides and "budget_bytes" not in overrides:
        extra = cross_regions * ceil_div(model_cfg.cross_len, block_size)
        cfg = dataclasses.replace(cfg, blocks_per_layer=cfg.blocks_per_layer + extra)
    if cross_regions and "region_tokens" not in overrides:
        cfg = dataclasses.replace(cfg, region_tokens=model_cfg.cross_len)  # compiled cross-attention reads them
    return cfg


@dataclass(frozen=True)
class RowWindow:
    """Which of a row's `history` committed tokens (since its last reset) a forward with `windowed` new tokens sees,
    and which history blocks it must hold: the one rule of what a window holds. What a forward reads (`windowed` =
    its chunk) and what a finished commit keeps (`windowed` = the next chunk) both follow it.

    Tokens fill blocks of any size in commit order (history token p lies in history block p // B at offset p % B),
    so neither a frame nor a chunk needs to fill a block. Visible: the sink `[0, sink_end)` and the most recent
    tokens `[recent_start, history)` that fit beside it and the new tokens. Held: the `sink_blocks` first history
    blocks and the history blocks `[first_recent, history_blocks)`: a block is freed only when none of its tokens
    is visible any more and no commit will write it (a partial last block is held: the next commit continues it).
    """

    history: int
    block_size: int
    sink_end: int
    recent_start: int
    sink_blocks: int
    first_recent: int

    @classmethod
    def of(cls, spec: DreamZeroSpec, history: int, block_size: int, windowed: int) -> "RowWindow":
        B, S = block_size, spec.sink_tokens
        blocks = ceil_div(history, B)
        keep = max(spec.window_tokens - S - windowed, 0)
        recent_start = min(max(S, history - keep), history)
        sink_blocks = ceil_div(min(S, history), B)
        return cls(history, B, min(S, history), recent_start, sink_blocks,
                   min(max(sink_blocks, recent_start // B), blocks))

    @property
    def history_blocks(self) -> int:
        return ceil_div(self.history, self.block_size)

    @property
    def held(self) -> int:
        """How many history blocks the row holds."""
        return self.sink_blocks + self.history_blocks - self.first_recent

    def logical(self, first_held_recent: int) -> tuple[int, tuple[int, int]]:
        """(logical end of the history, kv_gap) of a row whose table lists its sink blocks then its recent history
        blocks from history block `first_held_recent` on: `[sink blocks][recent blocks][new]`, the gap covering
        what lies between the sink's last token and the first recent one (0, 0 when nothing does)."""
        if first_held_recent > self.first_recent:
            raise AssertionError(f"a row holds history blocks from {first_held_recent} on but its window starts in "
                                 f"block {self.first_recent}: a visible block was freed")
        shift = (self.sink_blocks - first_held_recent) * self.block_size  # history position -> logical position
        end, gap_end = self.history + shift, self.recent_start + shift
        return end, ((self.sink_end, gap_end) if gap_end > self.sink_end else (0, 0))


def history_tokens(spec: DreamZeroSpec, commits: int) -> int:
    """The history tokens of a row after `commits` commits since its last reset (a first commit, then chunks)."""
    return 0 if commits == 0 else spec.phase("commit", first=True)[0] + (commits - 1) * spec.phase("commit")[0]


def commit_new_blocks(history_end: int, held: int, tokens: int, block_size: int) -> int:
    """Blocks a commit of `tokens` takes for a row whose logical history ends at `history_end` in `held` blocks:
    it first fills the held last block (a partial one), then fresh ones."""
    return max(ceil_div(history_end + tokens, block_size) - held, 0)


@functools.lru_cache(maxsize=256)
def session_blocks_per_row(spec: DreamZeroSpec, block_size: int) -> int:
    """The most managed blocks one row of a session ever holds: its real need, what admission checks.

    Follows the loop's commits (`plan`/`finish` below) on token counts: a commit holds the row's history plus
    its new blocks until it finishes and evicts. With `reset_frames` only the commits before the reset run (a
    chunk ending at the reset frame is never committed), so DreamZero-14B (window 21 frames, reset at 20, chunk
    2) needs 18 frames per row, not the 21 of a full window; without a reset the window slides and the
    steady state is reached once the history passes the window (a block size that divides neither frame nor chunk
    repeats with a longer period: the loop follows every phase of it).
    """
    B = block_size
    if spec.chunk_tokens_range is not None:
        return irregular_blocks_per_row(spec, B)
    peak = frame = commits = 0
    window = RowWindow.of(spec, 0, B, spec.chunk_tokens)
    # the window's block alignment repeats after lcm(B, chunk) tokens past the window: steady by then
    period = np.lcm(B, max(spec.chunk_tokens, 1)) // max(spec.chunk_tokens, 1)
    for _ in range(spec.window_frames + 2 + int(period)):
        frames = (spec.first_commit_frames if commits == 0 and spec.first_commit_frames is not None
                  else spec.chunk_frames)
        if spec.reset_frames is not None and frame + frames >= spec.reset_frames:
            break
        now = RowWindow.of(spec, window.history, B, spec.phase("commit", first=commits == 0)[0])
        end, _ = now.logical(window.first_recent)
        new = commit_new_blocks(end, window.held, frames * spec.frame_seqlen, B)
        peak = max(peak, window.held + new)
        commits += 1
        window = RowWindow.of(spec, history_tokens(spec, commits), B, spec.chunk_tokens)
        frame += frames
    return peak


def irregular_blocks_per_row(spec: DreamZeroSpec, block_size: int) -> int:
    """The most managed blocks a row with chunks of irregular length may hold, over every sequence of chunk lengths
    (the worst: the longest chunk committed onto history kept for the shortest, at the worst block alignment).

    Between forwards a row holds its sink blocks and the blocks of at most `window - sink - shortest` recent tokens
    from a block start on (`finish`); a commit of at most `longest` tokens continues them, so the blocks from the
    first recent one on span at most `B - 1 + keep + longest` tokens. Before the window slides the row holds fewer.
    """
    B, S = block_size, spec.sink_tokens
    keep = max(spec.window_tokens - S - spec.shortest_chunk, 0)
    return ceil_div(S, B) + ceil_div(B - 1 + keep + spec.chunk_tokens, B)


class DreamZeroFamily(Family):
    """The `Family` of DreamZero sessions (see `families/base.py`)."""

    name = NAME
    noun = "session"
    spec_type = DreamZeroSpec
    evict_lru = True
    idioms = (WINDOW, ROLLING_CACHE, CAPACITY_WINDOW)

    # ---- admission and forwards -------------------------------------------------------------
    def rows(self, spec: DreamZeroSpec, requested: int | None) -> int:
        return 2 if requested is None else requested  # one per CFG branch unless CFG-parallel splits them

    def admission_blocks(self, spec: DreamZeroSpec, rows: int, blocks: BlockSource) -> list[int]:
        B = blocks.block_size  # any size: a block holds tokens of any frames (`RowWindow`)
        if spec.chunk_tokens + spec.sink_tokens > spec.window_tokens:
            raise ConfigError(
                f"the window ({spec.window_tokens} tokens) is smaller than a chunk ({spec.chunk_tokens} tokens, the "
                f"longest) plus the sink ({spec.sink_tokens} tokens); enlarge local_attn_size or shrink the chunk/sink"
            )
        per_row = session_blocks_per_row(spec, B)
        if rows * per_row > blocks.num_blocks:
            need = ("one full window" if spec.reset_frames is None
                    else f"its loop (window reset at frame {spec.reset_frames})")
            raise CapacityError(
                f"{need} needs {rows * per_row} blocks per layer ({rows} rows x {per_row}) but the whole "
                f"pool has {blocks.num_blocks}: it can never fit; raise the pool budget"
            )
        blocks.check_scratch(ceil_div(spec.tokens_per_forward, B))
        return [0] * rows  # history blocks are taken by commits, from the reservation (`reserve`)

    def reserve(self, spec: DreamZeroSpec, rows: int, blocks: BlockSource) -> int:
        """What the session's commits take up to its reset: admission reserves it (with nothing
        reserved, sessions admitted into a pool sized for one each committed once and then all waited forever)."""
        return rows * session_blocks_per_row(spec, blocks.block_size)

    def plan(self, owner: Owner, blocks: BlockSource, kind: str, *, branch: int | None = None,
             **args: Any) -> ForwardPlan:
        """A commit (its K/V becomes history) or a denoising forward (scratch) of the session's chunk.

        branch: run only that row (CFG branch) as a batch-1 forward over its own cache; None: all rows.
        The phase's token counts come from the spec: a commit into an empty window is the first commit; a spec
        with chunks of irregular length takes the chunk's length as `tokens=n` (`DreamZeroSpec.irregular`).
        Other `args` (the rollout's start_frame, step, ...) do not change the layout.
        """
        if kind not in KINDS:
            raise RequestError(f"unknown DreamZero forward kind {kind!r}; use 'commit' or 'denoise'")
        if branch is not None and not 0 <= branch < owner.num_rows:
            raise RequestError(
                f"branch {branch} does not exist: session {owner.owner_id!r} has {owner.num_rows} rows")
        spec: DreamZeroSpec = owner.spec
        commit = kind == "commit"
        run = list(range(owner.num_rows)) if branch is None else [branch]
        n, a = spec.phase(kind, first=commit and all(owner.state.commits[r] == 0 for r in run))
        n = self._chunk_tokens(owner, n, args.get("tokens"))
        B = blocks.block_size
        windows = [self._window(owner, r, B, n) for r in run]
        counts = [commit_new_blocks(w[1], len(owner.rows[r]), n, B) if commit else 0 for r, w in zip(run, windows)]
        if commit:
            self._check_within_admission(owner, run, counts, B)
        taken = blocks.allocate_rows(counts) if commit else []
        new_blocks: list[list[int]] = [[] for _ in owner.rows] if commit else []
        for r, ids in zip(run, taken):
            new_blocks[r] = ids

        def make() -> list[RowLayout]:
            return [self._row(blocks, i, owner.rows[r], new_blocks[r] if commit else [], end, gap, n, a)
                    for i, (r, (_, end, gap)) in enumerate(zip(run, windows))]

        try:
            layouts = make() if commit else reuse_layouts(
                owner, (kind, owner.version, branch, blocks.first_scratch_row, n), make)
        except BaseException:
            for ids in taken:
                blocks.free(ids)
            raise
        key = (owner.serial, kind, owner.version, branch, n) if not commit else ()
        return ForwardPlan(owner.owner_id, kind, layouts, n + a, spec.window_tokens, new_blocks, key, keeps_kv=commit,
                           phase={"chunk_tokens": n, "action_tokens": a}, owner_rows=run)

    @staticmethod
    def _chunk_tokens(owner: Owner, phase_tokens: int, tokens: Any) -> int:
        """The forward's windowed tokens: the phase's, or `tokens=` for a spec with chunks of irregular length."""
        spec: DreamZeroSpec = owner.spec
        if spec.chunk_tokens_range is None:
            if tokens is not None:
                raise RequestError(
                    f"tokens={tokens!r}: session {owner.owner_id!r} runs chunks of fixed length ({phase_tokens} "
                    "tokens this forward); admit it with DreamZeroSpec.irregular(...) to give each chunk's length")
            return phase_tokens
        lo, hi = spec.chunk_tokens_range
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not lo <= tokens <= hi:
            raise RequestError(
                f"tokens={tokens!r}: session {owner.owner_id!r} has chunks of irregular length, so each forward "
                f"gives its chunk's length as tokens=n with {lo} <= n <= {hi} (its spec's chunk_tokens_range)")
        return tokens

    @staticmethod
    def _history(owner: Owner, r: int) -> int:
        """Row `r`'s history tokens since its last reset."""
        state: DreamZeroRecord = owner.state
        return history_tokens(owner.spec, state.commits[r]) if state.history is None else state.history[r]

    @classmethod
    def _window(cls, owner: Owner, r: int, block_size: int, windowed: int) -> tuple[RowWindow, int, tuple[int, int]]:
        """Row `r`'s window for a forward of `windowed` new tokens, its logical history end and its kv_gap."""
        spec: DreamZeroSpec = owner.spec
        window = RowWindow.of(spec, cls._history(owner, r), block_size, windowed)
        first_held = window.history_blocks - (len(owner.rows[r]) - window.sink_blocks)
        return (window, *window.logical(first_held))

    @staticmethod
    def _check_within_admission(owner: Owner, run: list[int], counts: list[int], block_size: int) -> None:
        """A commit may not make a row hold more than admission sized the session for (its loop's real need)."""
        limit = session_blocks_per_row(owner.spec, block_size)
        for r, new in zip(run, counts):
            if len(owner.rows[r]) + new > limit:
                raise RequestError(
                    f"this commit would make row {r} of session {owner.owner_id!r} hold {len(owner.rows[r]) + new} "
                    f"blocks per layer, beyond the {limit} its admission sized it for: its spec says the loop resets "
                    f"the window at frame {owner.spec.reset_frames}. Call runtime.reset(session) when the loop reaches that "
                    "frame, or open the session with reset_frames=None (a sliding window)"
                )

    @staticmethod
    def _row(blocks: BlockSource, i: int, row: list[int], new: list[int], h: int, gap: tuple[int, int], n: int,
             a: int) -> RowLayout:
        """[sink blocks | recent blocks | chunk | registers] from logical position `h` on, `gap` hiding what lies
        between the sink and the recent tokens; i: the forward's row. The chunk and registers continue the row's last
        (partial) block: a commit's chunk then fills `new` managed blocks, everything else lands in scratch. A
        denoising forward writes the unused tail of that partial block, which no one else holds (`fork_private`)
        and no one reads (beyond the row's history; the next commit writes it again)."""
        B = blocks.block_size
        managed = row + new
        scratch = blocks.scratch(i, len(managed), (h + n + a - 1) // B)
        positions = np.arange(h, h + n + a, dtype=np.int32)
        ends = np.full(n + a, h + n + a, dtype=np.int32)
        return RowLayout.build(managed, scratch, positions, ends, h + n + a, max_position=h + n + a - 1, kv_gap=gap)

    def finish(self, owner: Owner, plan: ForwardPlan, blocks: BlockSource) -> None:
        """A commit becomes history; blocks no later forward can read (out of the window) are freed."""
        if plan.kind != "commit":
            return
        # Keep what any later forward can read or write: the sink and the most recent tokens beside a next chunk.
        spec, B = owner.spec, blocks.block_size
        rows = plan.owner_rows if plan.owner_rows is not None else range(owner.num_rows)
        for r in rows:
            before = RowWindow.of(spec, self._history(owner, r), B, spec.shortest_chunk)
            first_held = before.history_blocks - (len(owner.rows[r]) - before.sink_blocks)
            owner.state.commits[r] += 1
            if owner.state.history is not None:
                owner.state.history[r] += plan.phase["chunk_tokens"]
            after = RowWindow.of(spec, self._history(owner, r), B, spec.shortest_chunk)
            held = owner.rows[r] + plan.new_blocks[r]  # history blocks [0, sink) and [first_held, history_blocks)
            # the sink grows only while it fills, and then the row held nothing else: recent blocks start at
            # history block max(first_held, after.sink_blocks)
            sink, recent = held[: after.sink_blocks], held[after.sink_blocks:]
            drop = max(after.first_recent - max(first_held, after.sink_blocks), 0)
            blocks.free(recent[:drop])
            owner.rows[r] = sink + recent[drop:]
        owner.version += 1

    # ---- forks ----------------------------------------------------------------------------------
    def new_state(self, spec: DreamZeroSpec, rows: int) -> DreamZeroRecord:
        return DreamZeroRecord([0] * rows, None if spec.chunk_tokens_range is None else [0] * rows)

    def fork_state(self, owner: Owner, blocks: BlockSource, *, commits: int | None = None) -> DreamZeroRecord:
        """A session can be forked between forwards when every row has committed the same chunks.

        No one ever writes a shared block: a forward writes only its row's last history block (when partial:
        its next tokens continue it) and blocks it takes, and the child gets its own copy of every partial last
        block at the fork (`fork_private`); full history blocks are shared and only read. The scheduler checks
        that no plan writes a block with more than one owner (`Scheduler._check_writes`). commits: see
        `fork_budget`.
        """
        if commits is not None and (not isinstance(commits, int) or isinstance(commits, bool) or commits < 0):
            raise RequestError(f"commits={commits!r}: a fork's commit budget is a count of chunks (an int >= 0), "
                               "or None for a fork that may commit like any session")
        done = list(owner.state.commits)
        history = None if owner.state.history is None else list(owner.state.history)
        if len(set(done)) > 1 or (history is not None and len(set(history)) > 1):
            raise RequestError(
                f"session {owner.owner_id!r} is not at a chunk boundary: its rows (CFG branches) have committed "
                f"{done} chunks ({history or 'fixed-length'} tokens) since the last window reset; commit the same "
                "chunk on every branch "
                "(runtime.forward(session, 'commit', branch=b)) before forking"
            )
        return DreamZeroRecord(done, history)

    def fork_budget(self, owner: Owner, blocks: BlockSource, *, commits: int | None = None) -> int | None:
        """With `commits=n` the fork may commit n chunks per row (a candidate that commits once, then is scored
        and dropped): it reserves the blocks n commits of its largest phase take on every row, not a session's whole
        need, and a commit beyond them is refused. None: no budget, the fork reserves what its parent does."""
        if commits is None:
            return None
        spec: DreamZeroSpec = owner.spec
        largest = ceil_div(max(spec.phase("commit", first=True)[0], spec.phase("commit")[0]), blocks.block_size)
        return owner.num_rows * commits * largest

    def fork_private(self, owner: Owner, blocks: BlockSource) -> list[list[int]]:
        """Per row, the index in `owner.rows[r]` of its last block when that block is partial: the next forward of
        either side writes its tail, so the child gets a copy of it (the scheduler copies it at the fork)."""
        B = blocks.block_size
        return [[len(row) - 1] if row and self._history(owner, r) % B else []
                for r, row in enumerate(owner.rows)]

    def history_dropped(self, owner: Owner) -> None:
        owner.state = self.new_state(owner.spec, owner.num_rows)

    def check_expectation(self, expect: WindowExpect | RollingExpect | CapacityWindowExpect, owner: Owner,
                          plan: ForwardPlan) -> None:
        spec: DreamZeroSpec = owner.spec
        have = {"window_tokens": spec.window_tokens, "sink_tokens": spec.sink_tokens, **plan.phase}
        if isinstance(expect, RollingExpect):
            if expect.sink_tokens is None:
                del have["sink_tokens"]
            _check_rolling_history(expect, owner, plan)
        if isinstance(expect, CapacityWindowExpect):
            del have["sink_tokens"]  # the graph shows a full cache, not its sink: the session's spec holds it
            if expect.keeps != plan.keeps_kv:
                raise RequestError(
                    f"this compiled capacity-window graph {'keeps' if expect.keeps else 'discards'} its K/V (the model "
                    f"{'writes' if expect.keeps else 'does not write'} its cache back) but this is a {plan.kind} forward "
                    f"of {owner.owner_id!r}, which {'keeps' if plan.keeps_kv else 'discards'} it: run a forward that "
                    "updates the model's cache as a commit and one that does not as a denoising step"
                )
        diff = {k: (getattr(expect, k), v) for k, v in have.items() if getattr(expect, k) != v}
        if diff:
            raise RequestError(
                f"the compiled DreamZero site and session {owner.owner_id!r} disagree on "
                + ", ".join(f"{k} (graph {g}, session {s})" for k, (g, s) in diff.items())
                + ": admit the session with DreamZeroSpec.from_model_config(model.config) (our reference model) or "
                f"DreamZeroSpec.from_vllm_omni(model) (vllm-omni's CausalWanModel); this was a {plan.kind} forward"
            )

    # ---- the model side -----------------------------------------------------------------------
    def owns_model(self, model: torch.nn.Module) -> bool:
        return isinstance(model, DreamZeroModel)

    def blocks(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        return model.blocks

    def spec_for(self, model: torch.nn.Module, **loop: Any) -> DreamZeroSpec:
        return DreamZeroSpec.from_model_config(model.cfg)

    def dense_caches_after(self, caches: Any, kind: str, result: Any) -> Any:
        """A commit returns the grown (windowed) caches, which the loop keeps; a denoising step keeps the old ones."""
        return result[2] if kind == "commit" else caches

    def steps(self, model: torch.nn.Module, hooks: Any, **loop: Any):
        """`models.dreamzero.dreamzero_steps` (num_chunks=, num_inference_steps=, seed=, ...)."""
        return dreamzero_steps(model, hooks=hooks, **loop)

    def default_buckets(self, model_cfg) -> tuple[Bucket, ...]:
        return dreamzero_buckets(model_cfg)

    def example_inputs(self, model: torch.nn.Module, runtime: ModelRuntime, bucket: Bucket) -> tuple[tuple, dict]:
        return dreamzero_block_inputs(model, runtime, bucket)

    def standin_caches(self, runtime: ModelRuntime, model: torch.nn.Module, batch: int,
                       **geometry: Any) -> list[torch.Tensor]:
        """One zero-stride `(2, batch, window, H, D)` stand-in, the same for every layer; H is what the attention
        holds (the rank's heads under tensor parallel, `distributed/reference.py`)."""
        cfg = model.cfg
        standin = runtime.standin(2, batch, cfg.max_attention_size, model.blocks[0].self_attn.num_heads, cfg.head_dim)
        return [standin] * cfg.num_layers

    def region_standins(self, runtime: ModelRuntime, model: torch.nn.Module, batch: int) -> list[torch.Tensor]:
        """What the model gets instead of its `cross_kvs` when the session's cross-attention K/V is in shared
        regions (`runtime.admit(..., cross_kv=)`): one zero-stride `(2, batch, cross_len, H, D)` region stand-in."""
        cfg = model.cfg
        standin = runtime.region_standin(2, batch, cfg.cross_len, cfg.num_heads, cfg.head_dim)
        return [standin] * cfg.num_layers

    # ---- the `paged-kv demo` scene --------------------------------------------------------------
    def demo(self, size: str, *, short: bool, device: str, **runtime_options: Any) -> Demo:
        """One session's rollout for parity, then three sessions at different fills and K forks of the full one
        evaluating K candidate chunks in one forward (`_demo_scene`). `size`: "tiny" or "mid" (`DREAMZERO_MID`)."""
        return _demo(size, short=short, device=device, **runtime_options)


def _check_rolling_history(expect: RollingExpect, owner: Owner, plan: ForwardPlan) -> None:
    """The session's visible history (per row of the forward) must be exactly what the frame's fill state reads."""
    for i, row in enumerate(plan.rows):
        g0, g1 = row.kv_gap  # `_row`: the forward's tokens follow the history, of which the gap is not seen
        visible = int(row.arrays[2][0]) - (g1 - g0)
        if visible != expect.history_tokens:
            raise RequestError(
                f"this rolling-cache frame reads {expect.history_tokens} history tokens (its fill state: the cache "
                f"dict's local_end_index / new_block) but session {owner.owner_id!r} shows {visible} in row {i} "
                f"for this {plan.kind} forward: the dense cache dict and the session are out of step (a cache dict "
                "reused across sessions or window resets, or new_block not set at the start of a block, or a "
                "commit missing). The forward was refused and rolled back; drive the cache dict and the session "
                "together (tests/upstream/test_rolling_cache.py shows the protocol)"
            )


def dreamzero_block_inputs(model, runtime: ModelRuntime, bucket: Bucket) -> tuple[tuple, dict]:
    """Arguments of one `CausalWanBlock` call of `bucket`, as `DreamZeroModel.forward` passes them."""
    cfg, p = model.cfg, next(model.parameters())
    R, T, C = bucket.rows, bucket.tokens, bucket.context
    video = T - cfg.action_register_length
    if video <= 0 or video % cfg.frame_seqlen:
        raise ConfigError(
            f"bucket {bucket} cannot be a DreamZero forward: {T} tokens minus {cfg.action_register_length} "
            f"action registers is not a positive multiple of frame_seqlen={cfg.frame_seqlen}"
        )
    if C != cfg.max_attention_size:
        raise ConfigError(
            f"bucket {bucket}: DreamZero's cache stand-ins are one window ({cfg.max_attention_size} tokens) long; "
            "use dreamzero_buckets(model.cfg)"
        )
    H, D = cfg.num_heads, cfg.head_dim
    cos, sin = model.rope_tables(0, video // cfg.frame_seqlen, p.device)
    zeros = functools.partial(torch.zeros, dtype=p.dtype, device=p.device)
    args = (
        zeros(R, T, cfg.dim),  # hidden states
        zeros(R, 6, cfg.dim),  # modulation
        cos,
        sin,
        DREAMZERO.standin_caches(runtime, model, R)[0],  # what the driver hands the model
        # cross-attention K/V: a region stand-in when the runtime's compiled graphs read shared regions
        # (config.region_tokens, set by dreamzero_runtime_config(cross_regions=N)), else dense
        DREAMZERO.region_standins(runtime, model, R)[0] if runtime.config.region_tokens else zeros(2, R, cfg.cross_len, H, D),
    )
    return args, {}


DREAMZERO = DreamZeroFamily()


# ---- the `paged-kv demo` scene (`DreamZeroFamily.demo`) ----------------------------------------------------

#: forks of the full session in the demo: K candidate chunks evaluated as the rows of one forward
DEMO_CANDIDATES = 4


def _demo(size: str, *, short: bool, device: str, **runtime_options: Any) -> Demo:
    if size not in ("tiny", "mid"):
        raise ConfigError(f"unknown demo size {size!r}; use 'tiny' or 'mid'")
    # chunks of 2 frames with a 2-frame sink: tiny: window 6 frames (16 tokens each); mid: window 8 frames (64
    # tokens each); both reset the window after 8 chunks
    cfg = DreamZeroConfig(sink_size=2) if size == "tiny" else dataclasses.replace(DREAMZERO_MID, sink_size=2)
    block_size = 8 if size == "tiny" else 16
    chunks, steps = (2, 1) if short else (10, 3)
    k = DEMO_CANDIDATES
    rows = (2, 2 * k)
    # Room for what admission counts (`Reservations.committed`): what each session may hold up to its reset, each
    # candidate (a fork with a budget of one commit, `fork_budget`) its chunk on both rows, and the forked session's
    # history (sink + the window beside a chunk, both rows), which the forks keep even if the session drops it.
    frame_blocks = cfg.frame_seqlen // block_size
    config = dreamzero_runtime_config(cfg, block_size=block_size, sessions=3, max_rows=max(rows),
                                      buckets=dreamzero_buckets(cfg, rows=rows), device=device, **runtime_options)
    F, W = cfg.num_frame_per_block, cfg.window_frames
    extra = (k * 2 * F + 2 * (W - F)) * frame_blocks
    config = dataclasses.replace(config, blocks_per_layer=config.blocks_per_layer + extra)
    lanes, forks = _demo_scene(cfg, steps, k)
    return Demo(
        describe=(f"dreamzero ({size}: dim {cfg.dim}, {cfg.num_heads} heads x {cfg.head_dim}, {cfg.frame_seqlen} "
                  f"tokens/frame): {cfg.num_layers} layers, window {cfg.window_frames} frames with a "
                  f"{cfg.sink_size}-frame sink, chunks of {cfg.num_frame_per_block} frames, reset every "
                  f"{cfg.chunks_per_window} chunks"),
        make_model=lambda: DreamZeroModel(cfg, seed=1).to(device),
        runtime_config=config,
        loops=[dict(num_chunks=chunks, num_inference_steps=steps, seed=3)],
        loops_describe=f"one session's rollout, {chunks} chunks x {steps} denoising steps"
                       + (f" (its window reset after chunk {cfg.chunks_per_window - 1})"
                          if chunks > cfg.chunks_per_window else ""),
        dense_baseline="each session's own caches at their current length (a dense cache grows by concatenation up "
                       "to the window), and per fork a copy of its parent's caches (a dense fork clones them)",
        compare=lambda dense, paged: max((dense[key].float() - paged[key].float()).abs().max().item()
                                         for key in ("video", "actions")),
        compare_rows=_demo_compare_rows,
        dense_kv_bytes=_demo_dense_kv_bytes,
        lanes=lanes,
        forks=forks,
        info={"size": size, "chunks": chunks, "steps": steps, "candidates": k},
    )


def _demo_scene(cfg: DreamZeroConfig, steps: int, k: int) -> tuple[list[DemoLane], DemoForks]:
    """Three sessions of one prompt stopped at different fills, and `k` forks of the full one.

    A session that has run `c` chunks has committed `c - 1` (a chunk is committed at the start of the next) and
    stands after the denoising steps of chunk `c - 1`, not yet committed: a chunk boundary, where it may fork."""
    F, W = cfg.num_frame_per_block, cfg.window_frames
    half, full = max(1, W // (2 * F)), W // F + 1  # commits: about half the window; more than the window holds
    if (full + 2) * F > cfg.window_reset_frames:
        raise ConfigError(f"the demo's full session and its candidates need {(full + 2) * F} frames before the "
                          f"window resets at frame {cfg.window_reset_frames}")
    context = torch.randn(1, cfg.text_len, cfg.text_dim, generator=torch.Generator().manual_seed(11))
    evicted = full * F - (W - F)  # frames committed beyond what sink + recent hold beside the next chunk

    def lane(owner_id: str, chunks: int, what: str, seed: int) -> DemoLane:
        return DemoLane(owner_id, what, dict(num_chunks=chunks + 1, num_inference_steps=steps, seed=seed,
                                             context=context), forwards=chunks - 1 + chunks * steps)

    lanes = [
        lane("new", 1, "just admitted: first chunk denoised, no history yet", 21),
        lane("half", half + 1, f"window filling: {half * F} of {W} frames", 22),
        lane("full", full + 1, f"window full and sliding: {full * F} frames committed, {evicted} evicted", 23),
    ]
    children = [f"full/{i}" for i in range(k)]
    forks = DemoForks(
        parent="full", children=children,
        what="fork of full: commits its own candidate chunk, then denoises the next",
        steps=lambda model, hooks: _demo_candidate_steps(model, hooks, k=k, start_frame=full * F, steps=steps,
                                                         context=context),
        copy_dense_caches=lambda caches, n: [c.repeat(1, n, 1, 1, 1) for c in caches],
        fork_args={"commits": 1},  # a candidate commits its chunk once, then is scored and dropped
    )
    return lanes, forks


def _demo_candidate_steps(model: DreamZeroModel, hooks: Any, *, k: int, start_frame: int, steps: int,
                          context: torch.Tensor, guidance_scale: float = 5.0, seed: int = 31):
    """K candidate futures of one session as the rows of ONE forward per step (rows 2i, 2i + 1: candidate i's
    conditional and unconditional branches): each commits its own version of the chunk at `start_frame` (its own
    actions), then denoises the next chunk from the same noise over its own history. Returns per candidate the
    predicted next chunk (`{"video": (k, L, C), "actions": (k, A, action_dim)}`)."""
    cfg = model.cfg
    p = next(model.parameters())
    rows = 2 * k
    gen = torch.Generator().manual_seed(seed)

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=p.device, dtype=p.dtype)

    cross = [c.repeat(1, k, 1, 1, 1) for c in model.prepare_cross_kv(torch.cat([context, torch.zeros_like(context)]).to(
        device=p.device, dtype=p.dtype))]
    caches = hooks.caches(model, rows)
    chunk = noise(k, cfg.chunk_tokens, cfg.in_channels).repeat_interleave(2, 0)
    actions = noise(k, cfg.action_register_length, cfg.action_dim).repeat_interleave(2, 0)
    _, _, caches = yield Forward(
        "commit", 0,
        lambda: model(chunk, actions, torch.zeros(rows, device=p.device), start_frame, caches, cross,
                      update_kv_cache=True),
        dict(start_frame=start_frame, num_frames=cfg.num_frame_per_block),
    )
    x = noise(1, cfg.chunk_tokens, cfg.in_channels).expand(k, -1, -1)
    a = noise(1, cfg.action_register_length, cfg.action_dim).expand(k, -1, -1)
    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    nxt = start_frame + cfg.num_frame_per_block
    for i in range(steps):
        t = torch.full((rows,), sigmas[i] * 1000.0, device=p.device)
        v_x, v_a, _ = yield Forward(
            "denoise", 1,
            lambda: model(x.repeat_interleave(2, 0), a.repeat_interleave(2, 0), t, nxt, caches, cross,
                          update_kv_cache=False),
            dict(start_frame=nxt, num_frames=cfg.num_frame_per_block, step=i),
        )
        v_x, v_a = v_x.unflatten(0, (k, 2)), v_a.unflatten(0, (k, 2))
        x = x + (sigmas[i + 1] - sigmas[i]) * (v_x[:, 1] + guidance_scale * (v_x[:, 0] - v_x[:, 1]))
        a = a + (sigmas[i + 1] - sigmas[i]) * (v_a[:, 1] + guidance_scale * (v_a[:, 0] - v_a[:, 1]))
    return {"video": x, "actions": a}


def _demo_compare_rows(dense: tuple, paged: tuple) -> torch.Tensor:
    """Per row, max |dense - paged| of one forward's video and action outputs (its caches are not compared)."""
    return torch.stack([(d.float() - q.float()).abs().flatten(1).amax(1) for d, q in zip(dense[:2], paged[:2])]).amax(0)


def _demo_dense_kv_bytes(caches: list[torch.Tensor]) -> list[int]:
    """Per row, the bytes of the dense caches `(2, B, L, H, D)` of every layer (they hold what they reserve)."""
    rows = caches[0].shape[1]
    return [sum(c.nbytes // rows for c in caches)] * rows
