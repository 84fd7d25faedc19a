"""What one row looks like in one forward: its block table and where each query token goes.

The scheduler produces a `RowLayout` per row; the metadata builder turns a list of them into the
op's fixed-shape tensors for every layer at once. Kept apart so both sides agree on one definition.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import RequestError


def _int32(values: "torch.Tensor | np.ndarray") -> np.ndarray:
    """A 1-D int32 numpy array of `values` (viewed, not copied, when it already is one)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.int32).reshape(-1)


@dataclass(frozen=True, eq=False)
class RowLayout:
    """One row's view of the pool for one forward.

    table:     block ids in logical order; *local* ids where `managed` is True (the builder adds each
               layer's base), absolute ids (scratch) elsewhere.
    positions: logical position of each query token, -1 for a padded token (never written or read).
    visible_end: query t sees logical keys [0, visible_end[t]); 0 for padded tokens.
    seq_len:   valid logical positions of the row.

    `arrays` holds numpy views of (table, managed, positions, visible_end) and `max_position` the largest
    position (-1 if none): the metadata builder (`metadata.py`) copies the arrays into its staging buffer
    and checks the bound without dispatching a torch operator (a `Tensor.numpy()` view per field was the
    largest part of a build). :meth:`build` makes the numpy arrays first and the tensors as views of them;
    any other construction (`dataclasses.replace`, a direct call) derives both from the tensors.
    """

    table: torch.Tensor  # int64 [m]
    managed: torch.Tensor  # bool [m]
    positions: torch.Tensor  # int32 [t]
    visible_end: torch.Tensor  # int32 [t]
    seq_len: int
    arrays: tuple[np.ndarray, ...] = field(init=False, repr=False)
    max_position: int = field(init=False)

    def __post_init__(self) -> None:
        table, managed = (t.detach().cpu().numpy().reshape(-1) for t in (self.table, self.managed))
        positions, visible_end = _int32(self.positions), _int32(self.visible_end)
        object.__setattr__(self, "positions", torch.from_numpy(positions))
        object.__setattr__(self, "visible_end", torch.from_numpy(visible_end))
        arrays = (table, managed, positions, visible_end)
        self._set(arrays, int(positions.max()) if len(positions) else -1)

    def _set(self, arrays: tuple[np.ndarray, ...], max_position: int) -> None:
        object.__setattr__(self, "arrays", arrays)
        object.__setattr__(self, "max_position", max_position)

    @staticmethod
    def build(
        managed_blocks: list[int],
        scratch_blocks: list[int],
        positions: "torch.Tensor | np.ndarray",
        visible_end: "torch.Tensor | np.ndarray",
        seq_len: int,
        max_position: int | None = None,
    ) -> "RowLayout":
        """`max_position`: the plan's own bound on `positions` when it knows it (an arange); else computed."""
        m = len(managed_blocks)
        table = np.empty(m + len(scratch_blocks), dtype=np.int64)
        table[:m] = managed_blocks
        table[m:] = scratch_blocks
        managed = np.zeros(len(table), dtype=bool)
        managed[:m] = True
        arrays = (table, managed, _int32(positions), _int32(visible_end))
        if max_position is None:
            max_position = int(arrays[2].max()) if len(arrays[2]) else -1
        row = object.__new__(RowLayout)  # not __init__: the tensors are views of `arrays`, nothing to derive
        for name, value in zip(("table", "managed", "positions", "visible_end"), arrays):
            object.__setattr__(row, name, torch.from_numpy(value))
        object.__setattr__(row, "seq_len", seq_len)
        row._set(arrays, max_position)
        return row

    @property
    def num_tokens(self) -> int:
        return len(self.arrays[2])

    @property
    def num_blocks(self) -> int:
        return len(self.arrays[0])


