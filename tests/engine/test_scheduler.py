"""The scheduler on its own (no model): token budget, FCFS admission, chunked prefill, preemption of the newest
running sequence when blocks run out, and a second block space (the offload cache's device blocks)."""
from __future__ import annotations

from sparseserve.config import SchedulerConfig
from sparseserve.engine.request import Sequence, SequenceStatus
from sparseserve.engine.scheduler import Scheduler
from sparseserve.kvcache.blocks import BlockAllocator
from sparseserve.sampling_params import SamplingParams

BS = 4
NO_RESERVE = dict(init_new_token_ratio=0.0, min_new_token_ratio=0.0)  # admit whatever fits its next chunk now


def seq(i: int, prompt_len: int) -> Sequence:
    return Sequence(i, f"r{i}", 0, list(range(prompt_len)), SamplingParams(max_tokens=8))


def run_step(sched: Scheduler):
    """One schedule, then what the engine does after the model step: tokens computed, one sampled."""
    out = sched.schedule()
    for s, n in out.scheduled:
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(0)
    return out


def test_budget_fcfs_and_chunked_prefill():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), BlockAllocator(64), BS)
    a, b, c = seq(0, 10), seq(1, 20), seq(2, 3)
    for s in (a, b, c):
        sched.add(s)
    out = run_step(sched)
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 10), (1, 6)]  # b's prompt chunked, c waits
    assert list(sched.waiting) == [c] and a.status is b.status is SequenceStatus.RUNNING
    out = run_step(sched)  # a decodes first, b goes on, c gets what is left
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 14), (2, 1)]
    assert len(a.block_table) == 3 and len(b.block_table) == 5 and len(c.block_table) == 1
    sched.finish(a)
    assert a.status is SequenceStatus.FINISHED and a.block_table == []
    assert sched.allocator.num_used == len(b.block_table) + len(c.block_table)
    sched.allocator.check()


def test_preempts_newest_and_requeues_it_first():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, **NO_RESERVE), BlockAllocator(6), BS)
    old, new = seq(0, 12), seq(1, 12)  # 3 full blocks each: the pool is full after both prefill
    sched.add(old)
    sched.add(new)
    run_step(sched)
    assert sched.allocator.num_free == 0
    out = run_step(sched)  # old's 13th token needs a 4th block: the newest sequence gives its blocks back
    assert out.preempted == [new] and [s for s, _ in out.scheduled] == [old]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.block_table == []
    assert sched.waiting[0] is new and sched.num_preemptions == 1
    assert not any(s is new for s, _ in out.scheduled)  # nothing is admitted in a step that preempted
    sched.finish(old)
    out = run_step(sched)  # the victim runs again, recomputing its prompt and its sampled token
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(1, 13)]
    sched.allocator.check()


def test_max_num_seqs_and_prefill_without_chunking():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, enable_chunked_prefill=False),
                      BlockAllocator(64), BS)
    for i, n in enumerate((4, 4, 4)):
        sched.add(seq(i, n))
    out = run_step(sched)
    assert [s.seq_id for s, _ in out.scheduled] == [0, 1] and len(sched.waiting) == 1  # max_num_seqs
    long = seq(9, 7)
    sched.finish(sched.running[0])
    sched.waiting.appendleft(long)
    out = run_step(sched)  # 1 decode + a 7-token prompt = 8: fits whole; a longer one would wait, never split
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(1, 1), (9, 7)]


class DeviceSpace:
    """A device block space of `size` blocks that holds every block of each scheduled sequence."""

    def __init__(self, size: int) -> None:
        self.size, self.held, self.allocated = size, {}, []

    def can_schedule(self, s, n):
        return sum(self.held.values()) - self.held.get(s.seq_id, 0) + -(-(s.num_computed_tokens + n) // BS) <= self.size

    def can_admit(self, s, running):
        return sum(self.held.values()) + -(-s.num_tokens // BS) <= self.size

    def schedule(self, s, n):
        self.held[s.seq_id] = -(-(s.num_computed_tokens + n) // BS)

    def free(self, s):
        self.held.pop(s.seq_id, None)

    def on_allocate(self, blocks):
        self.allocated += blocks


def test_a_second_block_space_limits_admission():
    space = DeviceSpace(5)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockAllocator(64), BS, space)
    a, b = seq(0, 12), seq(1, 12)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)  # token blocks are plenty, the device space holds one prompt only
    assert [s.seq_id for s, _ in out.scheduled] == [0] and list(sched.waiting) == [b]
    assert space.held == {0: 3} and space.allocated == a.block_table  # each new token block reported
    sched.finish(a)
    assert space.held == {}
    out = run_step(sched)
    assert [s.seq_id for s, _ in out.scheduled] == [1] and space.allocated[-3:] == b.block_table
