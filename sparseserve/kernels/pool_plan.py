"""HBM pool plan (docs/architecture.md, principles 2 and 4): residency lookup, set-associative
LRU victims, eviction and install for one layer's requested head blocks (state and policy:
kvcache/pool.py). On the GPU two fixed-grid kernels (capturable): 1 looks keys up, queues
each set's misses by atomic rank and lists each set's rank-0 miss (its leader); 2 walks that
list, each leader giving its set's queued misses the least recently used evictable ways.
Misses left without a way read from the host (loc = load = -1: bypass).

The trap: atomic ranks pair a set's misses with its victims in a GPU-dependent order; the
victims per set, hits, bypass counts, last-use stamps and statistics equal the reference's.

pool_read: one sparse layer's whole read of its decode lists under offload: the listed head
blocks' keys, one plan per distinct key (repeats read their representative's slot) and the
FlashH2D of the misses; three launches on the GPU. Its view of an entry is one int64 (`view_loc`):
the pool slot where >= 0, else -(host row + 1), the host row being the key. `defer` leaves the FlashH2D to the caller (a
lagged read of every layer loads layer by layer, each beside the attention of the layers before
it). See docs/offload.md, "The pool plan's kernels".

pool_lookup_ref: where a layer's listed head blocks are, planning nothing: the prefetching read,
whose pool a plan of the previous step's lists filled beside the step. On the GPU it has no kernel
of its own: topp's lse kernel does it (kernels/topp_prune.py, `ListLookup`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sparseserve.kernels.dispatch import tl, triton, use_triton
from sparseserve.kernels.flash_h2d import flash_h2d_ref, flash_h2d_triton, num_sms
from sparseserve.kernels.pdl import pdl_wait, use_pdl
from sparseserve.kernels.working_set import TouchState, touch_keys, working_set_touch_ref

NEVER = 1 << 62  # last_use of slots the current step uses: never a victim


class PoolState(NamedTuple):
    """The HBM pool's device state and the plan's scratch (kvcache/pool.py owns them)."""

    resident: torch.Tensor  # int64 [num_keys + 1] key -> slot (-1)
    owner: torch.Tensor  # int64 [num_slots + 1] slot -> key (-1)
    last_use: torch.Tensor  # int64 [num_slots + 1]
    clock: torch.Tensor  # int64 []
    stats: torch.Tensor  # int64 [4]
    set_misses: torch.Tensor  # int32 [num_sets], zero between calls
    set_queue: torch.Tensor  # int32 [num_slots]
    plan_cur: torch.Tensor  # int64 [1]
    claim: torch.Tensor  # int64 [num_keys + 1], -1 at first: repeat detection (scratch)
    leaders: torch.Tensor  # int32 [2 + num_sets], zeros at first: kernel 2's work list (scratch, pool_plan)
    ways: int
    num_sets: int
    hash_mult: int
    # Lagged reads (kvcache/offload.py): a slot stamped at or after `floor` [1] is never a
    # victim, so the step in flight's lists stay put; None: the call's own clock.
    floor: torch.Tensor | None = None


class ListLayout(NamedTuple):
    """How a layer's lists name head blocks: key = (layer * (num_blocks + 1) + token block) * Hkv
    + head (the host store's rows), the trash key num_keys for none. A read of several layers'
    lists (sel [layers, S, Hkv, cap]) starts at `layer`."""

    layer: int
    num_blocks: int
    num_kv_heads: int
    local: int  # local window blocks: read from the device cache, never the pool
    block_size: int


class ListLookup(NamedTuple):
    """A layer's lists to look up in the pool inside another kernel (kernels/topp_prune.py: the prefetching
    read's lookup is its lse kernel's): pool_lookup_ref's tables, layout, resident and stats."""

    tables: torch.Tensor
    layout: ListLayout
    resident: torch.Tensor
    stats: torch.Tensor


