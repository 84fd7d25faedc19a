"""What one row looks like in one forward: its block table and where each query token goes.

The scheduler produces a `RowLayout` per row; the metadata builder turns a list of them into the
op's fixed-shape tensors for every layer at once. Kept apart so both sides agree on one definition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowLayout:
    """One row's view of the pool for one forward.

    table:     block ids in logical order; *local* ids where `managed` is True (the builder adds each
               layer's base), absolute ids (scratch) elsewhere.
    positions: logical position of each query token, -1 for a padded token (never written or read).
    visible_end: query t sees logical keys [0, visible_end[t]); 0 for padded tokens.
    seq_len:   valid logical positions of the row.
    """

    table: torch.Tensor  # int64 [m]
    managed: torch.Tensor  # bool [m]
    positions: torch.Tensor  # int64 [t]
    visible_end: torch.Tensor  # int64 [t]
    seq_len: int

    @staticmethod
    def build(
        managed_blocks: list[int],
        scratch_blocks: list[int],
        positions: torch.Tensor,
        visible_end: torch.Tensor,
        seq_len: int,
    ) -> "RowLayout":
        table = torch.tensor(list(managed_blocks) + list(scratch_blocks), dtype=torch.int64)
        managed = torch.zeros(len(table), dtype=torch.bool)
        managed[: len(managed_blocks)] = True
        return RowLayout(table, managed, positions.to(torch.int64), visible_end.to(torch.int64), seq_len)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def num_blocks(self) -> int:
        return int(self.table.numel())
