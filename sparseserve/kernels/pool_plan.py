"""HBM pool plan on the GPU (DESIGN.md principles 2, 4): residency lookup, set-associative LRU victims,
eviction and install for one layer's requested head blocks, in two kernels with fixed grids (capturable).
Reference: kvcache/pool.py HBMPool.plan_ref (about 25 torch ops and two sorts, ~5 ms a decode step at 20
requests x 30 layers on an H200).

Kernel 1 (one program per chunk of requests): `slot = resident[key]`; a hit stamps `last_use[slot]` with
the clock, which marks it in use: no slot holds a clock value from the future, so kernel 2 reads
`last_use == clock` as "used this step, never a victim". A miss takes its rank within its set with an
atomic increment of the set's miss counter and, if the rank is below `ways`, enters the set's queue
(`queue[set * ways + rank]`); a miss ranked `ways` or later is a bypass already (a set has `ways` slots).

Kernel 2 (one program per chunk of requests): the rank-0 miss of each set leads it, so each set is
handled by exactly one lane and nothing in a set races. The leader gives the rank-r queued miss the
r-th least recently used way of the set (in rounds: one argmin over the ways each, as many rounds as the
set has misses) while that way is evictable (older than the clock), evicts its previous owner, installs
the new one, stamps the way and resets the set's counter to zero for the next call (so no per-call
zeroing is needed). The misses no evictable way is left for keep loc = load = -1 (bypass reads).

Atomic ranks make the pairing of a set's misses with its victims order-dependent on a GPU; the victims
chosen in each set, the hits, the number of bypass reads per set, the last-use stamps and the statistics
are the reference's (attention does not depend on which slot holds a block). The clock advances through
`HBMPool.plan_cur`, a copy kernel 1 takes: kernel 2's programs read the step's clock from it while its
program 0 writes the next one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from sparseserve.kvcache.pool import HBMPool

BLOCK_LOOKUP = 512
BLOCK_EVICT = 64


@triton.jit
def _lookup_kernel(key_ptr, resident_ptr, last_use_ptr, clock_ptr, cur_ptr, stats_ptr, count_ptr, queue_ptr,
                   rank_ptr, loc_ptr, load_ptr, n, trash_key, num_sets,
                   WAYS: tl.constexpr, HASH: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    inb = i < n
    key = tl.load(key_ptr + i, mask=inb, other=trash_key)
    need = key != trash_key
    slot = tl.load(resident_ptr + key, mask=need, other=-1)
    hit = need & (slot >= 0)
    miss = need & (slot < 0)
    clock = tl.load(clock_ptr)
    tl.store(last_use_ptr + slot, tl.zeros_like(slot) + clock, mask=hit)
    set_id = (key * HASH) % num_sets
    rank = tl.atomic_add(count_ptr + set_id, tl.full((BLOCK,), 1, tl.int32), mask=miss, sem="relaxed")
    rank = tl.where(miss, rank, -1)
    tl.store(queue_ptr + set_id * WAYS + rank, i.to(tl.int32), mask=miss & (rank < WAYS))
    tl.store(rank_ptr + i, rank, mask=inb)
    tl.store(loc_ptr + i, tl.where(hit, slot, -1), mask=inb)
    tl.store(load_ptr + i, tl.full((BLOCK,), -1, tl.int64), mask=inb)
    tl.atomic_add(stats_ptr + 0, tl.sum(hit.to(tl.int64), axis=0), sem="relaxed")
    tl.atomic_add(stats_ptr + 2, tl.sum(miss.to(tl.int64), axis=0), sem="relaxed")  # kernel 2 moves loads out
    if pid == 0:
        tl.atomic_add(stats_ptr + 3, 1, sem="relaxed")
        tl.store(cur_ptr, clock)


@triton.jit
def _evict_kernel(key_ptr, rank_ptr, resident_ptr, owner_ptr, last_use_ptr, clock_ptr, cur_ptr, stats_ptr,
                  count_ptr, queue_ptr, loc_ptr, load_ptr, n, num_sets,
                  WAYS: tl.constexpr, WAYS_P2: tl.constexpr, HASH: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    lead = tl.load(rank_ptr + i, mask=i < n, other=-1) == 0
    key = tl.load(key_ptr + i, mask=lead, other=0)
    set_id = (key * HASH) % num_sets
    count = tl.load(count_ptr + set_id, mask=lead, other=0)
    clock = tl.load(cur_ptr)
    w = tl.arange(0, WAYS_P2)
    valid = lead[:, None] & (w[None, :] < WAYS)
    age = tl.load(last_use_ptr + set_id[:, None] * WAYS + w[None, :], mask=valid, other=clock)  # padding: in use
    # Round r gives the rank-r miss the least recently used way left (argmin: the first of equally old ways,
    # the reference's stable (last use, way) order) while it is evictable (older than the clock: in-use ways
    # carry the clock). A set has few misses a step, so this is a few rounds, not a ways x ways comparison.
    loads = tl.zeros([BLOCK], tl.int64)
    for r in range(0, tl.max(tl.minimum(count, WAYS), 0)):
        way = tl.argmin(age, 1)
        take = lead & (r < count) & (tl.min(age, 1) < clock)
        slot = set_id * WAYS + way
        j = tl.load(queue_ptr + set_id * WAYS + r, mask=take, other=0)
        new = tl.load(key_ptr + j, mask=take, other=0)
        old = tl.load(owner_ptr + slot, mask=take, other=-1)
        tl.store(resident_ptr + old, tl.full(old.shape, -1, tl.int64), mask=take & (old >= 0))
        tl.store(owner_ptr + slot, new, mask=take)
        tl.store(resident_ptr + new, slot, mask=take)
        tl.store(last_use_ptr + slot, tl.zeros_like(slot) + clock, mask=take)
        tl.store(loc_ptr + j, slot, mask=take)
        tl.store(load_ptr + j, slot, mask=take)
        age = tl.where(w[None, :] == way[:, None], clock, age)
        loads += take.to(tl.int64)
    tl.store(count_ptr + set_id, tl.zeros_like(count), mask=lead)
    total = tl.sum(loads, axis=0)
    tl.atomic_add(stats_ptr + 1, total, sem="relaxed")
    tl.atomic_add(stats_ptr + 2, -total, sem="relaxed")
    if pid == 0:
        tl.store(clock_ptr, clock + 1)


def pool_plan(pool: HBMPool, key: torch.Tensor, hash_mult: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HBMPool.plan on the GPU (same contract as HBMPool.plan_ref). key: int64 [N]."""
    key = key.contiguous()
    n = key.numel()
    rank = torch.empty(n, dtype=torch.int32, device=key.device)
    loc = torch.empty(n, dtype=torch.int64, device=key.device)
    load = torch.empty(n, dtype=torch.int64, device=key.device)
    common = dict(WAYS=pool.ways, HASH=hash_mult)
    # At least one program: an empty call still advances the clock and counts a layer step.
    _lookup_kernel[(max(triton.cdiv(n, BLOCK_LOOKUP), 1),)](
        key, pool.resident, pool.last_use, pool.clock, pool.plan_cur, pool.stats, pool.set_misses, pool.set_queue,
        rank, loc, load, n, pool.trash_key, pool.num_sets, BLOCK=BLOCK_LOOKUP, **common)
    _evict_kernel[(max(triton.cdiv(n, BLOCK_EVICT), 1),)](
        key, rank, pool.resident, pool.owner, pool.last_use, pool.clock, pool.plan_cur, pool.stats,
        pool.set_misses, pool.set_queue, loc, load, n, pool.num_sets,
        WAYS_P2=triton.next_power_of_2(pool.ways), BLOCK=BLOCK_EVICT, **common)
    return loc, load
