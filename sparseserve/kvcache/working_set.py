"""Working-set-aware batch control (DESIGN.md principle 7; SparseServe section 3.3): what the scheduler needs to
run a decode batch only while the requests' working sets fit the HBM pool.

A request's working set is the union of the head blocks its selections asked the HBM pool for over the last
`window` decode steps (its list entries outside the local window, every sparse layer and KV head): the
pool's own unit, one slot per head block, so the sum over the running requests compares with the pool's slots.

Counted on the device inside the step (kernels/working_set.py; on the GPU within the pool's read of each sparse
layer; capturable), per selection-state slot. `publish` (the sparse backend, before each step's kernels) copies
the per-slot counts into pinned memory without a sync, with the slot -> sequence map of that moment; the
scheduler reads the newest copy that has landed (`estimates`): one step late on a busy GPU, exactly one step
late on CPU. With the control off the estimates only feed /metrics: on the GPU they are then published and
summed at most every REPORT_INTERVAL_S.

A request not measured yet (never decoded, or every count zero so far) is estimated from the selection budget:
its list entries outside the local window, min(budget blocks, context blocks) - local blocks, times sparse
layers x KV heads. A paused request (held back or preempted) keeps the estimate it had when it stopped as a
floor until its new slot has counted `window` decode steps again (its union starts from nothing on a new slot).
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from sparseserve.kernels.working_set import TouchState, working_set_begin_step
from sparseserve.kvcache.blocks import blocks_needed
from sparseserve.kvcache.staging import to_device

REPORT_INTERVAL_S = 0.05


class WorkingSet:
    def __init__(self, *, num_keys: int, num_slots: int, window: int, capacity: int, margin: float, enabled: bool,
                 lists: int, cap: int, local: int, block_size: int, device: torch.device) -> None:
        """num_keys: the HBM pool's key space (kvcache/pool.py); num_slots: selection-state slots (max_num_seqs);
        capacity: the pool's head-block slots; lists: sparse layers x KV heads (selections per decode row);
        cap, local: list length and local window in blocks."""
        if window < 1:
            raise ValueError(f"working_set_window must be >= 1, got {window}")
        self.enabled = enabled
        self.window = window
        self.capacity = capacity
        self.limit = int(capacity * (1.0 - margin))
        self.lists, self.cap, self.local, self.block_size = lists, cap, local, block_size
        self.stamp = torch.full((num_keys + 1,), -1, dtype=torch.int64, device=device)
        self.hist = torch.zeros(num_slots, window, dtype=torch.int32, device=device)
        self.since = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)
        self._cuda = device.type == "cuda"
        # The counts cross to the host as the whole history (a few KiB) and are summed there: one copy a step and
        # no reduction launch (a step's host time is counted in microseconds).
        self._pinned = torch.zeros(num_slots, window, dtype=torch.int32, pin_memory=self._cuda)
        # One event and the stream it records on, made once: a step's host time is counted in microseconds.
        self._copied = torch.cuda.Event() if self._cuda else None
        self._stream = torch.cuda.current_stream(device) if self._cuda else None
        self._in_flight = False
        # With the control off the estimates only feed /metrics: on the GPU they are published and summed at most
        # every REPORT_INTERVAL_S instead of every step (tens of microseconds of a fast step's host time).
        self._published = self._reported = -math.inf
        self._pending: dict[int, int] = {}  # seq_id -> slot of the copy in flight
        self._measured: dict[int, tuple[int, int]] = {}  # seq_id -> (blocks, decode steps counted on its slot)
        self._floor: dict[int, int] = {}  # seq_id -> the estimate it had when it was paused
        # The scheduler's accounting (kept here so the statistics have one place): the running requests'
        # estimates summed, requests waiting because the limit stopped the batch, hold-backs so far.
        self.total = 0
        self.num_held_back = 0
        self.num_hold_backs = 0
        self.num_parked = 0         # prefill ahead: prefilled requests waiting for a decode share
        self.num_prefill_aheads = 0  # ... admissions for prefill beyond the limit so far

    # ---- the device, inside the step (sparse backend) ------------------------------------------------------

    def begin_step(self) -> None:
        """Before the first sparse layer's touch of a decode step."""
        working_set_begin_step(self.hist, self.clock)

    def touch_state(self) -> TouchState:
        """The count's device state, for the pool's read to touch the keys it computes (kvcache/pool.py)."""
        return TouchState(self.stamp, self.hist, self.since, self.clock)

    def reset_slots(self, slots: list[int]) -> None:
        """Slots handed to new sequences (between steps): their counts start from nothing."""
        if not slots:
            return
        idx = to_device(torch.tensor(slots, dtype=torch.int64), self.hist.device)
        self.hist.index_fill_(0, idx, 0)
        self.since.index_copy_(0, idx, self.clock.expand(len(slots)).contiguous())  # on the device: no sync

    def counts(self) -> torch.Tensor:
        """int64 [num_slots]: each slot's working set now (device)."""
        return self.hist.sum(1, dtype=torch.int64).clamp_min_(0)

    def publish(self, held: dict[int, int]) -> None:
        """Starts copying the counts to the host (before a step's kernels: they are the previous step's), unless
        the previous copy is still in flight. held: seq_id -> slot of every sequence holding one (kept: the
        caller hands over a dict of its own)."""
        if not self._cuda:
            self._land(self.counts().tolist(), held)
            return
        now = time.perf_counter()
        if not self.enabled and now - self._published < REPORT_INTERVAL_S:
            return
        self._published = now
        if self._in_flight:
            if not self._copied.query():
                return
            self._land(self._landed(), self._pending)
        self._pinned.copy_(self.hist, non_blocking=True)
        self._copied.record(self._stream)
        self._in_flight = True
        self._pending = held

    def _landed(self) -> list[int]:
        """Each slot's count from the copy that landed (no clamp: _land ignores counts <= 0)."""
        return self._pinned.numpy().sum(1, dtype=np.int64).tolist()

    def _land(self, counts: list[int], held: dict[int, int]) -> None:
        for sid, slot in held.items():
            if counts[slot] > 0:
                _, steps = self._measured.get(sid, (0, 0))
                self._measured[sid] = (counts[slot], steps + 1)
        self._in_flight = False
        self._pending = {}

    # ---- the scheduler ------------------------------------------------------------------------------------

    def estimates(self, seqs: list) -> list[int]:
        """Each sequence's working set in head blocks: measured (the newest landed copy), else from the budget;
        a paused one's floor until its new slot has counted a whole window."""
        if self._in_flight and self._copied.query():
            self._land(self._landed(), self._pending)
        out = []
        for seq in seqs:
            measured, steps = self._measured.get(seq.seq_id, (0, 0))
            floor = self._floor.get(seq.seq_id)
            if floor is None:
                out.append(measured if steps else self.default(seq))
            elif steps >= self.window:
                del self._floor[seq.seq_id]
                out.append(measured)
            else:
                out.append(max(measured, floor))
        return out

    def default(self, seq) -> int:
        """The estimate of a request not measured yet: one step's list entries outside the local window."""
        nb = blocks_needed(seq.num_tokens, self.block_size)
        return max(min(self.cap, nb) - self.local, 0) * self.lists

    def due(self) -> bool:
        """Whether the scheduler sums the running estimates this step: every step under the control (or on CPU),
        else at most every REPORT_INTERVAL_S (`record` then only updates the gauge)."""
        return self.enabled or not self._cuda or time.perf_counter() - self._reported >= REPORT_INTERVAL_S

    def record(self, total: int, held: int, new_holds: int) -> None:
        """The scheduler's step: running estimates summed, requests the limit keeps waiting, new hold-backs."""
        self.total, self.num_held_back = total, held
        self.num_hold_backs += new_holds
        self._reported = time.perf_counter()

    def record_prefill_ahead(self, parked: int, new_ahead: int) -> None:
        """Prefill ahead (engine/scheduler.py): requests parked now, new admissions ahead of the limit."""
        self.num_parked = parked
        self.num_prefill_aheads += new_ahead

    # ---- sequences leaving the device (the offload cache's pause and free) -------------------------------

    def on_pause(self, seq) -> None:
        """Its slot is released: it resumes on a new one, with its current estimate as a floor."""
        self._floor[seq.seq_id] = self.estimates([seq])[0]
        self._measured.pop(seq.seq_id, None)
        self._pending.pop(seq.seq_id, None)

    def forget(self, seq) -> None:
        for d in (self._measured, self._floor, self._pending):
            d.pop(seq.seq_id, None)

    @property
    def num_tracked(self) -> int:
        """Sequences with a measurement, a floor or a copy in flight (accounting: none once all are freed)."""
        return len(self._measured.keys() | self._floor.keys() | self._pending.keys())

    def gauges(self) -> dict[str, int]:
        return {"working_set_blocks": self.total, "working_set_capacity": self.capacity,
                "working_set_limit": self.limit, "working_set_held_back": self.num_held_back,
                "working_set_hold_backs": self.num_hold_backs, "working_set_parked": self.num_parked,
                "working_set_prefill_aheads": self.num_prefill_aheads}
