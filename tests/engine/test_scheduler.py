"""The scheduler on its own (no model): token budget, FCFS admission, chunked prefill, preemption of the newest
running sequence when blocks run out, a second block space (the offload cache's device blocks), prefix-cache
hits on admission, the admission estimate that leaves room to grow, and preemption that keeps the work."""

from __future__ import annotations

import random

from sparseserve.config import SchedulerConfig
from sparseserve.engine.request import Sequence, SequenceStatus
from sparseserve.engine.scheduler import KVCacheManager, Scheduler
from sparseserve.kvcache.blocks import BlockAllocator
from sparseserve.kvcache.device_space import DeviceBlockMap
from sparseserve.sampling_params import SamplingParams
from tests.engine.sched_utils import left, make_scheduler

BS = 4
NO_RESERVE = dict(init_new_token_ratio=0.0, min_new_token_ratio=0.0)  # admit whatever fits its next chunk now


def seq(i: int, prompt_len: int) -> Sequence:
    return Sequence(i, f"r{i}", 0, list(range(prompt_len)), SamplingParams(max_tokens=8))


def run_step(sched: Scheduler):
    """One schedule, then what the engine does after the model step: tokens computed (the blocks they fill
    offered to the prefix cache), one sampled."""
    out = sched.schedule()
    for s, n in out.scheduled:
        s.num_computed_tokens += n
        sched.kv.cache_full_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(0)
    return out


def test_budget_fcfs_and_chunked_prefill():
    sched = make_scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), BlockAllocator(64), BS)
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
    assert sched.kv.allocator.num_used == len(b.block_table) + len(c.block_table)
    sched.kv.allocator.check()


def test_preempts_newest_and_requeues_it_first():
    sched = make_scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, **NO_RESERVE), BlockAllocator(6), BS
    )
    old, new = seq(0, 12), seq(1, 12)  # 3 full blocks each: the pool is full after both prefill
    sched.add(old)
    sched.add(new)
    run_step(sched)
    assert sched.kv.allocator.num_free == 0
    out = run_step(sched)  # old's 13th token needs a 4th block: the newest sequence gives its blocks back
    assert left(out) == [new] and [s for s, _ in out.scheduled] == [old]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.block_table == []
    assert sched.waiting[0] is new and sched.num_preemptions == 1
    assert not any(s is new for s, _ in out.scheduled)  # nothing is admitted in a step that preempted
    sched.finish(old)
    out = run_step(sched)  # the victim runs again, recomputing its prompt and its sampled token
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(1, 13)]
    sched.kv.allocator.check()


def test_max_num_seqs_and_prefill_without_chunking():
    sched = make_scheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, enable_chunked_prefill=False), BlockAllocator(64), BS
    )
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
        self.size, self.held, self.allocated, self.paused = size, {}, [], []

    def can_schedule(self, s, n):
        return sum(self.held.values()) - self.held.get(s.seq_id, 0) + -(-(s.num_computed_tokens + n) // BS) <= self.size

    def can_admit(self, s, running):
        return sum(self.held.values()) + -(-s.num_tokens // BS) <= self.size

    def steady_decode(self, s):
        return self.held.get(s.seq_id) == -(-(s.num_computed_tokens + 1) // BS)

    def schedule(self, s, n):
        self.held[s.seq_id] = -(-(s.num_computed_tokens + n) // BS)

    def free(self, s):
        self.held.pop(s.seq_id, None)

    def pause(self, s):
        self.held.pop(s.seq_id, None)
        self.paused.append(s.seq_id)

    def on_allocate(self, blocks):
        self.allocated += blocks

    def take_plan(self, scheduled):
        return None


def test_a_second_block_space_limits_admission():
    space = DeviceSpace(5)
    sched = make_scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockAllocator(64), BS, space)
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


def seq_of(i: int, prompt: list[int], max_tokens: int = 8) -> Sequence:
    return Sequence(i, f"r{i}", 0, list(prompt), SamplingParams(max_tokens=max_tokens))


def test_admission_takes_the_cached_prefix():
    """A finished request's full blocks stay cached: a repeat shares them by reference and computes only the
    rest, at least its last token (min_chunk 1) or two (min_chunk 2, a sparse policy)."""
    alloc = BlockAllocator(16, enable_caching=True)
    sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=64, **NO_RESERVE), alloc, BS)
    prompt = list(range(100, 112))  # 3 full blocks
    a = seq_of(0, prompt)
    sched.add(a)
    run_step(sched)
    table = list(a.block_table)
    sched.finish(a)
    assert alloc.num_evictable == 3 and alloc.num_used == 0
    b = seq_of(1, prompt)
    sched.add(b)
    out = run_step(sched)
    assert out.scheduled == [(b, 4)] and b.block_table[:2] == table[:2]  # the last block is recomputed
    assert b.num_cached_tokens == 8 and sched.kv.prefix_stats.hits == 8 and sched.kv.prefix_stats.queries == 24
    c = seq_of(2, prompt + [5])  # shares all 3 blocks with b's (b's third block is a duplicate, uncached)
    sched.add(c)
    out = run_step(sched)
    assert out.scheduled == [(b, 1), (c, 1)] and c.block_table[:3] == table and alloc.ref_count(table[0]) == 2
    salted = seq_of(3, prompt + [5])
    salted.cache_salt = "other tenant"
    sched.add(salted)
    run_step(sched)
    assert salted.num_cached_tokens == 0 and not set(salted.block_table) & set(table)
    alloc.check()
    two = make_scheduler(SchedulerConfig(max_num_batched_tokens=64, **NO_RESERVE), alloc, BS, min_chunk=2)
    d = seq_of(4, prompt + [5])
    two.add(d)
    out = run_step(two)
    assert out.scheduled == [(d, 5)] and d.num_cached_tokens == 8  # a block and a token


def test_min_chunk_never_leaves_a_lone_prompt_token():
    sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=8, **NO_RESERVE), BlockAllocator(64), BS, min_chunk=2)
    a, b = seq_of(0, range(9)), seq_of(1, range(3))
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert out.scheduled == [(a, 7)]  # 8 would leave 1; b's 3 tokens cannot split into chunks of >= 2 in 1
    out = run_step(sched)
    assert out.scheduled == [(a, 2), (b, 3)]
    out = run_step(sched)
    assert out.scheduled == [(a, 1), (b, 1)]  # decodes run alone
    tiny = make_scheduler(SchedulerConfig(max_num_batched_tokens=1, **NO_RESERVE), BlockAllocator(64), BS, min_chunk=2)
    c = seq_of(2, range(3))
    tiny.add(c)
    assert run_step(tiny).scheduled == [(c, 1)]  # a step budget of 1: better a lone token than never


