"""Working sets of KV-offloaded requests (docs/working_set.md): the union of the head blocks a
request's selections asked the HBM pool for over the last `window` decode steps, in the pool's unit.

`WorkingSetCounter` (each rank's offload cache): counted on the device inside the step, per
selection-state slot; `publish` starts an async copy of the counts before a step's kernels.
`WorkingSetEstimate` (the scheduler's): each request's estimate from the newest landed copy (one
step late), from the selection budget before a measurement, or a paused request's floor."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from sparseserve.kernels.working_set import TouchState, working_set_begin_step
from sparseserve.kvcache.blocks import blocks_needed
from sparseserve.kvcache.transfer import to_device

REPORT_INTERVAL_S = 0.05  # publish / sum interval with the control off (estimates feed /metrics)


class WorkingSetCounter:
    def __init__(self, *, num_keys: int, num_slots: int, window: int, enabled: bool, device: torch.device) -> None:
        """num_keys: the HBM pool's key space; num_slots: selection-state slots (max_num_seqs)."""
        if window < 1:
            raise ValueError(f"working_set_window must be >= 1, got {window}")
        self.enabled = enabled
        self.stamp = torch.full((num_keys + 1,), -1, dtype=torch.int64, device=device)
        self.hist = torch.zeros(num_slots, window, dtype=torch.int32, device=device)
        self.since = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)
        self.cuda = device.type == "cuda"
        self._pinned = torch.zeros(num_slots, window, dtype=torch.int32, pin_memory=self.cuda)
        self._copied = torch.cuda.Event() if self.cuda else None
        self._stream = torch.cuda.current_stream(device) if self.cuda else None
        self._in_flight = False
        self._published = -math.inf
        self.pending: dict[int, int] = {}  # seq_id -> slot of the copy in flight
        self._landed: list[dict[int, int]] = []  # seq_id -> count (> 0) of copies not yet polled

    def begin_step(self) -> None:
        """Before the first sparse layer's touch of a decode step."""
        working_set_begin_step(self.hist, self.clock)

    def touch_state(self) -> TouchState:
        return TouchState(self.stamp, self.hist, self.since, self.clock)

    def reset_slots(self, slots: list[int]) -> None:
        """Slots handed to new sequences (between steps): their counts start from nothing."""
        if not slots:
            return
        idx = to_device(torch.tensor(slots, dtype=torch.int64), self.hist.device)
        self.hist.index_fill_(0, idx, 0)
        self.since.index_copy_(0, idx, self.clock.expand(len(slots)).contiguous())

    def counts(self) -> torch.Tensor:
        """int64 [num_slots]: each slot's working set now (device)."""
        return self.hist.sum(1, dtype=torch.int64).clamp_min_(0)

    def publish(self, held: dict[int, int]) -> None:
        """Starts copying the counts (the previous step's) to the host, unless the last copy is in
        flight. held: seq_id -> slot of every sequence holding one (kept)."""
        if not self.cuda:
            self._land(self.counts().tolist(), held)
            return
        now = time.perf_counter()
        if not self.enabled and now - self._published < REPORT_INTERVAL_S:
            return
        self._published = now
        if self._in_flight:
            if not self._copied.query():
                return
            self._land(self._pinned.numpy().sum(1, dtype=np.int64).tolist(), self.pending)
        self._pinned.copy_(self.hist, non_blocking=True)
        self._copied.record(self._stream)
        self._in_flight = True
        self.pending = held

    def _land(self, counts: list[int], held: dict[int, int]) -> None:
        self._landed.append({sid: counts[slot] for sid, slot in held.items() if counts[slot] > 0})
        self._in_flight = False
        self.pending = {}

    def poll(self) -> list[dict[int, int]]:
        """The copies landed since the last poll, oldest first (no sync)."""
        if self._in_flight and self._copied.query():
            self._land(self._pinned.numpy().sum(1, dtype=np.int64).tolist(), self.pending)
        out, self._landed = self._landed, []
        return out

    def drop(self, seq_id: int) -> None:
        """A sequence left its slot: a copy in flight or not yet polled does not count for it."""
        self.pending.pop(seq_id, None)
        for landed in self._landed:
            landed.pop(seq_id, None)


GROWTH_SAMPLES = 64  # the growth's running mean weighs about the last this many whole-window counts
# The growth before any request has counted a whole window: above every growth measured (1.2-2.8 lists,
# docs/working_set.md). Too low, the first requests all take shares and are parked when they grow.
GROWTH_PRIOR = 3.0


