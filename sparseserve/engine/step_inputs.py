"""A step's host inputs, built in one place and handed down once: token ids, positions, KV slots,
block tables, sampling's rows, and under KV offload the device addressing (docs/engine.md).

A steady decode batch (same sequences, same order) keeps its rows (`SteadyRows`, vLLM's
persistent batch); a row is rebuilt when its sequence opens a block or moves its device window."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from sparseserve.engine.overlap import TokenFeed
from sparseserve.kvcache.offload_plan import OffloadPlan
from sparseserve.kvcache.transfer import to_device_many

RowOf = Callable[[object], tuple[int, list[int]]]  # seq -> (index of its first block, the blocks)


class SteadyRows:
    def __init__(self, ids: list[int], tables: np.ndarray, row_of: RowOf, pad: int, block_size: int) -> None:
        self.ids, self.tables, self.row_of, self.pad, self.block_size = ids, tables, row_of, pad, block_size
        self.index = {sid: b for b, sid in enumerate(ids)}
        self.base = np.zeros(len(ids), dtype=np.int64)  # tail block's slot - its first position

    @classmethod
    def build(cls, scheduled: list, row_of: RowOf, pad: int, block_size: int) -> SteadyRows | None:
        """The rows of a step in which every sequence decodes (None otherwise)."""
        if any(n != 1 for _, n in scheduled):
            return None
        rows = cls([seq.seq_id for seq, _ in scheduled], tables_of(scheduled, row_of, pad), row_of, pad, block_size)
        for b, (seq, _) in enumerate(scheduled):
            rows._set_base(b, seq)
        return rows

    def fits(self, scheduled: list) -> bool:
        """Whether `scheduled` is a decode step of the same sequences in the same order."""
        return len(scheduled) == len(self.ids) and [seq.seq_id for seq, n in scheduled if n == 1] == self.ids

    def update(self, scheduled: list, changed: Iterable[int]) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """The next decode step of the same rows, those of `changed` seq_ids rebuilt: (each
        token's slot, the tables (a copy), each row's position)."""
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
            self.tables[b, start : start + len(blocks)] = blocks
            self._set_base(b, seq)
        pos = np.fromiter((seq.num_computed_tokens for seq, _ in scheduled), dtype=np.int64, count=len(self.ids))
        return torch.from_numpy(self.base + pos), self.tables.copy(), pos

    def _set_base(self, b: int, seq) -> None:
        start, blocks = self.row_of(seq)
        tail = seq.num_computed_tokens // self.block_size
        self.base[b] = (int(blocks[tail - start]) - tail) * self.block_size


def tables_of(scheduled: list, row_of: RowOf, pad: int, width: int | None = None) -> np.ndarray:
    """int32 [B, width (default: the longest row's end)]: each sequence's blocks at their index."""
    rows = [row_of(seq) for seq, _ in scheduled]
    width = max(start + len(blocks) for start, blocks in rows) if width is None else width
    tables = np.full((len(scheduled), width), pad, dtype=np.int32)
    for b, (start, blocks) in enumerate(rows):
        tables[b, start : start + len(blocks)] = blocks
    return tables


def slots_of(scheduled: list, row_of: RowOf, block_size: int) -> list[int]:
    """Each new token's slot, per sequence and block (never per token for the arithmetic)."""
    bs, slots = block_size, []
    for seq, n in scheduled:
        start, blocks = row_of(seq)
        c = seq.num_computed_tokens
        if n == 1:
            slots.append(blocks[c // bs - start] * bs + c % bs)
            continue
        for blk in range(c // bs, (c + n - 1) // bs + 1):  # tokens [c, c + n), block by block
            lo, hi = max(c, blk * bs), min(c + n, (blk + 1) * bs)
            base = blocks[blk - start] * bs - blk * bs
            slots.extend(range(base + lo, base + hi))
    return slots


def _token_row(seq) -> tuple[int, np.ndarray]:
    return 0, seq.block_table_array()


def _token_list(seq) -> tuple[int, list[int]]:
    return 0, seq.block_table


class StepInputs:
    """The runner's step builder. `build` returns (host tensors by name, input token ids, feed
    rows to fill, sampled sequences, longest context); names the graphs read are static inputs."""

    def __init__(self, block_size: int, device: torch.device, offload=None) -> None:
        self.block_size, self.device = block_size, device
        self.offload = offload  # OffloadCache: its `ranges`, `num_device_blocks`
        self._rows: SteadyRows | None = None  # the last decode step's token rows
        self._row_lens: list[int] = []  # ... and each row's block table length then
        self._dev_rows: SteadyRows | None = None  # ... and its device rows (KV offload)
        self._changed: set[int] = set()  # seq_ids whose device range changed since the last build
        self._stale: list[int] = []  # token blocks leaving the pool with the next step
        self._ranges: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by decode batch size

    @property
    def steady(self) -> bool:
        """The last step built was a steady decode step (every row decodes its last token)."""
        return self._rows is not None

    def note_plan(self, plan: OffloadPlan | None) -> None:
        """A step's offload plan (the offload cache runs it): its changed ranges, stale blocks."""
        if plan is not None:
            self._changed.update(plan.ranges)
            self._stale += plan.stale

    def take_stale(self) -> list[int]:
        out, self._stale = self._stale, []
        return out

    def build(self, scheduled: list, feed: TokenFeed | None):
        if self._rows is None or not self._rows.fits(scheduled):
            self._rows = self._decode_rows(scheduled)
        if self._rows is not None:
            out = self._decode_inputs(scheduled, feed)
        else:
            out = self._step_inputs(scheduled, feed)
        if self.offload is not None:
            out[0].update(self._offload_inputs(scheduled))
        return out

    def decode_ranges(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """query_start_loc (int32 0..n) and sample_idx (int64 0..n-1) of a decode step of n rows,
        on the device, made once per batch size (read-only)."""
        ranges = self._ranges.get(n)
        if ranges is None:
            host = [torch.arange(n + 1, dtype=torch.int32), torch.arange(n, dtype=torch.long)]
            ranges = self._ranges[n] = tuple(to_device_many(host, self.device))
        return ranges

    def _decode_rows(self, scheduled: list) -> SteadyRows | None:
        if not all(n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens for seq, n in scheduled):
            return None
        self._row_lens = [len(s.block_table_array()) for s, _ in scheduled]
        return SteadyRows.build(scheduled, _token_row, 0, self.block_size)

    def _step_inputs(self, scheduled: list, feed: TokenFeed | None):
        """Built per sequence (and block, for prefill chunks)."""
        ids: list[int] = []
        positions: list[int] = []
        qsl, seq_lens, sample_idx, sampled = [0], [], [], []
        fill_dst: list[int] = []
        fill_src: list[int] = []
        for seq, n in scheduled:
            c = seq.num_computed_tokens
            ids.extend(seq.token_ids[c : c + n])  # (slices: a worker's SeqView has only these)
            if n == 1:
                positions.append(c)
            else:
                positions.extend(range(c, c + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(c + n)
            if c + n == seq.num_tokens:
                sample_idx.append(qsl[-1] - 1)
                sampled.append(seq)
                if feed is not None and seq.seq_id in feed.rows:
                    fill_dst.append(qsl[-1] - 1)
                    fill_src.append(feed.rows[seq.seq_id])
        slots = slots_of(scheduled, _token_list, self.block_size)
        host = {
            "slot_mapping": torch.tensor(slots, dtype=torch.long),
            "query_start_loc": torch.tensor(qsl, dtype=torch.int32),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
            "block_tables": torch.from_numpy(tables_of(scheduled, _token_row, 0)),
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "positions": torch.tensor(positions, dtype=torch.long),
            "sample_idx": torch.tensor(sample_idx, dtype=torch.long),
        }
        if fill_dst:
            host["fill_dst"] = torch.tensor(fill_dst, dtype=torch.long)
            host["fill_src"] = torch.tensor(fill_src, dtype=torch.long)
        return host, ids, len(fill_dst), sampled, max(seq_lens)

    def _decode_inputs(self, scheduled: list, feed: TokenFeed | None):
        """A steady decode step's inputs, in one pass: rows kept, those whose table grew rebuilt.
        No feed rows when every row's feed row has its index: the runner copies the feed whole."""
        rows = feed.rows if feed is not None else {}
        row_lens = self._row_lens
        grew: list[int] = []
        ids: list[int] = []
        fill_dst: list[int] = []
        fill_src: list[int] = []
        same_rows = True  # every row so far fed from the feed's row of its own index
        for b, (seq, _) in enumerate(scheduled):
            num_blocks = len(seq.block_table_array())
            if num_blocks != row_lens[b]:
                row_lens[b] = num_blocks
                grew.append(seq.seq_id)
            c = seq.num_computed_tokens
            ids += seq.token_ids[c : c + 1]
            src = rows.get(seq.seq_id)
            same_rows = same_rows and src == b
            if src is not None:
                fill_dst.append(b)
                fill_src.append(src)
        slots, tables, pos = self._rows.update(scheduled, grew)
        host = {
            "slot_mapping": slots,
            "seq_lens": torch.from_numpy((pos + 1).astype(np.int32)),
            "block_tables": torch.from_numpy(tables),
            "input_ids": torch.from_numpy(np.array(ids, dtype=np.int64)),
            "positions": torch.from_numpy(pos),
        }
        if fill_dst and not same_rows:
            host["fill_dst"] = torch.from_numpy(np.array(fill_dst, dtype=np.int64))
            host["fill_src"] = torch.from_numpy(np.array(fill_src, dtype=np.int64))
        return host, ids, len(fill_dst), [seq for seq, _ in scheduled], int(pos.max()) + 1

    # ---- KV offload: the sparse layers' device block cache ------------------------------------

    def _device_row(self, seq) -> tuple[int, list[int]]:
        return self.offload.ranges[seq.seq_id]

    def _offload_inputs(self, scheduled: list) -> dict[str, torch.Tensor]:
        """Device cache slots of the step's tokens, device tables of its sequences (released entries
        name the trash row), and the blocks leaving the pool with the step (when any)."""
        nb, bs = self.offload.num_device_blocks, self.block_size
        changed, self._changed = self._changed, set()
        if self._dev_rows is None or not self._dev_rows.fits(scheduled):
            self._dev_rows = SteadyRows.build(scheduled, self._device_row, nb, bs)
            changed = ()
        if self._dev_rows is not None:
            slots, tables, _ = self._dev_rows.update(scheduled, changed)
        else:
            slots = torch.tensor(slots_of(scheduled, self._device_row, bs), dtype=torch.long)
            width = max(len(seq.block_table) for seq, _ in scheduled)
            tables = tables_of(scheduled, self._device_row, nb, width)
        out = {"offload_slot_mapping": slots, "offload_block_tables": torch.from_numpy(tables)}
        stale = self.take_stale()
        if stale:  # most steps drop nothing from the pool: no upload for it then
            out["offload_stale"] = torch.from_numpy(np.array(stale, dtype=np.int64))
        return out
