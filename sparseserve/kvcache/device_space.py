"""KV offload, the scheduler's side (docs/offload.md): which token blocks of each sequence sit in
the sparse layers' device block cache, pauses, restores and blocks with new owners, emitted once
a step as an OffloadPlan that every rank's OffloadCache executes (kvcache/offload.py). Plain
Python: no tensor is touched here."""
from __future__ import annotations

from typing import Protocol

from sparseserve.kvcache.blocks import BlockAllocator, blocks_needed
from sparseserve.kvcache.offload_plan import OffloadPlan


class StaleBlocks:
    """Token blocks handed to new owners (`OffloadSpace.on_allocate`): the HBM pool must not serve their previous
    contents, so they leave it (one kernel launch, before the step's kernels) before any selection can list
    them. A step's launch costs host time, and at a large decode batch some decode opens a block nearly every
    step; a block a decode opened holds one token, so a selection can list it (full) block_size - 1 decode steps
    later at the earliest: it waits for the next launch, at most block_size - 2 steps. Any other block (a
    prefill's: listed by the next step) leaves with its own step and takes the waiting ones along."""

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
    """The device block cache's rows and which token blocks of each sequence they hold.

    A sequence maps a contiguous range of its token blocks [start, start + len(blocks)) to device blocks:
      - a step that prefills (more than one new token, or one token that is not the last one to compute)
        needs every block of the sequence: dense prefill attention reads all earlier blocks;
      - a decode (the one token left) needs the local window only (the last `local_blocks` blocks, tail
        included): the sparse kernel reads every other listed block through the HBM pool or the host store.
    Blocks leaving that range are released when the step is scheduled. The range only moves forward (a
    sequence never prefills after decoding unless preempted, which releases everything), so no block is
    ever loaded back into the device cache.

    Why releasing at scheduling time is safe: a released block left the window, so it is full and was
    written in an earlier step; the runner fences the host store before it launches a step's kernels
    (every write-through of earlier steps is in the store), and the step reads the block through the pool /
    host row only, so a new owner may overwrite the device block in that same step."""

    def __init__(self, num_blocks: int, local_blocks: int, block_size: int, token_blocks: int) -> None:
        self.allocator = BlockAllocator(num_blocks)
        self.token_blocks = token_blocks
        self.local_blocks = local_blocks
        self.block_size = block_size
        self.ranges: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (start, device blocks)
        # Sequences in layer-segmented prefill: they hold only their first decode's window (map_window).
        self.segmented: set[int] = set()
        # seq_id -> the end of the token block its last decode's `map` wrote into: decodes of tokens before it
        # keep the same window (a decoding sequence never prefills again without releasing its range first)
        self.steady_until: dict[int, int] = {}
        self.changed: set[int] = set()  # seq_ids whose range changed since `take_changed` (the step's tables)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def range_of(self, seq) -> tuple[int, list[int]]:
        return self.ranges.get(seq.seq_id, (0, []))

    def hot_range(self, seq, n: int) -> tuple[int, int]:
        """Token-block indices [lo, hi) that must be on the device for a step computing n new tokens."""
        c = seq.num_computed_tokens
        hi = blocks_needed(c + n, self.block_size)
        decode = n == 1 and c + 1 == seq.num_tokens
        return (max(hi - self.local_blocks, 0) if decode else 0), hi

    def num_to_allocate(self, seq, n: int) -> int:
        """Device blocks this step takes from the free list, net of what the sequence itself releases."""
        lo, hi = self.hot_range(seq, n)
        start, blocks = self.range_of(seq)
        held = len(blocks)
        missing = hi - max(lo, start + held) if held else hi - lo
        releasable = min(max(lo - start, 0), held)
        return missing - releasable

    def steady(self, seq, n: int) -> bool:
        """A decode whose mapped range is its window already (block_size - 1 of every block_size decode steps):
        the step maps, releases and restores nothing. The scheduler asks this of every running sequence every
        step, so it is one lookup (`steady_until`, set by a decode's `map`) before `hot_range`'s general test."""
        return n == 1 and seq.num_computed_tokens < self.steady_until.get(seq.seq_id, 0)

    def can_map(self, seq, n: int) -> bool:
        return self.steady(seq, n) or self.allocator.can_allocate(max(self.num_to_allocate(seq, n), 0))

    def can_admit(self, seq, running: list) -> bool:
        """Whether a waiting sequence may start: the device blocks its whole prefill will need (a paused
        sequence that was decoding: its window) fit next to what the running prefills still need (admitting a
        prompt whose later chunks cannot get their blocks would only preempt it again). Always true when the
        device space is as large as the token space."""
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
        """Releases the sequence's device blocks before the step's range and maps the blocks it adds.
        Returns the released device blocks (already back on the free list)."""
        lo, hi = self.hot_range(seq, n)
        start, blocks = self.range_of(seq)
        if not blocks:
            start = lo
        if lo < start:
            raise RuntimeError(f"sequence {seq.seq_id} needs token block {lo} on the device again after "
                               f"releasing it (device range starts at {start})")
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
        if n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens:  # a decode: its range is [lo, hi) now
            self.steady_until[seq.seq_id] = hi * self.block_size
        else:
            self.steady_until.pop(seq.seq_id, None)
        return released

    def window(self, seq) -> tuple[int, int]:
        """Token-block indices [lo, hi) of the prompt's blocks in its first decode's local window (the prompt's
        tail block included): what a layer-segmented prefill leaves on the device (engine/layer_prefill.py)."""
        p, bs = seq.num_tokens, self.block_size
        return max(blocks_needed(p + 1, bs) - self.local_blocks, 0), blocks_needed(p, bs)

    def can_admit_window(self, seq, running: list) -> bool:
        """Whether a layer-segmented prefill may start: its window fits next to what running prefills still need."""
        lo, hi = self.window(seq)
        return self.allocator.num_free - sum(self._prefill_rest(s) for s in running) >= hi - lo

    def map_window(self, seq) -> None:
        """Maps the window of a sequence starting a layer-segmented prefill (it holds no device block); its
        first decode's `map` then extends the same range."""
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