def allowed_keys(mask: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows, Q, K) bool on the host: which key columns each query may attend.

    Accepts (rows, 1, Q, K), (rows, Q, K) or a broadcast (1, ...) mask; boolean (True = attend) or
    additive (0 = attend; -inf or the dtype's lowest value = masked). Any other additive value is kept as
    "attended" and then fails the prefix check: refused, never silently reinterpreted.
    """
    if mask.dim() == 4:
        if mask.shape[1] != 1:
            raise RequestError(f"the attention mask has {mask.shape[1]} head rows; one (broadcast over heads) is needed")
        mask = mask[:, 0]
    if mask.dim() != 3:
        raise RequestError(f"the attention mask must be (rows, 1, queries, keys), got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask > torch.finfo(mask.dtype).min
    if allowed.shape[0] not in (1, rows):
        raise RequestError(f"the attention mask has {allowed.shape[0]} rows but the request has {rows} CFG rows")
    return allowed.expand(rows, *allowed.shape[1:]).to("cpu")


@dataclass(frozen=True)
class MaskLayout:
    """One row's layout read from its own prefill mask (queries = keys = the S dense tokens).

    positions[c]: the logical position of dense token c (its rank among the kept tokens), -1 for padding.
    visible_end[q]: dense query q sees exactly the logical keys [0, visible_end[q]).
    ends_by_position[i]: the visible end of the token at logical position i (int32, as the metadata stages it:
    a step's row layout views a slice of it).
    """

    positions: torch.Tensor
    visible_end: torch.Tensor
    ends_by_position: torch.Tensor

    @property
    def kept(self) -> int:
        return int(self.ends_by_position.numel())


def layout_from_prefill_mask(allowed: torch.Tensor, row: int = 0) -> MaskLayout:
    """Read a row's layout from its (S, S) prefill mask, or refuse with the first query it cannot express.

    The paged op gives every query the first `visible_end` kept tokens of its row, in order. So: a token is
    padding when no other token sees it and it sees nothing but (at most) itself; every other token that
    anyone sees is kept, in dense order, wherever the padding sits (left, middle, right); and every query
    must see exactly a prefix of the kept tokens. A causal pad after the target (right padding) is simply a
    kept token nobody else reads. Runs once per request, on the host, outside any compiled region.
    """
    S = allowed.shape[-1]
    if allowed.shape != (S, S):
        raise RequestError(f"a prefill mask must be square (queries = keys), got {tuple(allowed.shape)}")
    # One pass per reduction over the (S, S) mask, in bytes and int32: at the released size (S ~ 5k) the int64
    # and index-put forms took about 1 s per row; the checks and the error are unchanged.
    diag = torch.arange(S)
    on_diag = allowed[diag, diag].to(torch.int32)
    sees = allowed.view(torch.uint8).sum(1, dtype=torch.int32)
    seen_by_others = allowed.view(torch.uint8).sum(0, dtype=torch.int32) - on_diag
    pad = (seen_by_others == 0) & (sees - on_diag == 0)
    a = allowed
    if bool(pad.any()):
        a = allowed.clone()
        a[pad] = False
        a[:, pad] = False
        sees = a.view(torch.uint8).sum(1, dtype=torch.int32)
    kept = a.any(0)
    positions = torch.where(kept, torch.cumsum(kept, 0) - 1, torch.full((S,), -1))
    ends = sees.to(torch.int64)
    expect = kept[None, :] & (positions[None, :] < ends[:, None])
    if not torch.equal(a, expect):
        q, c = (int(i) for i in (a != expect).nonzero()[0])
        raise RequestError(
            f"row {row}: dense query {q} {'sees' if bool(a[q, c]) else 'does not see'} key {c}, but the paged op "
            f"gives each query the first n kept tokens of its row, in order (query {q} sees {int(ends[q])}): this "
            "mask (a window, a gap, or padding that real tokens see) cannot be paged; run this request densely"
        )
    ends_by_position = ends[kept]
    return MaskLayout(positions, ends.to(torch.int64), ends_by_position.to(torch.int32))


def mask_disagreement(allowed: torch.Tensor, row: RowLayout, key_positions: torch.Tensor) -> str:
    """Where a dense (Q, K) mask row block disagrees with what the paged op gives each query ("" if nowhere).

    key_positions[c] is the logical position dense key column c holds (-1: padding, never visible).
    Queries with nothing visible (padding) are not compared: their output is not computed.
    """
    if allowed.shape[-1] != len(key_positions) or allowed.shape[-2] < row.num_tokens:
        return (f"mask shape {tuple(allowed.shape)} vs {row.num_tokens} queries over {len(key_positions)} "
                "dense key columns")
    expect = (key_positions[None, :] >= 0) & (key_positions[None, :] < row.visible_end[:, None])
    valid = row.visible_end > 0
    got = allowed[: row.num_tokens]
    bad = ((got != expect) & valid[:, None]).nonzero()
    if not len(bad):
        return ""
    t, c = (int(i) for i in bad[0])
    return f"query {t}, key column {c}: mask {bool(got[t, c])}, layout {bool(expect[t, c])}"


def write_positions_problem(row: RowLayout, key_positions: torch.Tensor | None, columns: torch.Tensor) -> str:
    """Why the dense columns a forward writes its new tokens at disagree with the row's layout ("" if they agree).

    A static cache written at `position_ids` (Tencent's HunyuanStaticCache: ``index_copy_`` at the positions)
    holds, in dense column c, the logical position `key_positions[c]` of the runtime's layout (read from the
    prefill mask). New token t must therefore be written at a column holding its own logical position (a pad
    token: at a column nobody reads). Any other column would make the dense cache and the paged one differ.
    """
    if key_positions is None:
        return "the forward's plan has no dense key layout (plan it with the family helper: runtime.hunyuan_forward)"
    columns = columns.reshape(-1).to("cpu", torch.int64)
    if columns.numel() != row.num_tokens:
        return f"{columns.numel()} write positions for {row.num_tokens} new tokens"
    S = len(key_positions)
    if bool(((columns < 0) | (columns >= S)).any()):
        return f"write positions {columns.tolist()} fall outside the {S}-column cache layout"
    bad = (key_positions[columns] != row.positions).nonzero()
    if not len(bad):
        return ""
    t = int(bad[0])
    return (f"new token {t} (logical position {int(row.positions[t])}) is written at dense column {int(columns[t])}, "
            f"which holds logical position {int(key_positions[columns[t]])} in the layout")
