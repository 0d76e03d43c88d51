"""HBM pool plan (DESIGN.md principles 2, 4): residency lookup, set-associative LRU victims, eviction and
install for one layer's requested head blocks (the pool's state and replacement policy: kvcache/pool.py).

pool_plan_ref: about 25 torch ops and two sorts (~5 ms a decode step at 20 requests x 30 layers on an H200);
on the GPU two kernels with fixed grids (capturable):

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
`plan_cur`, a copy kernel 1 takes: kernel 2's programs read the step's clock from it while its
program 0 writes the next one.
"""
from __future__ import annotations

import torch

from sparseserve.kernels.dispatch import tl, triton, use_triton

NEVER = 1 << 62  # last_use of slots the current step uses: never a victim


def set_of(key: torch.Tensor, num_sets: int, hash_mult: int) -> torch.Tensor:
    """The set a head block key may live in."""
    return (key * hash_mult) % num_sets


def pool_plan_ref(key: torch.Tensor, resident: torch.Tensor, owner: torch.Tensor, last_use: torch.Tensor,
                  clock: torch.Tensor, stats: torch.Tensor, *, ways: int, num_sets: int, hash_mult: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's step. key: int64 [N] head blocks the step reads (the trash key resident.numel() - 1: none),
    each at most once. resident [num_keys + 1] (key -> slot, -1), owner and last_use [num_slots + 1] (slot ->
    key / clock of last use, -1 free; last entries: trash), clock [] and stats [4] (hits, loads, bypass reads,
    layer steps) int64 tensors, updated in place.

    Returns (loc, load): loc [N] the slot each request reads after the loads, -1 for bypass reads and
    non-requests; load [N] the slot each missing block must be copied into (FlashH2D), -1 where nothing loads."""
    n = key.numel()
    trash_slot, trash_key = owner.numel() - 1, resident.numel() - 1
    need = key != trash_key
    slot = resident[key]
    hit = need & (slot >= 0)
    miss = need & (slot < 0)
    in_use = torch.zeros(trash_slot + 1, dtype=torch.bool, device=key.device)
    # index_fill_, not `x[idx] = scalar`: the latter copies a CPU scalar, which CUDA-graph capture forbids.
    in_use.index_fill_(0, torch.where(hit, slot, trash_slot), True)
    # Rank of each miss among the misses of its set: a sort of the N requests, not of the pool.
    set_id = torch.where(miss, set_of(key, num_sets, hash_mult), num_sets)
    sorted_set, order = torch.sort(set_id, stable=True)
    first = torch.searchsorted(sorted_set, sorted_set)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=key.device) - first
    way_ids = set_id.clamp_max(num_sets - 1)[:, None] * ways + torch.arange(ways, device=key.device)
    age = torch.where(in_use[way_ids], NEVER, last_use[way_ids])
    age_sorted, way_order = torch.sort(age, dim=1, stable=True)
    r = rank.clamp_max(ways - 1)[:, None]
    victim = way_ids.gather(1, way_order.gather(1, r))[:, 0]
    ok = miss & (rank < ways) & (age_sorted.gather(1, r)[:, 0] < NEVER)
    load = torch.where(ok, victim, -1)
    # Evict the victims' previous blocks, then install the new owners.
    old = owner[torch.where(ok, victim, trash_slot)]
    resident.index_fill_(0, torch.where(ok & (old >= 0), old, trash_key), -1)
    owner[torch.where(ok, victim, trash_slot)] = torch.where(ok, key, -1)
    resident[torch.where(ok, key, trash_key)] = victim
    resident[trash_key].fill_(-1)  # fill_: `x[i] = -1` copies a CPU scalar (no graph capture)
    owner[trash_slot].fill_(-1)
    loc = torch.where(hit, slot, load)
    last_use[torch.where(loc >= 0, loc, trash_slot)] = clock
    last_use[trash_slot].fill_(-1)
    clock += 1
    stats += torch.stack([hit.sum(), ok.sum(), (miss & ~ok).sum(), torch.ones_like(clock)])
    return loc, load


def pool_plan(key: torch.Tensor, resident: torch.Tensor, owner: torch.Tensor, last_use: torch.Tensor,
              clock: torch.Tensor, stats: torch.Tensor, set_misses: torch.Tensor, set_queue: torch.Tensor,
              plan_cur: torch.Tensor, *, ways: int, num_sets: int, hash_mult: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """pool_plan_ref's contract. The kernels' scratch: set_misses int32 [num_sets] (zero between calls),
    set_queue int32 [num_slots], plan_cur int64 [1]. The kernels may pair a set's misses with its victims in
    another order (the victims, hits and bypass count per set are the reference's)."""
    if use_triton(key):
        return pool_plan_triton(key, resident, owner, last_use, clock, stats, set_misses, set_queue, plan_cur,
                                ways=ways, num_sets=num_sets, hash_mult=hash_mult)
    return pool_plan_ref(key, resident, owner, last_use, clock, stats, ways=ways, num_sets=num_sets,
                         hash_mult=hash_mult)


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


def pool_plan_triton(key: torch.Tensor, resident: torch.Tensor, owner: torch.Tensor, last_use: torch.Tensor,
                     clock: torch.Tensor, stats: torch.Tensor, set_misses: torch.Tensor, set_queue: torch.Tensor,
                     plan_cur: torch.Tensor, *, ways: int, num_sets: int, hash_mult: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    key = key.contiguous()
    n = key.numel()
    rank = torch.empty(n, dtype=torch.int32, device=key.device)
    loc = torch.empty(n, dtype=torch.int64, device=key.device)
    load = torch.empty(n, dtype=torch.int64, device=key.device)
    common = dict(WAYS=ways, HASH=hash_mult)
    # At least one program: an empty call still advances the clock and counts a layer step.
    _lookup_kernel[(max(triton.cdiv(n, BLOCK_LOOKUP), 1),)](
        key, resident, last_use, clock, plan_cur, stats, set_misses, set_queue,
        rank, loc, load, n, resident.numel() - 1, num_sets, BLOCK=BLOCK_LOOKUP, **common)
    _evict_kernel[(max(triton.cdiv(n, BLOCK_EVICT), 1),)](
        key, rank, resident, owner, last_use, clock, plan_cur, stats,
        set_misses, set_queue, loc, load, n, num_sets,
        WAYS_P2=triton.next_power_of_2(ways), BLOCK=BLOCK_EVICT, **common)
    return loc, load