def test_admission_leaves_room_for_the_running_batch_to_grow():
    """Each running request is expected to still produce new_token_ratio of its remaining max_tokens: a
    request whose prompt fits now but would leave too little is not admitted (with the rule off it is, and
    the batch then preempts)."""
    cfg = dict(max_num_batched_tokens=64, init_new_token_ratio=0.5, min_new_token_ratio=0.5)
    sched = make_scheduler(SchedulerConfig(**cfg), BlockAllocator(12), BS)
    a, b = seq_of(0, range(8), max_tokens=40), seq_of(1, range(50, 58), max_tokens=40)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    # a: 8 prompt + 20 expected = 7 blocks; b would need 7 of the 12 - 7 = 5 left: waits
    assert [s for s, _ in out.scheduled] == [a] and list(sched.waiting) == [b]
    for _ in range(4):
        run_step(sched)
    assert list(sched.waiting) == [b] and sched.num_preemptions == 0
    sched.finish(a)
    assert [s for s, _ in run_step(sched).scheduled] == [b]
    greedy = make_scheduler(SchedulerConfig(max_num_batched_tokens=64, **NO_RESERVE), BlockAllocator(12), BS)
    a, b = seq_of(0, range(8), max_tokens=40), seq_of(1, range(50, 58), max_tokens=40)
    greedy.add(a)
    greedy.add(b)
    assert len(run_step(greedy).scheduled) == 2
    while not greedy.num_preemptions:
        run_step(greedy)


def test_new_token_ratio_decays_and_rises_at_preemption():
    cfg = SchedulerConfig(
        max_num_batched_tokens=64, init_new_token_ratio=0.6, min_new_token_ratio=0.2, new_token_ratio_decay_steps=4
    )
    sched = make_scheduler(cfg, BlockAllocator(6), BS)
    old, new = seq_of(0, range(12), max_tokens=1000), seq_of(1, range(20, 32), max_tokens=1000)
    sched.add(old)
    run_step(sched)
    assert abs(sched.kv.new_token_ratio - 0.5) < 1e-9  # (0.6 - 0.2) / 4 a step with requests running
    sched.running.append(new)  # force a second resident (as the rule-off admission would)
    new.status = SequenceStatus.RUNNING
    new.block_table = sched.kv.allocator.allocate(3)
    new.num_computed_tokens = 12
    new.token_ids.append(0)
    out = run_step(sched)
    assert left(out) == [new] and abs(sched.kv.new_token_ratio - 0.75) < 1e-9  # halfway to 1
    for _ in range(10):
        run_step(sched)
    assert sched.kv.new_token_ratio == 0.2


def test_preempted_blocks_stay_cached_and_are_taken_back():
    """A recompute victim's full blocks stay in the prefix cache (parked tail first, so growth evicts its tail
    before its head); re-admitted, it takes back what survived and recomputes only the rest."""
    alloc = BlockAllocator(6, enable_caching=True)
    sched = make_scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, **NO_RESERVE), alloc, BS)
    old, new = seq_of(0, range(12)), seq_of(1, range(50, 62))
    sched.add(old)
    sched.add(new)
    run_step(sched)
    kept = list(new.block_table)
    out = run_step(sched)  # old needs a 4th block: new is preempted, its 3 blocks parked, its tail evicted
    assert left(out) == [new] and new.block_table == [] and new.num_computed_tokens == 0
    assert alloc.num_evictable == 2 and alloc.lookup(new.block_hashes) == kept[:2]
    sched.finish(old)
    out = run_step(sched)
    assert out.scheduled == [(new, 13 - 8)] and new.block_table[:2] == kept[:2]  # 8 of its 13 tokens kept
    assert new.num_cached_tokens == 0  # statistics count first admissions only
    alloc.check()


