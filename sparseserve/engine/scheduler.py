"""Continuous batching: FCFS, chunked prefill mixed with decode under a per-step token budget,
preemption by recompute when KV blocks run out (the scheduler owns memory: out of blocks is a
scheduling event, never a crash).

With kv_offload there are two block spaces: token blocks (host store rows, the allocator) and device
blocks (the device KV cache, DeviceBlockMap), which hold only the working set: every block of a
prefilling sequence, the local window of a decoding one. A step is scheduled only if both fit; a
waiting sequence that does not fit waits, a running one preempts the newest running sequences."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sparseserve.config import SchedulerConfig
from sparseserve.engine.request import Sequence, SequenceStatus
from sparseserve.kvcache.blocks import BlockAllocator, DeviceBlockMap, blocks_needed


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int,
                 device_map: DeviceBlockMap | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.device_map = device_map  # kv_offload: the device KV cache's blocks
        self.block_size = block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.on_free: Callable[[list[int]], None] | None = None  # kv_offload: drop freed blocks' HBM slots

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
            if not self._can_grow(seq, n) or (self.device_map is not None
                                              and not self.device_map.can_admit(seq, self.running)):
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
        return self.allocator.can_allocate(max(need, 0)) and (self.device_map is None
                                                               or self.device_map.can_map(seq, n))

    def _grow(self, seq: Sequence, n: int) -> None:
        need = blocks_needed(seq.num_computed_tokens + n, self.block_size) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.allocator.allocate(need))
        if self.device_map is not None:
            self.device_map.map(seq, n)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, requeue at the front; its tokens so far are its new prompt."""
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        if self.device_map is not None:
            self.device_map.release(seq)
        blocks = seq.release_blocks()
        self.allocator.free(blocks)
        if self.on_free is not None:
            self.on_free(blocks)

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence wherever it is and returns its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
