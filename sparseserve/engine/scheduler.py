"""Continuous batching: FCFS, chunked prefill mixed with decode under a per-step token budget,
preemption by recompute when KV blocks run out (the scheduler owns memory: out of blocks is a
scheduling event, never a crash).

Under KV offload there is a second block space (`device_space`, kvcache/offload.py OffloadCache): token
blocks (the allocator) are host store rows, and the device block cache holds only the working set: every
block of a prefilling sequence, the local window of a decoding one. A step is scheduled only if both fit;
a waiting sequence that does not fit waits, a running one preempts the newest running sequences."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from sparseserve.config import SchedulerConfig
from sparseserve.engine.request import Sequence, SequenceStatus
from sparseserve.kvcache.blocks import BlockAllocator, blocks_needed


class DeviceSpace(Protocol):
    """A second, smaller block space a step must also fit (the offload cache's device block cache)."""

    def can_schedule(self, seq: Sequence, n: int) -> bool: ...
    def can_admit(self, seq: Sequence, running: list[Sequence]) -> bool: ...
    def schedule(self, seq: Sequence, n: int) -> None: ...
    def free(self, seq: Sequence) -> None: ...
    def on_allocate(self, blocks: list[int]) -> None: ...


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int,
                 device_space: DeviceSpace | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.device_space = device_space
        self.block_size = block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Running sequences first, oldest first; the newest are preempted when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self._can_grow(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._grow(seq, n)
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
        # Admit waiting sequences while budget, batch slots and blocks allow (not after a preemption:
        # admitting would only evict again).
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            n = min(remaining, budget)
            if not self._can_grow(seq, n) or (self.device_space is not None
                                              and not self.device_space.can_admit(seq, self.running)):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._grow(seq, n)
            out.scheduled.append((seq, n))
            budget -= n
        return out

    def _can_grow(self, seq: Sequence, n: int) -> bool:
        need = blocks_needed(seq.num_computed_tokens + n, self.block_size) - len(seq.block_table)
        return self.allocator.can_allocate(max(need, 0)) and (self.device_space is None
                                                               or self.device_space.can_schedule(seq, n))

    def _grow(self, seq: Sequence, n: int) -> None:
        need = blocks_needed(seq.num_computed_tokens + n, self.block_size) - len(seq.block_table)
        if need > 0:
            blocks = self.allocator.allocate(need)
            seq.block_table.extend(blocks)
            if self.device_space is not None:
                self.device_space.on_allocate(blocks)
        if self.device_space is not None:
            self.device_space.schedule(seq, n)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, requeue at the front; its tokens so far are its new prompt."""
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        if self.device_space is not None:
            self.device_space.free(seq)
        self.allocator.free(seq.release_blocks())

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence wherever it is and returns its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