class WorkingSetAccounting(Protocol):
    """What pauses and releases tell the working-set estimate (kvcache/working_set.py)."""

    def on_pause(self, seq) -> None: ...
    def forget(self, seq) -> None: ...
    def gauges(self) -> dict[str, int]: ...


class OffloadSpace:
    """The scheduler's device block space under KV offload (engine/scheduler/kv_cache.py DeviceSpace).

    A step fits if its device blocks do (`can_schedule`, `can_admit`); `schedule` maps them and
    queues restores of blocks mapped over computed tokens (a prefix-cache hit, a resumed
    sequence: never recomputed); `pause` queues the save of the partial tail block, not yet
    written through, and releases the device blocks; `on_allocate` marks token blocks with new
    owners stale in the pool. `take_plan` hands the queued work to the step."""

    def __init__(self, device_map: DeviceBlockMap, block_size: int,
                 working_set: WorkingSetAccounting | None = None) -> None:
        self.map = device_map
        self.block_size = block_size
        self.working_set = working_set
        self._saves: list[tuple[int, int, int]] = []  # (seq_id, host row, device block)
        self._restores: list[tuple[int, int]] = []  # (host row, device block)
        self._stale = StaleBlocks(block_size)

    def can_schedule(self, seq, n: int) -> bool:
        return self.map.can_map(seq, n)

    def can_admit(self, seq, running: list) -> bool:
        return self.map.can_admit(seq, running)

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

    def free(self, seq) -> None:
        self.map.release(seq)
        self._saves = [s for s in self._saves if s[0] != seq.seq_id]
        if self.working_set is not None:
            self.working_set.forget(seq)

    def can_admit_segmented(self, seq, running: list) -> bool:
        """Whether a layer-segmented prefill may start (its first decode's window fits)."""
        return self.map.can_admit_window(seq, running)

    def schedule_segmented(self, seq) -> None:
        """Its window's device blocks, filled layer by layer by the prefill (nothing to restore)."""
        self.map.map_window(seq)

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
        if self.working_set is not None:
            self.working_set.on_pause(seq)

    def on_allocate(self, blocks: list[int]) -> None:
        self._stale.add(blocks)

    def take_plan(self, scheduled: list) -> OffloadPlan:
        """The step's work; scheduled: its (sequence, new tokens) pairs (empty: segments only)."""
        bs = self.block_size
        if scheduled:  # the token blocks the step's decodes open (their first token)
            opened = [seq.block_table[seq.num_computed_tokens // bs] for seq, n in scheduled
                      if n == 1 and seq.num_computed_tokens % bs == 0]
            stale = self._stale.take(opened)
        else:
            stale = self._stale.take_pending()
        ranges = self.map.ranges
        plan = OffloadPlan([(row, dev) for _, row, dev in self._saves], self._restores,
                           {sid: ranges.get(sid) for sid in self.map.take_changed()}, stale)
        self._saves, self._restores = [], []
        return plan

    def gauges(self) -> dict[str, int]:
        ws = self.working_set.gauges() if self.working_set is not None else {}
        return ws | {"offload_device_blocks": self.map.num_blocks,
                     "offload_device_blocks_used": self.map.allocator.num_used}