def view_loc(slot: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The sparse kernels' view of an entry (kernels/sparse_decode.py): its pool slot, or where it
    has none (-1) -(key + 1), read from host row key (the trash key: no entry)."""
    return torch.where(slot >= 0, slot, -1 - key)


def set_of(key: torch.Tensor, num_sets: int, hash_mult: int) -> torch.Tensor:
    """The set a head block key may live in."""
    return (key * hash_mult) % num_sets


def pool_plan_ref(
    key: torch.Tensor,
    resident: torch.Tensor,
    owner: torch.Tensor,
    last_use: torch.Tensor,
    clock: torch.Tensor,
    stats: torch.Tensor,
    *,
    ways: int,
    num_sets: int,
    hash_mult: int,
    floor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's step. key: int64 [N] head blocks the step reads, each at most once (the trash
    key resident.numel() - 1: none). Updated in place (int64): resident [num_keys + 1] (key ->
    slot, -1), owner and last_use [num_slots + 1] (slot -> key / clock of last use, -1 free;
    last entries: trash), clock [], stats [4] (hits, loads, bypass reads, layer steps).

    Returns (loc, load), [N] each: the slot each request reads after the loads (-1: bypass or
    no request); the slot each missing block is copied into (FlashH2D), -1 where none."""
    n = key.numel()
    trash_slot, trash_key = owner.numel() - 1, resident.numel() - 1
    need = key != trash_key
    slot = resident[key]
    hit = need & (slot >= 0)
    miss = need & (slot < 0)
    in_use = torch.zeros(trash_slot + 1, dtype=torch.bool, device=key.device)
    # index_fill_, not `x[idx] = scalar`: that copies a CPU scalar, which capture forbids.
    in_use.index_fill_(0, torch.where(hit, slot, trash_slot), True)
    # Rank of each miss among the misses of its set: a sort of the N requests, not of the pool.
    set_id = torch.where(miss, set_of(key, num_sets, hash_mult), num_sets)
    sorted_set, order = torch.sort(set_id, stable=True)
    first = torch.searchsorted(sorted_set, sorted_set)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=key.device) - first
    way_ids = set_id.clamp_max(num_sets - 1)[:, None] * ways + torch.arange(ways, device=key.device)
    protected = in_use[way_ids] if floor is None else in_use[way_ids] | (last_use[way_ids] >= floor)
    age = torch.where(protected, NEVER, last_use[way_ids])
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


