"""KV offload, the scheduler's side (docs/offload.md): which token blocks of each sequence sit in
the sparse layers' device block cache, pauses, restores and blocks with new owners, emitted once
a step as an OffloadPlan that every rank's OffloadCache executes (kvcache/offload.py). Plain
Python: no tensor is touched here."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from sparseserve.kvcache.blocks import BlockAllocator, blocks_needed
from sparseserve.kvcache.offload_plan import OffloadPlan


class StaleBlocks:
    """Token blocks handed to new owners (`OffloadSpace.on_allocate`) leave the HBM pool (one
    launch, before the step's kernels) before any selection can list them. A block a decode
    opened holds one token, so it waits for the next launch, at most block_size - 2 steps; any
    other block leaves with its own step and takes the waiting ones along (docs/offload.md)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pending: list[int] = []  # since the last step
        self.waiting: list[int] = []  # opened by decodes, not yet taken
        self.deadline = 0  # the step by which the waiting ones leave
        self.steps = 0  # steps with a batch (take): every decode step is one

    def add(self, blocks: list[int]) -> None:
        self.pending += blocks

    def take(self, opened: list[int]) -> list[int]:
        """The blocks leaving the pool with this step; opened: the token blocks its decodes open."""
        self.steps += 1
        if not self.waiting:
            self.deadline = self.steps + self.block_size - 2
        if opened and self.pending:
            fresh = set(opened)
            self.waiting += [b for b in self.pending if b in fresh]
            self.pending = [b for b in self.pending if b not in fresh]
        if not self.pending and (not self.waiting or self.steps < self.deadline):
            return []
        return self.take_all()

    def take_all(self) -> list[int]:
        out, self.pending, self.waiting = self.pending + self.waiting, [], []
        return out

    def take_pending(self) -> list[int]:
        """A step without a batch: decodes opened nothing, the waiting ones may wait."""
        out, self.pending = self.pending, []
        return out


class DeviceBlockMap:
    """The device block cache's rows and which token blocks of each sequence they hold: a
    contiguous range [start, start + len(blocks)), every block while it prefills, the last
    `local_blocks` (tail included) once it decodes. Blocks leaving the range are released when the
    step is scheduled; the range only moves forward, so nothing is loaded back. Safe because the
    step's fence lands earlier writes and the step reads released blocks through the pool or host
    rows only (docs/offload.md, "Two block spaces")."""

    def __init__(self, num_blocks: int, local_blocks: int, block_size: int, token_blocks: int) -> None:
        self.allocator = BlockAllocator(num_blocks)
        self.token_blocks = token_blocks
        self.local_blocks = local_blocks
        self.block_size = block_size
        self.ranges: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (start, device blocks)
        # Sequences in layer-segmented prefill: they hold only their first decode's window.
        self.segmented: set[int] = set()
        # seq_id -> the end of the token block its last decode's `map` wrote into: decodes of
        # tokens before it keep the window (a decoding sequence never prefills again unreleased)
        self.steady_until: dict[int, int] = {}
        self.changed: set[int] = set()  # seq_ids whose range changed since `take_changed`

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def range_of(self, seq) -> tuple[int, list[int]]:
        return self.ranges.get(seq.seq_id, (0, []))

    def hot_range(self, seq, n: int) -> tuple[int, int]:
        """Token-block indices [lo, hi) a step computing n new tokens needs on the device."""
        c = seq.num_computed_tokens
        hi = blocks_needed(c + n, self.block_size)
        decode = n == 1 and c + 1 == seq.num_tokens
        return (max(hi - self.local_blocks, 0) if decode else 0), hi

    def num_to_allocate(self, seq, n: int) -> int:
        """Device blocks this step takes from the free list, net of what the sequence releases."""
        lo, hi = self.hot_range(seq, n)
        start, blocks = self.range_of(seq)
        held = len(blocks)
        missing = hi - max(lo, start + held) if held else hi - lo
        releasable = min(max(lo - start, 0), held)
        return missing - releasable

    def steady(self, seq, n: int) -> bool:
        """A decode whose mapped range is its window already (most decode steps): nothing to map,
        release or restore. One lookup: the scheduler asks it of every sequence every step."""
        return n == 1 and seq.num_computed_tokens < self.steady_until.get(seq.seq_id, 0)

    def can_map(self, seq, n: int) -> bool:
        return self.steady(seq, n) or self.allocator.can_allocate(max(self.num_to_allocate(seq, n), 0))

    def can_admit(self, seq, running: list) -> bool:
        """Whether a waiting sequence may start: its whole prefill's device blocks (a paused
        decode: its window) fit beside what running prefills still need, else it would only be
        preempted again. Always true when the device space is as large as the token space."""
        if self.num_blocks >= self.token_blocks:
            return True
        reserved = sum(self._prefill_rest(s) for s in running)
        if seq.num_computed_tokens + 1 >= seq.num_tokens:
            lo, hi = self.hot_range(seq, 1)
            need = hi - lo
        else:
            need = blocks_needed(seq.num_tokens, self.block_size)
        return self.allocator.num_free - reserved >= need

    def _prefill_rest(self, seq) -> int:
        """Device blocks a running sequence still has to map to finish its prefill."""
        if seq.num_computed_tokens + 1 >= seq.num_tokens or seq.seq_id in self.segmented:
            return 0
        start, blocks = self.range_of(seq)
        return blocks_needed(seq.num_tokens, self.block_size) - start - len(blocks)

    def map(self, seq, n: int) -> list[int]:
        """Releases the sequence's device blocks before the step's range and maps the blocks it
        adds. Returns the released device blocks (already back on the free list)."""
        lo, hi = self.hot_range(seq, n)
        start, blocks = self.range_of(seq)
        if not blocks:
            start = lo
        if lo < start:
            raise RuntimeError(
                f"sequence {seq.seq_id} needs token block {lo} on the device again after "
                f"releasing it (device range starts at {start})"
            )
        cut = min(lo - start, len(blocks))
        released: list[int] = []
        if cut:  # a decode's window moves once per block_size steps: most steps release nothing
            released = blocks[:cut]
            self.allocator.free(released)
            blocks = blocks[cut:]
            start = start + cut if blocks else lo
        end = start + len(blocks)
        if hi > end:
            blocks = blocks + self.allocator.allocate(hi - end)
        self.ranges[seq.seq_id] = (start, blocks)
        self.changed.add(seq.seq_id)
        self.segmented.discard(seq.seq_id)
        if n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens:  # a decode: range [lo, hi)
            self.steady_until[seq.seq_id] = hi * self.block_size
        else:
            self.steady_until.pop(seq.seq_id, None)
        return released

    def window(self, seq) -> tuple[int, int]:
        """Token-block indices [lo, hi) of the prompt's blocks in its first decode's local window
        (the prompt's tail block included): what a layer-segmented prefill leaves on the device
        (engine/layer_prefill.py)."""
        p, bs = seq.num_tokens, self.block_size
        return max(blocks_needed(p + 1, bs) - self.local_blocks, 0), blocks_needed(p, bs)

    def can_admit_window(self, seq, running: list) -> bool:
        """Whether a layer-segmented prefill may start: its window fits beside running prefills."""
        lo, hi = self.window(seq)
        return self.allocator.num_free - sum(self._prefill_rest(s) for s in running) >= hi - lo

    def map_window(self, seq) -> None:
        """Maps the window of a sequence starting a layer-segmented prefill (it holds no device
        block); its first decode's `map` then extends the same range."""
        if seq.seq_id in self.ranges:
            raise RuntimeError(f"sequence {seq.seq_id} starts a layer-segmented prefill holding device blocks")
        lo, hi = self.window(seq)
        self.ranges[seq.seq_id] = (lo, self.allocator.allocate(hi - lo))
        self.changed.add(seq.seq_id)
        self.segmented.add(seq.seq_id)
        self.steady_until.pop(seq.seq_id, None)

    def take_changed(self) -> set[int]:
        out, self.changed = self.changed, set()
        return out

    def release(self, seq) -> None:
        _, blocks = self.ranges.pop(seq.seq_id, (0, []))
        self.changed.add(seq.seq_id)
        self.segmented.discard(seq.seq_id)
        self.steady_until.pop(seq.seq_id, None)
        self.allocator.free(blocks)


class DeviceRowMap:
    """Device rows of the running sequences' token blocks, which index the dense layers' KV and the
    key metadata (docs/offload.md, "Device rows"): HBM sized by what runs, not by the host store.
    A token block has at most one row, shared by the running sequences that hold it (prefix hits).
    When its last holder pauses or leaves, the row stays with the block, idle, until another block
    needs it (least recently released first); only then are its computed contents saved to the
    block's host row. Mapping a block whose row is idle takes it back as it is; mapping one whose row
    was taken restores its computed contents."""

    def __init__(self, num_rows: int, block_size: int, token_blocks: int) -> None:
        self.allocator = BlockAllocator(num_rows)
        self.block_size = block_size
        self.unbounded = num_rows >= token_blocks  # a row for every token block: never short
        self.row_of: dict[int, int] = {}  # held token block -> row
        self.holders: dict[int, int] = {}  # row -> running sequences holding it
        self.idle: OrderedDict[int, tuple[int, bool]] = OrderedDict()  # token block -> (row, computed contents)
        self.mapped: dict[int, int] = {}  # seq_id -> its leading token blocks that have rows
        self.changes: dict[int, int] = {}  # token block -> row (-1: none) since `take`
        self.saves: list[tuple[int, int]] = []  # (token block, row): row -> the block's host row
        self.restores: list[tuple[int, int]] = []  # (token block, row): the block's host row -> row

    @property
    def num_rows(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_available(self) -> int:
        """Rows free or idle (an idle row is taken, its contents saved, when a block needs it)."""
        return self.allocator.num_free + len(self.idle)

    def _missing(self, seq, hi: int) -> int:
        """Rows mapping its first `hi` token blocks would take (its idle rows and blocks not allocated
        yet count)."""
        table, have = seq.block_table, self.mapped.get(seq.seq_id, 0)
        return sum(1 for j in range(have, hi) if j >= len(table) or table[j] not in self.row_of)

    def can_map(self, seq, n: int) -> bool:
        hi = blocks_needed(seq.num_computed_tokens + n, self.block_size)
        return self.unbounded or self.num_available >= self._missing(seq, hi)

    def can_admit(self, seq, running: list) -> bool:
        """Rows for its whole prompt (and first decode) beside what running prefills still need."""
        if self.unbounded:
            return True
        bs = self.block_size
        reserved = sum(
            max(blocks_needed(s.num_tokens, bs) - self.mapped.get(s.seq_id, 0), 0)
            for s in running
            if s.num_computed_tokens + 1 < s.num_tokens
        )
        return self.num_available - reserved >= self._missing(seq, blocks_needed(seq.num_tokens + 1, bs))

    def _take_row(self) -> int:
        """A free row, else the least recently released idle one (its computed contents saved first,
        or, when a restore into it is still pending this step, that restore dropped: the host row
        holds them)."""
        if self.allocator.num_free:
            return self.allocator.allocate(1)[0]
        tb, (row, computed) = self.idle.popitem(last=False)
        self.changes[tb] = -1
        if (tb, row) in self.restores:
            self.restores.remove((tb, row))
        elif computed:
            self.saves.append((tb, row))
        return row

    def map(self, seq, hi: int) -> None:
        """Rows for its token blocks [mapped, hi) (the blocks must be allocated): held and idle rows
        first, so that taking rows never takes one of its own idle ones."""
        have, computed = self.mapped.get(seq.seq_id, 0), seq.num_computed_tokens
        new = []
        for j in range(have, hi):
            tb = seq.block_table[j]
            row = self.row_of.get(tb)
            if row is None and tb in self.idle:
                row = self.row_of[tb] = self.idle.pop(tb)[0]
                self.holders[row] = 0
            if row is None:
                new.append(j)
            else:
                self.holders[row] += 1
        for j in new:
            tb = seq.block_table[j]
            row = self.row_of[tb] = self._take_row()
            self.holders[row] = 1
            self.changes[tb] = row
            if j * self.block_size < computed:
                self.restores.append((tb, row))
        self.mapped[seq.seq_id] = max(have, hi)

    def release(self, seq) -> None:
        """Its rows; a row's last holder leaves it idle with the block."""
        have, computed = self.mapped.pop(seq.seq_id, 0), seq.num_computed_tokens
        for j in range(have):
            tb = seq.block_table[j]
            row = self.row_of[tb]
            self.holders[row] -= 1
            if self.holders[row]:
                continue
            del self.holders[row], self.row_of[tb]
            self.idle[tb] = (row, j * self.block_size < computed)

    def forget(self, blocks: list[int]) -> None:
        """Token blocks with new owners: their idle rows are free, their contents no one's."""
        for tb in blocks:
            if tb in self.idle:
                row, _ = self.idle.pop(tb)
                self.changes[tb] = -1
                self.allocator.free([row])

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """(row changes, saves, restores) since the last take."""
        out = (list(self.changes.items()), self.saves, self.restores)
        self.changes, self.saves, self.restores = {}, [], []
        return out


class WorkingSetAccounting(Protocol):
    """What pauses and releases tell the working-set estimate (kvcache/working_set.py)."""

    def on_pause(self, seq) -> None: ...
    def forget(self, seq) -> None: ...
    def gauges(self) -> dict[str, float]: ...


class OffloadSpace:
    """The scheduler's device block space under KV offload (its DeviceSpace): `schedule` maps a
    step's blocks and queues restores over computed tokens (never recomputed), `pause` queues the
    tail block's save, `on_allocate` marks blocks stale; `take_plan` hands it all to the step."""

    def __init__(
        self,
        device_map: DeviceBlockMap,
        block_size: int,
        working_set: WorkingSetAccounting | None = None,
        rows: DeviceRowMap | None = None,
    ) -> None:
        self.map = device_map
        self.rows = rows  # the dense layers' and key metadata's device rows (None: one per token block)
        self.block_size = block_size
        self.working_set = working_set
        self._saves: list[tuple[int, int, int]] = []  # (seq_id, host row, device block)
        self._restores: list[tuple[int, int]] = []  # (host row, device block)
        self._stale = StaleBlocks(block_size)

    def can_schedule(self, seq, n: int) -> bool:
        return self.map.can_map(seq, n) and (self.rows is None or self.rows.can_map(seq, n))

    def can_admit(self, seq, running: list) -> bool:
        return self.map.can_admit(seq, running) and (self.rows is None or self.rows.can_admit(seq, running))

    def steady_decode(self, seq) -> bool:
        """A decode that maps, releases and restores nothing."""
        return self.map.steady(seq, 1)

    def schedule(self, seq, n: int) -> None:
        dm = self.map
        if dm.steady(seq, n):
            return
        old_start, old = dm.range_of(seq)
        dm.map(seq, n)
        start, blocks = dm.range_of(seq)
        first = old_start + len(old) if old else start
        computed = blocks_needed(seq.num_computed_tokens, self.block_size)
        for j in range(max(first, start), min(start + len(blocks), computed)):
            self._restores.append((seq.block_table[j], blocks[j - start]))
        if self.rows is not None:
            self.rows.map(seq, start + len(blocks))

    def free(self, seq) -> None:
        self.map.release(seq)
        if self.rows is not None:
            self.rows.release(seq)
        self._saves = [s for s in self._saves if s[0] != seq.seq_id]
        if self.working_set is not None:
            self.working_set.forget(seq)

    def can_admit_segmented(self, seq, running: list) -> bool:
        """Whether a layer-segmented prefill may start (its first decode's window fits)."""
        return self.map.can_admit_window(seq, running) and (self.rows is None or self.rows.can_admit(seq, running))

    def schedule_segmented(self, seq) -> None:
        """Its window's device blocks, filled layer by layer by the prefill (nothing to restore),
        and rows for every block of its prompt (a computed prefix's restored)."""
        self.map.map_window(seq)
        if self.rows is not None:
            self.rows.map(seq, blocks_needed(seq.num_tokens, self.block_size))

    def pause(self, seq) -> None:
        """It keeps its token blocks (the host store holds every full block it computed); its
        partial tail block is saved to its host row before the next step's kernels."""
        c, bs = seq.num_computed_tokens, self.block_size
        start, blocks = self.map.range_of(seq)
        if c % bs and start <= c // bs < start + len(blocks):
            mine = set(blocks)
            self._restores = [(row, dev) for row, dev in self._restores if dev not in mine]
            self._saves.append((seq.seq_id, seq.block_table[c // bs], blocks[c // bs - start]))
        self.map.release(seq)
        if self.rows is not None:
            self.rows.release(seq)
        if self.working_set is not None:
            self.working_set.on_pause(seq)

    def on_allocate(self, blocks: list[int]) -> None:
        self._stale.add(blocks)
        if self.rows is not None:
            self.rows.forget(blocks)

    def take_plan(self, scheduled: list) -> OffloadPlan:
        """The step's work; scheduled: its (sequence, new tokens) pairs (empty: segments only)."""
        bs = self.block_size
        if scheduled:  # the token blocks the step's decodes open (their first token)
            opened = [
                seq.block_table[seq.num_computed_tokens // bs]
                for seq, n in scheduled
                if n == 1 and seq.num_computed_tokens % bs == 0
            ]
            stale = self._stale.take(opened)
        else:
            stale = self._stale.take_pending()
        ranges = self.map.ranges
        plan = OffloadPlan(
            [(row, dev) for _, row, dev in self._saves],
            self._restores,
            {sid: ranges.get(sid) for sid in self.map.take_changed()},
            stale,
        )
        if self.rows is not None:
            plan.rows, plan.row_saves, plan.row_restores = self.rows.take()
        self._saves, self._restores = [], []
        return plan

    def gauges(self) -> dict[str, float]:
        ws = self.working_set.gauges() if self.working_set is not None else {}
        rows = {} if self.rows is None else {"offload_device_rows_used": len(self.rows.holders)}
        return (
            ws
            | rows
            | {"offload_device_blocks": self.map.num_blocks, "offload_device_blocks_used": self.map.allocator.num_used}
        )