class WorkingSetEstimate:
    def __init__(
        self,
        source: WorkingSetCounter,
        *,
        window: int,
        capacity: int,
        margin: float,
        enabled: bool,
        lists: int,
        cap: int,
        local: int,
        block_size: int,
    ) -> None:
        """capacity: the pool's head-block slots; lists: sparse layers x KV heads (selections per
        decode row); cap, local: list length and local window in blocks."""
        self.source = source
        self.enabled = enabled
        self.window = window
        self.capacity = capacity
        self.limit = int(capacity * (1.0 - margin))
        self.lists, self.cap, self.local, self.block_size = lists, cap, local, block_size
        self._reported = -math.inf
        self._measured: dict[int, tuple[int, int]] = {}  # seq_id -> (blocks, decode steps counted)
        # a whole window's working set over one step's list, of the requests that counted one (running
        # mean): what a new request's estimate grows to (its first steps see only part of the window);
        # the first sample replaces the prior
        self.growth = min(GROWTH_PRIOR, float(window))
        self._growth_samples = 0
        self._floor: dict[int, int] = {}  # seq_id -> its estimate when it was paused
        # the scheduler's accounting (statistics): running estimates summed, requests the limit
        # keeps waiting, hold-backs so far, parked requests, admissions ahead of the limit so far
        self.total = 0
        self.num_held_back = 0
        self.num_hold_backs = 0
        self.num_parked = 0
        self.num_prefill_aheads = 0

    def estimates(self, seqs: list) -> list[int]:
        """Each sequence's working set in head blocks: measured once it has counted a whole window,
        before that at least its expected one (one step's list times `growth`); a paused one's
        floor until its new slot has counted a whole window again."""
        landed_now: set[int] = set()
        for landed in self.source.poll():
            for sid, count in landed.items():
                self._measured[sid] = (count, self._measured.get(sid, (0, 0))[1] + 1)
                landed_now.add(sid)
        out = []
        for seq in seqs:
            measured, steps = self._measured.get(seq.seq_id, (0, 0))
            floor = self._floor.get(seq.seq_id)
            if steps >= self.window and seq.seq_id in landed_now and self.default(seq) < self.every(seq):
                self._learn(measured, self.default(seq))  # (a context within one list selects it all)
            if floor is not None and steps >= self.window:
                del self._floor[seq.seq_id]
                floor = None
            if steps >= self.window:
                out.append(measured)
            else:
                out.append(max(measured, floor or 0, self.expected(seq)))
        return out

    def _learn(self, measured: int, one_list: int) -> None:
        if one_list <= 0:
            return
        self._growth_samples = min(self._growth_samples + 1, GROWTH_SAMPLES)
        self.growth += (measured / one_list - self.growth) / self._growth_samples

    def default(self, seq) -> int:
        """One step's list entries outside the local window."""
        nb = blocks_needed(seq.num_tokens, self.block_size)
        return max(min(self.cap, nb) - self.local, 0) * self.lists

    def every(self, seq) -> int:
        """Every head block its lists can name: its context's blocks outside the local window."""
        return max(blocks_needed(seq.num_tokens, self.block_size) - self.local, 0) * self.lists

    def expected(self, seq) -> int:
        """Before a whole window is counted: one step's list grown as the measured windows grew, at
        most every head block it has."""
        return min(int(self.default(seq) * self.growth), self.every(seq))

    def due(self) -> bool:
        """Whether the scheduler sums the estimates this step (always with the control, on CPU)."""
        return self.enabled or not self.source.cuda or time.perf_counter() - self._reported >= REPORT_INTERVAL_S

    def record(self, total: int, held: int, new_holds: int) -> None:
        self.total, self.num_held_back = total, held
        self.num_hold_backs += new_holds
        self._reported = time.perf_counter()

    def record_prefill_ahead(self, parked: int, new_ahead: int) -> None:
        self.num_parked = parked
        self.num_prefill_aheads += new_ahead

    def on_pause(self, seq) -> None:
        """It resumes on a new slot, with its current estimate as a floor."""
        self._floor[seq.seq_id] = self.estimates([seq])[0]
        self._measured.pop(seq.seq_id, None)
        self.source.drop(seq.seq_id)

    def forget(self, seq) -> None:
        self._measured.pop(seq.seq_id, None)
        self._floor.pop(seq.seq_id, None)
        self.source.drop(seq.seq_id)

    @property
    def num_tracked(self) -> int:
        """Sequences with a measurement, a floor or a copy in flight (none once all are freed)."""
        return len(self._measured.keys() | self._floor.keys() | self.source.pending.keys())

    def gauges(self) -> dict[str, float]:
        return {
            "working_set_blocks": self.total,
            "working_set_capacity": self.capacity,
            "working_set_limit": self.limit,
            "working_set_held_back": self.num_held_back,
            "working_set_hold_backs": self.num_hold_backs,
            "working_set_parked": self.num_parked,
            "working_set_prefill_aheads": self.num_prefill_aheads,
            "working_set_growth": self.growth,
        }