def pool_plan(
    key: torch.Tensor,
    resident: torch.Tensor,
    owner: torch.Tensor,
    last_use: torch.Tensor,
    clock: torch.Tensor,
    stats: torch.Tensor,
    set_misses: torch.Tensor,
    set_queue: torch.Tensor,
    plan_cur: torch.Tensor,
    leaders: torch.Tensor,
    *,
    ways: int,
    num_sets: int,
    hash_mult: int,
    floor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """pool_plan_ref's contract, up to the pairing of a set's misses with its victims. Scratch:
    set_misses int32 [num_sets] (zero between calls), set_queue int32 [num_slots],
    plan_cur int64 [1], leaders int32 [2 + num_sets] (zeros at first): the calls' leader counts by
    the clock's parity (kernel 2 zeroes the next call's), then this call's leaders."""
    if use_triton(key):
        return pool_plan_triton(
            key,
            resident,
            owner,
            last_use,
            clock,
            stats,
            set_misses,
            set_queue,
            plan_cur,
            leaders,
            ways=ways,
            num_sets=num_sets,
            hash_mult=hash_mult,
            floor=floor,
        )
    leaders[:2].zero_()  # the torch plan lists no leaders: a Triton plan after it starts from none
    return pool_plan_ref(
        key, resident, owner, last_use, clock, stats, ways=ways, num_sets=num_sets, hash_mult=hash_mult, floor=floor
    )


BLOCK_LOOKUP = 512
# Kernel 2 walks the sets' leaders (kernel 1 lists them), 32 a program, on at most 2 programs an SM: a
# decode step's plan of every layer is ~10^5-10^6 requests with a few hundred misses; a program per chunk of
# requests put thousands of programs, nearly all without a leader, beside the step's first layers.
BLOCK_EVICT = 32
EVICT_PROGRAMS_PER_SM = 2


@triton.jit
def _lookup(
    key,
    need,
    slot,
    i,
    inb,
    last_use_ptr,
    clock,
    stats_ptr,
    count_ptr,
    queue_ptr,
    lead_ptr,
    loc_ptr,
    load_ptr,
    num_sets,
    load_other,
    WAYS: tl.constexpr,
    HASH: tl.constexpr,
    STORE: tl.constexpr = True,
    WORD: tl.constexpr = False,
):
    """Kernel 1's lookup of the requested keys (need) at positions i (inb: in bounds); the
    caller loaded slot = resident[key]. load_other: `load` where kernel 2 installs nothing
    (-1; pool_read marks repeats -2); STORE False: no loc and load a request (a caller that
    reads neither); WORD: a request without a slot gets loc -(key + 1) (view_loc), not -1. A
    hit's last_use = clock marks it in use this step; a set's rank-0 miss joins the leaders
    (the count at lead_ptr[clock % 2], the list after two)."""
    hit = need & (slot >= 0)
    miss = need & (slot < 0)
    tl.store(last_use_ptr + slot, tl.zeros_like(slot) + clock, mask=hit)
    set_id = (key * HASH) % num_sets
    rank = tl.atomic_add(count_ptr + set_id, tl.full(key.shape, 1, tl.int32), mask=miss, sem="relaxed")
    rank = tl.where(miss, rank, -1)
    tl.store(queue_ptr + set_id * WAYS + rank, i.to(tl.int32), mask=miss & (rank < WAYS))
    lead = (rank == 0).to(tl.int32)
    leads = tl.sum(lead, axis=0)
    if leads > 0:  # (most programs hold no set's first miss: no atomic)
        pos = tl.atomic_add(lead_ptr + (clock & 1), leads, sem="relaxed") + tl.cumsum(lead, 0) - 1
        tl.store(lead_ptr + 2 + pos, i.to(tl.int32), mask=lead > 0)
    if STORE:
        if WORD:
            tl.store(loc_ptr + i, tl.where(hit, slot, -1 - key), mask=inb)
        else:
            tl.store(loc_ptr + i, tl.where(hit, slot, -1), mask=inb)
        tl.store(load_ptr + i, load_other, mask=inb)
    # The trap: an atomic a program on one address serializes across thousands of programs; add only
    # what is not zero (a pool that hits leaves the miss count alone).
    hits = tl.sum(hit.to(tl.int64), axis=0)
    if hits > 0:
        tl.atomic_add(stats_ptr + 0, hits, sem="relaxed")
    misses = tl.sum(miss.to(tl.int64), axis=0)
    if misses > 0:  # kernel 2 moves the loads out of the misses
        tl.atomic_add(stats_ptr + 2, misses, sem="relaxed")


# Nothing step-shaped is specialized on (docs/architecture.md, "kernels/").
@triton.jit(do_not_specialize=["n"])
def _lookup_kernel(
    key_ptr,
    resident_ptr,
    last_use_ptr,
    clock_ptr,
    cur_ptr,
    stats_ptr,
    count_ptr,
    queue_ptr,
    lead_ptr,
    loc_ptr,
    load_ptr,
    n,
    trash_key,
    num_sets,
    WAYS: tl.constexpr,
    HASH: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    inb = i < n
    key = tl.load(key_ptr + i, mask=inb, other=trash_key)
    clock = tl.load(clock_ptr)
    need = key != trash_key
    slot = tl.load(resident_ptr + key, mask=need, other=-1)
    _lookup(
        key,
        need,
        slot,
        i,
        inb,
        last_use_ptr,
        clock,
        stats_ptr,
        count_ptr,
        queue_ptr,
        lead_ptr,
        loc_ptr,
        load_ptr,
        num_sets,
        tl.full([BLOCK], -1, tl.int64),
        WAYS=WAYS,
        HASH=HASH,
    )
    if pid == 0:
        tl.atomic_add(stats_ptr + 3, 1, sem="relaxed")
        tl.store(cur_ptr, clock)


# Nothing step-shaped is specialized on (docs/architecture.md, "kernels/").
@triton.jit(do_not_specialize=["stride_tb"])
def _list_lookup_kernel(
    sel_ptr,
    row_slots_ptr,
    tables_ptr,
    seq_lens_ptr,
    key_out_ptr,
    claim_ptr,
    resident_ptr,
    last_use_ptr,
    clock_ptr,
    cur_ptr,
    stats_ptr,
    count_ptr,
    queue_ptr,
    lead_ptr,
    loc_ptr,
    load_ptr,
    stamp_ptr,
    hist_ptr,
    since_ptr,
    ws_clock_ptr,
    stride_sl,
    stride_ss,
    stride_tb,
    key_base,
    key_step,
    trash_key,
    num_sets,
    HKV: tl.constexpr,
    CAP: tl.constexpr,
    CAP_P2: tl.constexpr,
    LOCAL: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    WAYS: tl.constexpr,
    HASH: tl.constexpr,
    TOUCH: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    WINDOW: tl.constexpr,
    VIEWS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, KV head, layer of the call): its list's keys, the claim of each (an atomic
    exchange of the clock: the first claimant represents the key), the lookup of the
    representatives; TOUCH: the keys join the row's working set (kernels/working_set.py). VIEWS
    False (a deferred read without views): only the misses are claimed and keep their keys (a
    hit listed twice is two hits), and no request's loc or load is written: kernel 2 and the
    loads by layer need nothing else."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    li = tl.program_id(2).to(tl.int64)
    # Before the wait (kernels/pdl.py): step inputs, and the two clocks, which kernels launched
    # before the predecessor advance.
    row_slot = tl.load(row_slots_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)
    clock = tl.load(clock_ptr)
    t = tl.load(ws_clock_ptr) if TOUCH else 0
    pdl_wait(PDL)  # the lists are the selection kernel's output
    lim = tl.maximum(tl.cdiv(seq_len, BLOCK_SIZE) - LOCAL, 0)
    c = tl.arange(0, CAP_P2)
    inb = c < CAP
    on = inb & ((tl.zeros([CAP_P2], tl.int64) + row_slot) >= 0)  # padding row (-1): none
    entry = tl.load(sel_ptr + li * stride_sl + row_slot * stride_ss + h * CAP + c, mask=on, other=-1)
    listed = (entry >= 0) & (entry < lim)
    blk = tl.load(tables_ptr + b * stride_tb + entry, mask=listed, other=0).to(tl.int64)
    key = tl.where(listed, (key_base + li * key_step + blk) * HKV + h, trash_key)
    i = ((li * tl.num_programs(0) + b) * HKV + h) * CAP + c
    if VIEWS:
        tl.store(key_out_ptr + i, key, mask=inb)
        old = tl.atomic_xchg(claim_ptr + key, tl.zeros_like(key) + clock, mask=listed, sem="relaxed")
        slot = tl.load(resident_ptr + key, mask=listed, other=-1)  # read for repeats too (unused there)
        repeat = listed & (old == clock)
    else:
        slot = tl.load(resident_ptr + key, mask=listed, other=-1)
        missing = listed & (slot < 0)
        tl.store(key_out_ptr + i, key, mask=missing)
        old = tl.atomic_xchg(claim_ptr + key, tl.zeros_like(key) + clock, mask=missing, sem="relaxed")
        repeat = missing & (old == clock)
    if TOUCH:
        prev = tl.load(stamp_ptr + key, mask=listed, other=-1)
    _lookup(
        key,
        listed & ~repeat,
        slot,
        i,
        inb,
        last_use_ptr,
        clock,
        stats_ptr,
        count_ptr,
        queue_ptr,
        lead_ptr,
        loc_ptr,
        load_ptr,
        num_sets,
        tl.where(repeat, -2, -1).to(tl.int64),
        WAYS=WAYS,
        HASH=HASH,
        STORE=VIEWS,
        WORD=True,
    )
    if TOUCH:
        ws_slot = row_slot % NUM_SLOTS  # a lagged list's row is its state slot + num_slots * parity
        added = touch_keys(
            key, listed, prev, ws_slot, t, stamp_ptr, hist_ptr, since_ptr, NUM_SLOTS=NUM_SLOTS, WINDOW=WINDOW
        )
        tl.atomic_add(hist_ptr + tl.maximum(ws_slot, 0) * WINDOW + t % WINDOW, added)
    if (b == 0) & (h == 0):  # a layer step planned
        tl.atomic_add(stats_ptr + 3, 1, sem="relaxed")
        if li == 0:
            tl.store(cur_ptr, clock)


# Nothing step-shaped is specialized on (docs/architecture.md, "kernels/"): the list's row length follows the
# batch, and a per-layer plan's first layer is its layer.
@triton.jit(do_not_specialize=["layer_keys", "first_layer", "per_layer"])
def _evict_kernel(
    key_ptr,
    lead_ptr,
    resident_ptr,
    owner_ptr,
    last_use_ptr,
    clock_ptr,
    cur_ptr,
    floor_ptr,
    stats_ptr,
    count_ptr,
    queue_ptr,
    loc_ptr,
    load_ptr,
    ckey_ptr,
    cload_ptr,
    ccount_ptr,
    layer_keys,
    first_layer,
    per_layer,
    num_sets,
    WAYS: tl.constexpr,
    WAYS_P2: tl.constexpr,
    HASH: tl.constexpr,
    BLOCK: tl.constexpr,
    COMPACT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Kernel 2: the programs share kernel 1's leaders, BLOCK at a time (a fixed grid, however many).
    COMPACT: each install is also listed by layer (key // layer_keys - first_layer): (key, slot) at
    ckey / cload [layer * per_layer + i] for i below ccount[layer] (zeros at first)."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    clock = tl.load(cur_ptr)
    floor = tl.load(floor_ptr)  # <= clock (the call's own clock without a lag)
    num_leads = tl.load(lead_ptr + (clock & 1))
    w = tl.arange(0, WAYS_P2)
    loads = tl.zeros([BLOCK], tl.int64)
    for start in range(pid * BLOCK, num_leads, tl.num_programs(0) * BLOCK):
        li = start + tl.arange(0, BLOCK)
        lead = li < num_leads
        i = tl.load(lead_ptr + 2 + li, mask=lead, other=0)
        key = tl.load(key_ptr + i, mask=lead, other=0)
        set_id = (key * HASH) % num_sets
        count = tl.load(count_ptr + set_id, mask=lead, other=0)
        valid = lead[:, None] & (w[None, :] < WAYS)
        # padding ways: in use
        age = tl.load(last_use_ptr + set_id[:, None] * WAYS + w[None, :], mask=valid, other=clock)
        # Round r gives the rank-r miss the least recently used way left (argmin: the first of
        # equally old ways, as the reference's stable sort) while it is older than the floor.
        for r in range(0, tl.max(tl.minimum(count, WAYS), 0)):
            way = tl.argmin(age, 1)
            take = lead & (r < count) & (tl.min(age, 1) < floor)
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
            if COMPACT:
                lyr = tl.where(take, new // layer_keys - first_layer, 0)
                at = lyr * per_layer + tl.atomic_add(ccount_ptr + lyr, 1, mask=take, sem="relaxed")
                tl.store(ckey_ptr + at, new, mask=take)
                tl.store(cload_ptr + at, slot, mask=take)
            age = tl.where(w[None, :] == way[:, None], clock, age)
            loads += take.to(tl.int64)
        tl.store(count_ptr + set_id, tl.zeros_like(count), mask=lead)
    total = tl.sum(loads, axis=0)
    if total > 0:  # (most programs install nothing: no atomic, see _lookup)
        tl.atomic_add(stats_ptr + 1, total, sem="relaxed")
        tl.atomic_add(stats_ptr + 2, -total, sem="relaxed")
    if pid == 0:  # the next call's clock, and its (other parity's) leader count
        tl.store(clock_ptr, clock + 1)
        tl.store(lead_ptr + 1 - (clock & 1), 0)


def _evict_grid(n: int, num_sets: int, device: torch.device) -> tuple[int]:
    """At most one leader a set and a request: a grid fixed by shapes (a CUDA graph replays it)."""
    most = max(1, int(EVICT_PROGRAMS_PER_SM * num_sms(device)))
    return (max(1, min(triton.cdiv(min(n, num_sets), BLOCK_EVICT), most)),)


def pool_plan_triton(
    key: torch.Tensor,
    resident: torch.Tensor,
    owner: torch.Tensor,
    last_use: torch.Tensor,
    clock: torch.Tensor,
    stats: torch.Tensor,
    set_misses: torch.Tensor,
    set_queue: torch.Tensor,
    plan_cur: torch.Tensor,
    leaders: torch.Tensor,
    *,
    ways: int,
    num_sets: int,
    hash_mult: int,
    floor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    key = key.contiguous()
    n = key.numel()
    loc = torch.empty(n, dtype=torch.int64, device=key.device)
    load = torch.empty(n, dtype=torch.int64, device=key.device)
    pdl = use_pdl(key.device)
    common = dict(WAYS=ways, HASH=hash_mult, PDL=pdl, launch_pdl=pdl)
    # At least one program: an empty call still advances the clock and counts a layer step.
    _lookup_kernel[(max(triton.cdiv(n, BLOCK_LOOKUP), 1),)](
        key,
        resident,
        last_use,
        clock,
        plan_cur,
        stats,
        set_misses,
        set_queue,
        leaders,
        loc,
        load,
        n,
        resident.numel() - 1,
        num_sets,
        BLOCK=BLOCK_LOOKUP,
        **common,
    )
    _evict_kernel[_evict_grid(n, num_sets, key.device)](
        key,
        leaders,
        resident,
        owner,
        last_use,
        clock,
        plan_cur,
        plan_cur if floor is None else floor,
        stats,
        set_misses,
        set_queue,
        loc,
        load,
        loc,  # (unused without COMPACT)
        loc,
        set_misses,
        1,
        0,
        0,
        num_sets,
        WAYS_P2=triton.next_power_of_2(ways),
        BLOCK=BLOCK_EVICT,
        COMPACT=False,
        **common,
    )
    return loc, load


def list_keys(
    sel: torch.Tensor,
    row_slots: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    lay: ListLayout,
    trash_key: int,
) -> torch.Tensor:
    """int64 [B, Hkv, cap]: the key of each entry before its row's local window, trash_key
    elsewhere. sel: int32 [S, Hkv, cap] the lists by state slot (-1 padded); row_slots: int [B]
    (-1: padding row); tables: int [B, W] token block tables; seq_lens: int [B]."""
    rows = sel[row_slots.long().clamp_min(0)]
    nb = (seq_lens.long() + lay.block_size - 1) // lay.block_size
    listed = (rows >= 0) & (rows < (nb - lay.local).clamp_min(0)[:, None, None]) & (row_slots >= 0)[:, None, None]
    blocks = tables.long().gather(1, torch.where(listed, rows, 0).flatten(1).long()).view_as(rows)
    h = torch.arange(lay.num_kv_heads, device=sel.device)[:, None]
    key = (lay.layer * (lay.num_blocks + 1) + blocks) * lay.num_kv_heads + h
    return torch.where(listed, key, trash_key)


def pool_read_ref(
    host_flat: torch.Tensor,
    pool_slots: torch.Tensor,
    sel: torch.Tensor,
    row_slots: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    lay: ListLayout,
    st: PoolState,
    touch: TouchState | None = None,
    defer: bool = False,
    views: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    """One sparse layer's read of its lists through the pool (list_keys' arguments): one plan
    per distinct key (repeats read their first occurrence's slot), then FlashH2D of the misses;
    `touch`: listed keys join their rows' working sets. Returns (loc, key) int64 [B, Hkv, cap]:
    each entry's view_loc (its slot, or -(key + 1): a bypass from host row key, or none) and key.
    sel [L, S, Hkv, cap]: layers lay.layer.. planned at once, (loc, key) [L, B, Hkv, cap]. defer: the
    misses are not loaded; returns (loc, key, loads), loads = (key, load, count) by layer
    ([L, loads_width(N / L)] x 2, int32 [L]; L = 1 for one layer): layer l's misses are its first
    count[l] entries, each to be loaded into slot load from host row key (FlashH2D; a key listed twice
    loads once). views=False (with defer): a caller that only loads (prefetching reads look their lists
    up later): loc is None, key names the misses only (the others may be anything), and a hit listed
    twice counts as two hits (the kernels claim only misses)."""
    trash_key = st.resident.numel() - 1
    if sel.dim() == 4:
        key = torch.stack(
            [
                list_keys(s, row_slots, tables, seq_lens, lay._replace(layer=lay.layer + i), trash_key)
                for i, s in enumerate(sel)
            ]
        )
    else:
        key = list_keys(sel, row_slots, tables, seq_lens, lay, trash_key)
    flat = key.reshape(-1)
    pos = torch.arange(flat.numel(), device=key.device)
    _, inverse = torch.unique(flat, return_inverse=True)
    first = torch.full_like(pos, flat.numel()).scatter_reduce_(0, inverse, pos, "amin")
    rep = first[inverse]  # the first occurrence of each key represents it
    unique = torch.where(rep == pos, flat, trash_key)
    if defer and not views:  # the kernels count a hit listed twice as two (they claim only the misses)
        hit_repeats = ((rep != pos) & (flat != trash_key) & (st.resident[flat] >= 0)).sum()
    loc, load = pool_plan_ref(
        unique,
        st.resident,
        st.owner,
        st.last_use,
        st.clock,
        st.stats,
        ways=st.ways,
        num_sets=st.num_sets,
        hash_mult=st.hash_mult,
        floor=st.floor,
    )
    if sel.dim() == 4:  # a layer step per layer, as the kernels count
        st.stats[3] += sel.shape[0] - 1
    if defer and not views:
        st.stats[0] += hit_repeats
    if not defer:
        flash_h2d_ref(host_flat, pool_slots, unique, load)
    if touch is not None:
        # lag: a row is slot + S * parity
        ws_slots = torch.where(row_slots >= 0, row_slots.long() % touch.hist.shape[0], -1)
        working_set_touch_ref(key.transpose(0, 1).flatten(1) if sel.dim() == 4 else key.flatten(1), ws_slots, *touch)
    if defer:
        loads = _by_layer(unique, load, sel.shape[0] if sel.dim() == 4 else 1)
        return view_loc(loc[rep].view_as(key), key) if views else None, key, loads
    return view_loc(loc[rep].view_as(key), key), key


def loads_width(per_layer: int) -> int:
    """The row length of pool_read's loads by layer: even (16-byte aligned int64 rows: FlashH2D takes a row
    with the alignment its kernel was compiled for), with a column past the requests."""
    return (per_layer + 2) // 2 * 2


def _by_layer(key: torch.Tensor, load: torch.Tensor, layers: int) -> tuple[torch.Tensor, ...]:
    """pool_read's deferred loads (key, load [N], the layers' requests in turn) listed by layer: (key, load)
    [L, loads_width(N / L)], each layer's loads first, and their counts (int32 [L])."""
    key, load = key.view(layers, -1), load.view(layers, -1)
    todo = load >= 0
    at = torch.where(todo, todo.long().cumsum(1) - 1, load.shape[1])  # column N / L: the rest
    width = loads_width(load.shape[1])
    out = [torch.full((layers, width), -1, dtype=torch.int64, device=load.device) for _ in "kl"]
    for o, v in zip(out, (key, load)):
        o.scatter_(1, at, v)
    return out[0], out[1], todo.sum(1, dtype=torch.int32)


def pool_read_triton(
    host_flat: torch.Tensor,
    pool_slots: torch.Tensor,
    sel: torch.Tensor,
    row_slots: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    lay: ListLayout,
    st: PoolState,
    touch: TouchState | None = None,
    defer: bool = False,
    views: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    layers = sel.shape[0] if sel.dim() == 4 else 1
    sel4 = sel if sel.dim() == 4 else sel[None]
    b, cap = row_slots.numel(), sel.shape[-1]
    assert sel4.shape[2] == lay.num_kv_heads and sel4.stride(3) == 1 and sel4.stride(2) == cap
    assert tables.stride(1) == 1
    n, dev = layers * b * lay.num_kv_heads * cap, sel.device
    key = torch.empty(*sel.shape[:-3], b, lay.num_kv_heads, cap, dtype=torch.int64, device=dev)
    loc = torch.empty(n, dtype=torch.int64, device=dev)
    load = torch.empty(n, dtype=torch.int64, device=dev)
    per_layer = loads_width(n // layers)
    if defer:  # the loads listed by layer (pool_read_ref)
        loads = (
            torch.empty(layers, per_layer, dtype=torch.int64, device=dev),
            torch.empty(layers, per_layer, dtype=torch.int64, device=dev),
            torch.zeros(layers, dtype=torch.int32, device=dev),
        )
    pdl = use_pdl(dev)
    if b:
        ws = touch if touch is not None else TouchState(loc, loc, loc, loc)  # unused without TOUCH
        _list_lookup_kernel[(b, lay.num_kv_heads, layers)](
            sel4,
            row_slots,
            tables,
            seq_lens,
            key,
            st.claim,
            st.resident,
            st.last_use,
            st.clock,
            st.plan_cur,
            st.stats,
            st.set_misses,
            st.set_queue,
            st.leaders,
            loc,
            load,
            *ws,
            sel4.stride(0),
            sel4.stride(1),
            tables.stride(0),
            lay.layer * (lay.num_blocks + 1),
            lay.num_blocks + 1,
            st.resident.numel() - 1,
            st.num_sets,
            HKV=lay.num_kv_heads,
            CAP=cap,
            CAP_P2=triton.next_power_of_2(cap),
            LOCAL=lay.local,
            BLOCK_SIZE=lay.block_size,
            WAYS=st.ways,
            HASH=st.hash_mult,
            TOUCH=touch is not None,
            NUM_SLOTS=ws.hist.shape[0] if touch is not None else 1,
            WINDOW=ws.hist.shape[1] if touch is not None else 1,
            VIEWS=views or not defer,
            PDL=pdl,
            launch_pdl=pdl,
        )
    else:  # no rows: the clock still advances and a layer step counts, as in pool_plan
        _lookup_kernel[(1,)](
            key,
            st.resident,
            st.last_use,
            st.clock,
            st.plan_cur,
            st.stats,
            st.set_misses,
            st.set_queue,
            st.leaders,
            loc,
            load,
            0,
            st.resident.numel() - 1,
            st.num_sets,
            BLOCK=BLOCK_LOOKUP,
            WAYS=st.ways,
            HASH=st.hash_mult,
            PDL=pdl,
            launch_pdl=pdl,
        )
        if layers > 1:
            st.stats[3:].add_(layers - 1)
    _evict_kernel[_evict_grid(n, st.num_sets, dev)](
        key,
        st.leaders,
        st.resident,
        st.owner,
        st.last_use,
        st.clock,
        st.plan_cur,
        st.plan_cur if st.floor is None else st.floor,
        st.stats,
        st.set_misses,
        st.set_queue,
        loc,
        load,
        *(loads if defer else (loc, loc, st.set_misses)),  # (unused without COMPACT)
        (lay.num_blocks + 1) * lay.num_kv_heads,
        lay.layer,
        per_layer,
        st.num_sets,
        WAYS=st.ways,
        WAYS_P2=triton.next_power_of_2(st.ways),
        HASH=st.hash_mult,
        BLOCK=BLOCK_EVICT,
        COMPACT=defer,
        PDL=pdl,
        launch_pdl=pdl,
    )
    if defer and not views:
        return None, key, loads
    if defer:  # repeats (load -2) take their key's slot now, if it has one; FlashH2D skips them
        rep = load == -2  # (only their keys index: the others' may be anything)
        slot = st.resident[torch.where(rep, key.view(-1), st.resident.numel() - 1)]
        loc = torch.where(rep & (slot >= 0), slot, loc)
        return loc.view_as(key), key, loads
    flash_h2d_triton(host_flat, pool_slots, key.view(-1), load, repeats=(st.resident, loc))
    return loc.view_as(key), key


def pool_read(
    host_flat: torch.Tensor,
    pool_slots: torch.Tensor,
    sel: torch.Tensor,
    row_slots: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    lay: ListLayout,
    st: PoolState,
    touch: TouchState | None = None,
    defer: bool = False,
    views: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    """pool_read_ref's contract, up to the pairing of misses with victims and which repeat
    represents a key."""
    if not use_triton(sel):
        st.leaders[:2].zero_()  # (as in pool_plan)
    fn = pool_read_triton if use_triton(sel) else pool_read_ref
    return fn(host_flat, pool_slots, sel, row_slots, tables, seq_lens, lay, st, touch, defer, views)


def pool_lookup_ref(
    sel: torch.Tensor,
    row_slots: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    lay: ListLayout,
    resident: torch.Tensor,
    stats: torch.Tensor,
) -> torch.Tensor:
    """Where a layer's listed head blocks are now, planning nothing (list_keys' arguments; the
    prefetching read, kvcache/offload.py): loc int64 [B, Hkv, cap], each entry's view_loc (the pool
    slot, or -(key + 1): read host row key over UVA; the trash key: no request). stats int64 [2] +=
    listed entries found in the pool, and not."""
    trash_key = resident.numel() - 1
    key = list_keys(sel, row_slots, tables, seq_lens, lay, trash_key)
    slot = resident[key]
    listed = key != trash_key
    hit = listed & (slot >= 0)
    stats += torch.stack([hit.sum(), (listed & ~hit).sum()])
    return view_loc(torch.where(hit, slot, -1), key)


def invalidate_ref(
    blocks: torch.Tensor,
    resident: torch.Tensor,
    owner: torch.Tensor,
    last_use: torch.Tensor,
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
) -> None:
    """Token blocks given to a new owner (int [N]) leave the pool: every layer's and KV head's
    head block is no longer resident, and its slot, if any, is free (owner, last_use -1)."""
    if blocks.numel() == 0:
        return
    layer = torch.arange(num_layers, device=blocks.device)[:, None, None]
    head = torch.arange(num_kv_heads, device=blocks.device)
    key = ((layer * (num_blocks + 1) + blocks.long()[None, :, None]) * num_kv_heads + head).reshape(-1)
    slot = resident[key]
    # Keys without a slot write the trash slot (kept free): no boolean mask, no host sync.
    slot = torch.where(slot >= 0, slot, owner.numel() - 1)
    owner.index_fill_(0, slot, -1)
    last_use.index_fill_(0, slot, -1)
    resident.index_fill_(0, key, -1)


# Nothing step-shaped is specialized on (docs/architecture.md, "kernels/").
@triton.jit(do_not_specialize=["num_keys"])
def _invalidate_kernel(
    blocks_ptr, resident_ptr, owner_ptr, last_use_ptr, layer_keys, num_keys, HKV: tl.constexpr, KEYS_P2: tl.constexpr
):
    # One program a token block: its num_keys = layers x Hkv head blocks in one vector.
    b = tl.load(blocks_ptr + tl.program_id(0)).to(tl.int64)
    j = tl.arange(0, KEYS_P2)
    m = j < num_keys
    key = (j // HKV) * layer_keys + b * HKV + j % HKV
    slot = tl.load(resident_ptr + key, mask=m, other=-1)
    held = m & (slot >= 0)
    tl.store(owner_ptr + slot, -1, mask=held)
    tl.store(last_use_ptr + slot, -1, mask=held)
    tl.store(resident_ptr + key, -1, mask=m)


def invalidate_triton(
    blocks: torch.Tensor,
    resident: torch.Tensor,
    owner: torch.Tensor,
    last_use: torch.Tensor,
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
) -> None:
    if blocks.numel() == 0:
        return
    keys = num_layers * num_kv_heads
    _invalidate_kernel[(blocks.numel(),)](
        blocks,
        resident,
        owner,
        last_use,
        (num_blocks + 1) * num_kv_heads,
        keys,
        HKV=num_kv_heads,
        KEYS_P2=triton.next_power_of_2(keys),
    )


def invalidate(
    blocks: torch.Tensor,
    resident: torch.Tensor,
    owner: torch.Tensor,
    last_use: torch.Tensor,
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
) -> None:
    """invalidate_ref's contract: one launch (a step's few new blocks, at its start)."""
    fn = invalidate_triton if use_triton(resident) else invalidate_ref
    fn(blocks, resident, owner, last_use, num_layers, num_blocks, num_kv_heads)