def test_device_space_shortage_pauses_and_token_shortage_drops_the_pause():
    """Only the device space is short: the victim is paused (keeps its token blocks and computed tokens,
    resumes without recompute). Token blocks short: a paused sequence gives its blocks back first (its full
    blocks stay cached), before any running sequence is preempted."""
    for tokens in (16, 8):
        space = DeviceSpace(7)
        alloc = BlockAllocator(tokens, enable_caching=True)
        sched = make_scheduler(
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, **NO_RESERVE), alloc, BS, space
        )
        a, b = seq_of(0, range(12), max_tokens=20), seq_of(1, range(50, 62), max_tokens=20)
        sched.add(a)
        sched.add(b)
        assert len(run_step(sched).scheduled) == 2  # 3 + 3 device blocks
        out = run_step(sched)  # a's 13th token: 4 device blocks; b's would make 8 > 7: b pauses
        assert left(out) == [b] and space.paused == [1] and sched.waiting[0] is b
        assert len(b.block_table) == 3 and b.num_computed_tokens == 12 == b.num_tokens - 1  # nothing to redo
        if tokens == 16:
            sched.finish(a)
            assert run_step(sched).scheduled == [(b, 1)]  # resumes with a decode, no prefill
            assert sched.num_preemptions == 1
        else:
            while b.block_table:  # a grows; at its 6th token block none is free: b's blocks are taken back
                assert [s for s, _ in run_step(sched).scheduled] == [a]
            assert b.num_computed_tokens == 0 and len(a.block_table) == 6 and sched.num_preemptions == 1
            assert alloc.num_used == 6 and not sched.running[1:]
        alloc.check()


class WindowSpace:
    """The offload cache's device block space (DeviceBlockMap: whole prefills, decode windows) without tensors."""

    def __init__(self, size: int, token_blocks: int) -> None:
        self.map = DeviceBlockMap(size, local_blocks=2, block_size=BS, token_blocks=token_blocks)

    def can_schedule(self, s, n):
        return self.map.can_map(s, n)

    def can_admit(self, s, running):
        return self.map.can_admit(s, running)

    def steady_decode(self, s):
        return self.map.steady(s, 1)

    def schedule(self, s, n):
        self.map.map(s, n)

    def free(self, s):
        self.map.release(s)

    def pause(self, s):
        self.map.release(s)

    def on_allocate(self, blocks):
        pass

    def take_plan(self, scheduled):
        return None


class GeneralPath(KVCacheManager):
    """Every running sequence through the general path (chunk, block and device-space checks, grow)."""

    def steady_decode(self, seq):
        return False


def test_steady_decode_fast_path_decides_as_the_general_path():
    """Over a random workload that fills both block spaces (preemptions, pauses, admissions, finishes), the
    fast path for steady decodes schedules, maps and preempts exactly as the general path."""
    for seed in range(4):
        rng = random.Random(seed)
        scheds = [
            make_scheduler(
                SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, **NO_RESERVE),
                BlockAllocator(24),
                BS,
                WindowSpace(12, 24),
                min_chunk=2,
                kv_cls=cls,
            )
            for cls in (KVCacheManager, GeneralPath)
        ]
        seqs = [{}, {}]
        fast_rows = 0
        for step in range(150):
            if rng.random() < 0.3:
                prompt, out_len = [rng.randrange(100) for _ in range(rng.randint(2, 30))], rng.randint(1, 30)
                for k, sched in enumerate(scheds):
                    s = Sequence(step, f"r{step}", 0, list(prompt), SamplingParams(max_tokens=out_len))
                    seqs[k][step] = s
                    sched.add(s)
            outs = [run_step(sched) for sched in scheds]
            a, b = ([(s.seq_id, n) for s, n in o.scheduled] for o in outs)
            assert a == b, (seed, step)
            assert [s.seq_id for s in left(outs[0])] == [s.seq_id for s in left(outs[1])]
            fast_rows += sum(1 for s, n in outs[0].scheduled if n == 1 and s.num_computed_tokens % BS != 1)
            for k, sched in enumerate(scheds):
                for s in list(sched.running):
                    if s.num_output_tokens >= s.params.max_tokens:
                        sched.finish(s)
                assert {i: (s.block_table, sched.kv.device_space.map.range_of(s)) for i, s in seqs[k].items()} == {
                    i: (s.block_table, scheds[0].kv.device_space.map.range_of(s)) for i, s in seqs[0].items()
                }
                sched.kv.allocator.check()
        assert fast_rows > 50 and scheds[0].num_preemptions > 0
