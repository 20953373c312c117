"""The model runner's host mirror of the running sequences' block tables.

Block ids live in the scheduler (Sequence.block_ids). Rebuilding a [batch, max_blocks] table
from Python lists every step costs O(total blocks); the mirror keeps one row per sequence and
writes only what changed since the last step:

    a new sequence or a new block list (preempted and readmitted) → the whole row
    blocks appended                                                 → the tail
    the last block replaced (copy-on-write)                         → one entry
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.engine.sequence import Sequence


class BlockTableMirror:
    def __init__(self, rows: int, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.table = torch.zeros((rows, max_blocks), dtype=torch.int32)
        self.np = self.table.numpy()
        self.free_rows = list(range(rows - 1, -1, -1))
        # seq_id -> [row, the block list object last seen, its length then]
        self.state: dict[int, list] = {}

    def row(self, seq: Sequence) -> int:
        """The sequence's row, brought up to date."""
        ids = seq.block_ids
        st = self.state.get(seq.seq_id)
        if st is None:
            if not self.free_rows:
                self._grow()
            st = self.state[seq.seq_id] = [self.free_rows.pop(), None, 0]
        row, seen, n = st
        m = len(ids)
        if seen is not ids or m < n or n == 0:
            self.np[row, :m] = ids
        elif m > n:
            self.np[row, n - 1:m] = ids[n - 1:]
        elif self.np[row, m - 1] != ids[-1]:
            self.np[row, m - 1] = ids[-1]
        st[1], st[2] = ids, m
        return row

    def release(self, seq_id: int) -> None:
        st = self.state.pop(seq_id, None)
        if st is not None:
            self.free_rows.append(st[0])

    def gather(self, rows: list[int], width: int) -> np.ndarray:
        """The rows' first `width` entries: a new int32 array [len(rows), width]."""
        return self.np[rows, :width]

    def _grow(self) -> None:
        old = self.table
        self.table = torch.zeros((2 * old.shape[0], self.max_blocks), dtype=torch.int32)
        self.table[:old.shape[0]] = old
        self.np = self.table.numpy()
        self.free_rows = list(range(self.table.shape[0] - 1, old.shape[0] - 1, -1))
