"""A decode batch's block tables and slot bases kept from one decode step to the next (vLLM's persistent batch,
for the rows of a steady decode batch).

While the same sequences decode in the same order, a row of a step's block tables changes only when its
sequence's blocks do: the decode that opens a block (one step in block_size) or, under KV offload, moves its
device window (the same step). Such a step rebuilds those rows and takes each token's KV slot as its row's base
plus its position, instead of building every row and slot on the host: at a large decode batch that per-row work
is a visible part of a step. The first decode step of a batch (and any step with a prefill) builds every row.

Both the runner (token-block tables) and the offload cache (device-block tables) keep one; `row_of` says where a
sequence's blocks are: (index of the first, the blocks), the table's `pad` elsewhere.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

RowOf = Callable[[object], tuple[int, list[int]]]


class DecodeRows:
    def __init__(self, ids: list[int], tables: np.ndarray, row_of: RowOf, pad: int, block_size: int) -> None:
        self.ids, self.tables, self.row_of, self.pad, self.block_size = ids, tables, row_of, pad, block_size
        self.index = {sid: b for b, sid in enumerate(ids)}
        self.base = np.zeros(len(ids), dtype=np.int64)  # slot of the row's tail block minus its first position

    @classmethod
    def build(cls, scheduled: list, row_of: RowOf, pad: int, block_size: int) -> "DecodeRows | None":
        """The rows of a step in which every sequence decodes ((sequence, new tokens) pairs; None otherwise)."""
        if any(n != 1 for _, n in scheduled):
            return None
        rows = cls([seq.seq_id for seq, _ in scheduled], tables_of(scheduled, row_of, pad), row_of, pad, block_size)
        for b, (seq, _) in enumerate(scheduled):
            rows._set_base(b, seq)
        return rows

    def fits(self, scheduled: list) -> bool:
        """Whether `scheduled` is a decode step of the same sequences in the same order."""
        # (a list compared whole: the runner and the offload cache ask this every step, per sequence a generator
        # step costs more; a chunk of more than one token leaves the list shorter)
        return len(scheduled) == len(self.ids) and [seq.seq_id for seq, n in scheduled if n == 1] == self.ids

    def update(self, scheduled: list, changed: Iterable[int]) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """The next decode step of the same rows (`fits`), the rows of the sequences in `changed` (seq_ids; others
        are ignored) rebuilt: (each token's slot, the tables (a copy), each row's position)."""
        for sid in changed:
            b = self.index.get(sid)
            if b is None:
                continue
            seq = scheduled[b][0]
            start, blocks = self.row_of(seq)
            if start + len(blocks) > self.tables.shape[1]:
                wider = np.full((len(self.ids), start + len(blocks)), self.pad, dtype=np.int32)
                wider[:, : self.tables.shape[1]] = self.tables
                self.tables = wider
            self.tables[b] = self.pad
            self.tables[b, start: start + len(blocks)] = blocks
            self._set_base(b, seq)
        pos = np.fromiter((seq.num_computed_tokens for seq, _ in scheduled), dtype=np.int64, count=len(self.ids))
        return torch.from_numpy(self.base + pos), self.tables.copy(), pos

    def _set_base(self, b: int, seq) -> None:
        start, blocks = self.row_of(seq)
        tail = seq.num_computed_tokens // self.block_size
        self.base[b] = (int(blocks[tail - start]) - tail) * self.block_size


def tables_of(scheduled: list, row_of: RowOf, pad: int, width: int | None = None) -> np.ndarray:
    """int32 [B, width (default: the longest row's end)]: each sequence's blocks at their indices, pad elsewhere."""
    rows = [row_of(seq) for seq, _ in scheduled]
    width = max(start + len(blocks) for start, blocks in rows) if width is None else width
    tables = np.full((len(scheduled), width), pad, dtype=np.int32)
    for b, (start, blocks) in enumerate(rows):
        tables[b, start: start + len(blocks)] = blocks
    return tables
