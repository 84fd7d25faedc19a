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
    kv_gap:    logical keys [kv_gap[0], kv_gap[1]) are seen by no query (e.g. what lies between a window's sink
               and its recent tokens, `families/dreamzero.py`); (0, 0): none.

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
    kv_gap: tuple[int, int] = (0, 0)
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
        kv_gap: tuple[int, int] = (0, 0),
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
        object.__setattr__(row, "kv_gap", kv_gap)
        row._set(arrays, max_position)
        return row

    @property
    def num_tokens(self) -> int:
        return len(self.arrays[2])

    @property
    def num_blocks(self) -> int:
        return len(self.arrays[0])


def mask_rows(mask: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """Each CFG row's (Q, K) mask: a view of `mask`, not converted (the readers convert a block of queries at a
    time, `_attends`), so no (rows, Q, K) bool copy is made. A broadcast (1, ...) mask gives every row the
    same view object.

    Accepts (rows, 1, Q, K), (rows, Q, K) or a broadcast (1, ...) mask; boolean (True = attend) or additive
    (0 = attend; at most `MASKED_AT`, -inf included = masked). Any other additive value (a bias, +inf, NaN) is
    refused by the readers, never read as one or the other (`_attends`).
    """
    if mask.dim() == 4:
        if mask.shape[1] != 1:
            raise RequestError(f"the attention mask has {mask.shape[1]} head rows; one (broadcast over heads) is needed")
        mask = mask[:, 0]
    if mask.dim() != 3:
        raise RequestError(f"the attention mask must be (rows, 1, queries, keys), got shape {tuple(mask.shape)}")
    if mask.shape[0] not in (1, rows):
        raise RequestError(f"the attention mask has {mask.shape[0]} rows but the request has {rows} CFG rows")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise RequestError(f"the attention mask is {mask.dtype}; pass a boolean (True = attend) or an additive "
                           "floating mask (0 = attend, -inf or torch.finfo(dtype).min = masked)")
    mask = mask.detach()
    return [mask[r] for r in range(rows)] if mask.shape[0] > 1 else [mask[0]] * rows


#: Mask entries read per block of queries (a bool block of 512 KB, its bf16 source 1 MB: both stay in cache
#: between the conversion and the two sums that read the block).
_BLOCK_ELEMENTS = 1 << 19
#: An additive mask entry at or below this hides its key; 0 (or -0.0) attends; anything else is refused.
#: Why: SDPA adds the entry to the logit, so a masked key's weight is exp(s_masked + v - max) / sum, exactly 0 in
#: the fp32 softmax every SDPA backend uses (bf16/fp16 inputs included) once the exponent is below -103.97.
#: No finite v is 0 for every logit. Measured (`tests/test_mask_layout.py::test_masked_value_weight` keeps it):
#: v = -8192 gives output bit-identical to dropping the key while the masked key's logit is less than about 8,170
#: above the row's largest visible one, in fp32, bf16 and fp16; -1e3 already differs (by 2.0) at a gap of 1,000.
#: -2**13 is exact in every float dtype, so the conventional -1e4 (bf16 rounds it to -9984), -1e9, every
#: finfo.min and -inf all read as masked, while a real bias (ALiBi, a soft penalty) is refused: the op cannot
#: express one.
MASKED_AT = -8192.0
#: Per additive float dtype: its same-size integer dtype and the integer views of MASKED_AT and -inf. Negative
#: floats view as integers that grow with the magnitude: v <= MASKED_AT is exactly view(MASKED_AT) <= i <=
#: view(-inf) (a negative NaN lies above view(-inf)); -0.0 views as the integer minimum, +0.0 as 0.
def _int_view(dtype: torch.dtype, itype: torch.dtype, utype: type) -> tuple:
    """(signed integer dtype, view(MASKED_AT), view(-inf), unsigned numpy dtype, unsigned view(-inf))."""
    masked, ninf = torch.tensor([MASKED_AT, float("-inf")], dtype=dtype).view(itype).tolist()
    return itype, masked, ninf, utype, ninf % (1 << (8 * np.dtype(utype).itemsize))


_INT_VIEWS = {dt: _int_view(dt, it, ut)
              for dt, it, ut in ((torch.bfloat16, torch.int16, np.uint16), (torch.float16, torch.int16, np.uint16),
                                 (torch.float32, torch.int32, np.uint32), (torch.float64, torch.int64, np.uint64))}


class AmbiguousMaskValue(RequestError):
    """An additive mask entry that is neither "attend" (0) nor "masked" (<= MASKED_AT): the op cannot express it."""

    def __init__(self, query: int, key: int, value: float, row: int | None = None) -> None:
        self.query, self.key, self.value = query, key, value
        where = "" if row is None else f"row {row}: "
        super().__init__(
            f"{where}the attention mask holds {value!r} at (query {query}, key {key}): an additive mask entry must be "
            f"0 (attend) or at most {MASKED_AT:g} (-inf, torch.finfo(dtype).min: masked, softmax weight exactly 0); "
            "a value in between is a bias, which the paged op cannot express. Build the mask with "
            "masked_fill(~allowed, torch.finfo(dtype).min) or pass it as a boolean mask, or run this request densely"
        )

    def at(self, first_query: int = 0, row: int | None = None) -> "AmbiguousMaskValue":
        """The same entry in a larger mask: its block starts at `first_query`, it is CFG row `row`."""
        return AmbiguousMaskValue(self.query + first_query, self.key, self.value, row)

    def where(self) -> str:
        """Where and what, for a message that names the row itself (`mask_disagreement`)."""
        return (f"query {self.query}, key column {self.key}: mask value {self.value!r} is neither 0 (attend) nor at "
                f"most {MASKED_AT:g} (masked, weight exactly 0), a bias the paged op cannot express; build the mask "
                "with masked_fill(~allowed, torch.finfo(dtype).min) or pass a boolean mask")


def _ambiguous(block: torch.Tensor, bad: torch.Tensor | np.ndarray) -> AmbiguousMaskValue:
    """The first (row-major) entry of a 1-D or 2-D block flagged in `bad`, as an error."""
    bad = torch.as_tensor(bad).reshape(block.shape)
    index = [int(i) for i in bad.nonzero()[0]]
    q, k = (index[0], index[0]) if bad.dim() == 1 else index  # a diagonal: entry i is (i, i)
    return AmbiguousMaskValue(q, k, float(block[tuple(index)]))


def _attends(block: torch.Tensor, out: np.ndarray | None = None) -> torch.Tensor:
    """Which entries of a mask block attend: True for a boolean mask; for an additive one, 0 attends and a value
    at most `MASKED_AT` is masked. Any other value raises `AmbiguousMaskValue` (first offending entry).

    On the host, a block whose raw integers all lie in [view(MASKED_AT), view(-inf)] or are 0 holds only +0.0
    (attended) and masked values: there "attends" is exactly `integer >= 0`, which numpy computes several times
    faster than torch's bf16 comparison (one min, one max and one comparison per block, as before). Any other
    block (a -0.0, a bias, +inf, a NaN) takes the exact classification, which names a refused entry.
    """
    if block.dtype == torch.bool:
        return block
    view = _INT_VIEWS.get(block.dtype)
    if view is not None and block.device.type == "cpu" and block.numel():
        ints = block.view(view[0]).numpy()
        # signed: nothing below view(MASKED_AT) (a -0.0, a small negative) or above 0 (a positive); unsigned:
        # nothing above view(-inf) (a negative NaN, which lies between view(-inf) and 0 in the signed view)
        if ints.min() >= view[1] and ints.max() <= 0 and ints.view(view[3]).max() <= view[4]:
            return torch.from_numpy(np.greater_equal(ints, 0, out=out))
        zero = np.iinfo(ints.dtype).min  # -0.0
        attends = (ints == 0) | (ints == zero)
        bad = ~attends & ((ints < view[1]) | (ints > view[2]))
        if bad.any():
            raise _ambiguous(block, bad)
        if out is not None:
            np.copyto(out, attends)
            attends = out
        return torch.from_numpy(attends)
    attends = block == 0
    bad = ~attends & ~(block <= MASKED_AT)  # NaN compares False: refused
    if bool(bad.any()):
        raise _ambiguous(block, bad.cpu())
    return attends


def _attend_counts(mask: torch.Tensor, counted: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per query how many keys it attends, and per key how many of the `counted` queries (default: all)
    attend it (int64 numpy arrays).

    On the host, one read of the mask a block of queries at a time, converted and summed both ways while in
    cache, with numpy. The readers' O(S) work on the counts is numpy too: single-threaded, it does not wait on
    torch's intra-op threads, which made these small operations several times slower on a loaded host
    (docs/benchmarks.md). A device mask is reduced on its device; only the counts come back.
    """
    if mask.device.type != "cpu":
        attends = _attends(mask).to(torch.int32)
        rows = attends if counted is None else attends[torch.from_numpy(counted).to(mask.device)]
        return attends.sum(1).cpu().numpy().astype(np.int64), rows.sum(0).cpu().numpy().astype(np.int64)
    Q, K = mask.shape
    step = max(1, _BLOCK_ELEMENTS // max(K, 1))
    skipped = None if counted is None or counted.all() else ~counted
    per_query, per_key = np.empty(Q, dtype=np.int32), np.zeros(K, dtype=np.int32)
    out = np.empty((min(step, Q), K), dtype=bool)
    for start in range(0, Q, step):
        block = mask[start : start + step]
        try:
            attends = _attends(block, out[: len(block)]).numpy().view(np.uint8)
        except AmbiguousMaskValue as e:
            raise e.at(start) from None
        np.add.reduce(attends, axis=1, dtype=np.int32, out=per_query[start : start + len(block)])
        if skipped is not None and skipped[start : start + len(block)].any():
            attends = attends[~skipped[start : start + len(block)]]
        per_key += np.add.reduce(attends, axis=0, dtype=np.int32)
    return per_query.astype(np.int64), per_key.astype(np.int64)


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


def layout_from_prefill_mask(mask: torch.Tensor, row: int = 0) -> MaskLayout:
    """Read a row's layout from its (S, S) prefill mask, or refuse with the first query it cannot express.

    `mask`: a `mask_rows` view (boolean or additive: an entry that is neither "attend" nor "masked" is refused,
    `_attends`). The paged op gives every
    query the first `visible_end` kept tokens of its row, in order. So: a token is padding when no other token
    sees it and it sees nothing but (at most) itself; every other token that anyone sees is kept, in dense
    order, wherever the padding sits (left, middle, right); and every query must see exactly a prefix of the
    kept tokens. A causal pad after the target (right padding) is simply a kept token nobody else reads. Runs
    once per request, on the host, outside any compiled region.

    Decided from O(S) counts (one read of the mask, `_attend_counts`): a query that is not padding sees only
    kept tokens (a pad's own column is seen by nobody else), n of them, whose ranks sum to at least
    0 + 1 + ... + (n - 1), with equality exactly when they are the first n. Summed over the queries, the ranks
    seen are sum_c rank[c] * (queries seeing c): the mask is accepted iff that equals sum_q n_q (n_q - 1) / 2.
    Only a refused mask is compared entry by entry (`_first_disagreement`), for the first offending key.
    """
    S = mask.shape[-1]
    if mask.shape != (S, S):
        raise RequestError(f"a prefill mask must be square (queries = keys), got {tuple(mask.shape)}")
    try:
        sees, seen = _attend_counts(mask)
    except AmbiguousMaskValue as e:
        raise e.at(row=row) from None
    on_diag = _attends(torch.diagonal(mask)).cpu().numpy().astype(np.int64)
    pad = (seen == on_diag) & (sees == on_diag)
    ends = sees - (pad & (on_diag == 1))  # a pad sees at most itself: nothing once dropped
    kept = (seen > 0) & ~pad
    positions = np.where(kept, np.cumsum(kept, dtype=np.int64) - 1, -1)
    if int((np.maximum(positions, 0) * seen).sum()) != int((ends * (ends - 1)).sum()) // 2:
        _first_disagreement(mask, row, *(torch.from_numpy(x) for x in (pad, kept, positions, ends)))
    ends_by_position = ends[kept].astype(np.int32)
    return MaskLayout(torch.from_numpy(positions), torch.from_numpy(ends), torch.from_numpy(ends_by_position))


def _first_disagreement(mask: torch.Tensor, row: int, pad: torch.Tensor, kept: torch.Tensor,
                        positions: torch.Tensor, ends: torch.Tensor) -> None:
    """Raise for the first (query, key), in row-major order, where the row's mask (padding dropped) differs from
    the layout the paged op would give it. A full comparison: only a mask the counts refused comes here."""
    a = _attends(mask).to("cpu", copy=True)
    a[pad] = False
    a[:, pad] = False
    expect = kept[None, :] & (positions[None, :] < ends[:, None])
    bad = (a != expect).nonzero()
    if not len(bad):
        raise AssertionError(f"row {row}: the mask's counts refused a layout its entries accept (a bug in layout.py)")
    q, c = (int(i) for i in bad[0])
    raise RequestError(
        f"row {row}: dense query {q} {'sees' if bool(a[q, c]) else 'does not see'} key {c}, but the paged op "
        f"gives each query the first n kept tokens of its row, in order (query {q} sees {int(ends[q])}): this "
        "mask (a window, a gap, or padding that real tokens see) cannot be paged; run this request densely"
    )


def mask_disagreement(mask: torch.Tensor, row: RowLayout, key_positions: torch.Tensor) -> str:
    """Where a dense (Q, K) mask row block disagrees with what the paged op gives each query ("" if nowhere).

    `mask`: a `mask_rows` view (boolean or additive; an entry that is neither "attend" nor "masked" is a
    disagreement, `AmbiguousMaskValue.where`). key_positions[c] is the
    logical position dense key column c holds (-1: padding, never visible). Queries with nothing visible
    (padding) are not compared: their output is not computed.

    Decided from O(K) counts, like `layout_from_prefill_mask`: query t must see E_t, the columns holding a
    position in [0, visible_end[t]), which are the |E_t| columns of smallest weight (its position; a padding
    column weighs more than any position). A query seeing |E_t| columns sees weights summing to at least E_t's,
    with equality exactly when it sees E_t. So: every compared query sees as many columns as E_t has, and the
    weights seen, summed over those queries, equal the sum of the E_t's. Only a disagreeing mask is compared
    entry by entry, for the first (query, key).
    """
    if mask.shape[-1] != len(key_positions) or mask.shape[-2] < row.num_tokens:
        return (f"mask shape {tuple(mask.shape)} vs {row.num_tokens} queries over {len(key_positions)} "
                "dense key columns")
    got = mask[: row.num_tokens]
    ends = row.arrays[3].astype(np.int64)  # visible_end
    keys = key_positions.to("cpu", torch.int64).numpy()
    valid = ends > 0
    held = np.sort(keys[keys >= 0])
    count = np.searchsorted(held, ends)  # |E_t|
    firsts = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(held)])  # firsts[n]: the n smallest, summed
    heavy = max(int(ends.max()) if len(ends) else 0, int(keys.max()) if len(keys) else 0) + 1
    weight = np.where(keys >= 0, keys, heavy)
    try:
        sees, seen = _attend_counts(got, valid)
    except AmbiguousMaskValue as e:
        return e.where()
    if np.array_equal(sees[valid], count[valid]) and int((seen * weight).sum()) == int(firsts[count[valid]].sum()):
        return ""
    got = _attends(got).to("cpu")
    keys, ends, valid = torch.from_numpy(keys), torch.from_numpy(ends), torch.from_numpy(valid)
    expect = (keys[None, :] >= 0) & (keys[None, :] < ends[:, None])
    bad = ((got != expect) & valid[:, None]).nonzero()
    if not len(bad):
        raise AssertionError("a mask's counts disagree with a layout its entries match (a bug in layout.py)")
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
        return "the forward's plan has no dense key layout (plan it with runtime.forward(owner_id, kind, ...))"
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
