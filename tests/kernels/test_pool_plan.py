"""The HBM pool plan's Triton kernels (kernels/pool_plan.py; TRITON_INTERPRET on CPU) against the torch
reference pool_plan_ref, step by step from the same state: the hits and their slots, the victims
chosen in each set, the bypass reads per set, the LRU clock stamps, the statistics and the invariants
are the reference's; only which miss of a set gets which victim may differ (atomic ranks on a GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from sparseserve.kernels.dispatch import forced
from sparseserve.kernels.pool_plan import ListLayout, list_keys, pool_lookup_ref, view_loc
from sparseserve.kernels.working_set import TouchState, working_set_begin_step
from sparseserve.kvcache.pool import HBMPool
from tests.kernel_utils import DEVICE, ON_GPU, gpu_only

STATE = ("resident", "owner", "last_use", "clock", "stats", "floor")


def make(layers: int, blocks: int, hkv: int, slots: int, ways: int) -> HBMPool:
    return HBMPool(layers, blocks, hkv, 2, 4, slots, torch.float32, DEVICE, ways=ways)


def requests(pool: HBMPool, g: torch.Generator, per_head: int, batch: int) -> torch.Tensor:
    """Keys of one layer's step: `batch` sequences x Hkv heads x per_head blocks, -1 padding; sequences
    own distinct blocks (each key at most once a call, as plan requires)."""
    layer = int(torch.randint(pool.num_keys // ((pool.num_blocks + 1) * pool.num_kv_heads), (1,), generator=g))
    pad = batch * per_head // 4
    heads = [
        torch.randperm(pool.num_blocks + pad, generator=g)[: batch * per_head] - pad  # < 0: padding
        for _ in range(pool.num_kv_heads)
    ]
    blocks = torch.stack(heads).clamp_min(-1).view(pool.num_kv_heads, batch, per_head).transpose(0, 1)
    return pool.keys(layer, blocks.to(DEVICE)).reshape(-1)


def compare_step(pool: HBMPool, ref: HBMPool, key: torch.Tensor, lagged: bool = False) -> int:
    """One plan of `pool` (Triton) against the reference plan of `ref` started from the same state; returns the
    step's bypass reads. lagged: no victim may carry a stamp at or after the pool's floor."""
    for name in STATE:
        getattr(ref, name).copy_(getattr(pool, name))
    before = pool.resident[key].clone()
    stamps = pool.last_use.clone()
    with forced("torch"):
        loc_r, load_r = ref.plan(key, lagged)
    with forced("triton"):
        loc, load = pool.plan(key, lagged)
    if lagged:
        assert (stamps[load[load >= 0]] < pool.floor).all()
    need = key != pool.trash_key
    hit, miss = need & (before >= 0), need & (before < 0)
    for lc, ld in ((loc, load), (loc_r, load_r)):
        assert torch.equal(lc[hit], before[hit]) and (ld[hit] == -1).all() and (lc[~need] == -1).all()
        assert torch.equal(lc[miss], ld[miss])
    assert torch.equal(load[load >= 0].sort().values, load_r[load_r >= 0].sort().values)  # same victims
    sets = pool.set_of(key)
    bypass = miss & (loc < 0)
    assert torch.equal(
        torch.bincount(sets[bypass], minlength=pool.num_sets),
        torch.bincount(sets[miss & (loc_r < 0)], minlength=pool.num_sets),
    )
    assert torch.equal(pool.resident[key[load >= 0]], load[load >= 0])  # installed where loaded
    for name in ("last_use", "clock", "stats"):
        assert torch.equal(getattr(pool, name), getattr(ref, name)), name
    kept = torch.ones(pool.num_slots + 1, dtype=torch.bool, device=key.device)
    kept[load[load >= 0]] = False
    assert torch.equal(pool.owner[kept], ref.owner[kept])  # slots no miss took are untouched
    pool.check()
    return int(bypass.sum())


@pytest.mark.parametrize(
    "slots, ways, per_head, batch, bypasses, hkv",
    [
        (8, 4, 6, 2, True, 2),  # two sets: many misses per set, bypass reads every step
        (6, 8, 3, 2, True, 2),  # ways clipped to 6 slots: one set, ways not a power of two
        (1, 8, 2, 2, True, 2),  # a single slot
        (64, 8, 10, 8, True, 2),  # 160 requests: one program of kernel 1
        (256, 8, 40, 16, True, 2),  # 1,280 requests: several programs in kernel 1
        (1024, 2, 40, 16, True, 2),  # 512 sets: more leaders than kernel 2's grid takes at once (it loops)
        (16, 8, 3, 1, False, 2),  # few misses per set: which free / equally old ways go first matters
        pytest.param(24, 8, 4, 3, True, 3, id="group-3kv"),  # 3 KV heads (SmolLM2): keys of (layer, block, head)
    ],
)
def test_triton_plan_matches_reference(slots, ways, per_head, batch, bypasses, hkv):
    g = torch.Generator().manual_seed(slots * 100 + per_head)
    layers, blocks = 2, batch * per_head + 4  # few blocks: hits across steps
    pool = make(layers, blocks, hkv, slots, ways)
    ref = make(layers, blocks, hkv, slots, ways)
    bypass = 0
    for step in range(8):
        bypass += compare_step(pool, ref, requests(pool, g, per_head, batch))
        if step % 3 == 2:  # freed blocks leave the pool between steps
            pool.invalidate(random.Random(step).sample(range(blocks), 4))
            pool.check()
    assert (bypass > 0) == bypasses
    assert pool.stats[0] > 0  # hits
    assert pool.stats[1] > pool.num_slots  # slots were reused (evictions)


def test_triton_plan_lagged_keeps_the_steps_own_slots():
    """Lagged reads (kvcache/offload.py plan_lagged): a step's plans (every layer at its start, then layer by
    layer) form a round; no plan of the round evicts a slot another one stamped, so more misses are bypass
    reads than without the floor; the kernels match the reference."""
    g = torch.Generator().manual_seed(5)
    layers, blocks, hkv, per_head, batch = 2, 40, 2, 3, 2
    pool, ref = make(layers, blocks, hkv, 16, 4), make(layers, blocks, hkv, 16, 4)
    bypass = 0
    for step in range(12):
        if step % 2 == 0:  # a step's first plan starts a round
            pool.begin_round()
            assert pool.floor.item() == pool.clock.item()
        bypass += compare_step(pool, ref, requests(pool, g, per_head, batch), lagged=True)
    assert bypass > 0 and pool.stats[1] > pool.num_slots  # evictions, only of slots older than the floor


def test_invalidate_kernel_matches_reference():
    """Blocks with new owners leave the pool (kvcache/pool.py invalidate): after plans filled it, the Triton
    kernel and the reference drop the same head blocks of every layer and KV head (some resident, some not,
    one listed twice) from the same state, and the accounting still holds."""
    g = torch.Generator().manual_seed(11)
    pool, ref = make(3, 30, 3, 24, 4), make(3, 30, 3, 24, 4)
    for _ in range(4):
        with forced("triton"):
            pool.plan(requests(pool, g, 3, 2))
    for name in STATE:
        getattr(ref, name).copy_(getattr(pool, name))
    resident = pool.resident[: pool.num_keys].view(3, 31, 3)
    held = torch.nonzero((resident >= 0).any(0).any(-1))[:, 0].tolist()
    blocks = torch.tensor(held[:3] + [held[0]] + [29], dtype=torch.int64, device=DEVICE)
    assert len(held) > 3 and (pool.owner[: pool.num_slots] >= 0).any()
    with forced("torch"):
        ref.invalidate(blocks)
    with forced("triton"):
        pool.invalidate(blocks)
    for name in ("resident", "owner", "last_use"):
        assert torch.equal(getattr(pool, name), getattr(ref, name)), name
    gone = pool.resident[: pool.num_keys].view(3, 31, 3)[:, blocks.cpu().tolist()]
    assert (gone == -1).all() and (resident[:, held[3:]] >= 0).any()  # only those blocks left
    pool.check()


def test_triton_plan_empty_and_padding_only():
    """A call without requests, or only padding, still advances the clock and counts a layer step."""
    pool, ref = make(1, 4, 1, 4, 4), make(1, 4, 1, 4, 4)
    for key in (
        torch.empty(0, dtype=torch.int64, device=DEVICE),
        torch.full((5,), pool.trash_key, dtype=torch.int64, device=DEVICE),
    ):
        compare_step(pool, ref, key)
    assert pool.clock.item() == 2 and pool.stats.tolist() == [0, 0, 0, 2]


@gpu_only
def test_triton_plan_cuda_graph():
    """Captured once, replayed on new requests: each replay equals the reference from the same state."""
    g = torch.Generator().manual_seed(0)
    pool, ref = make(2, 64, 2, 96, 8), make(2, 64, 2, 96, 8)
    key = requests(pool, g, 12, 4)
    pool.plan(key)  # warm-up (compiles the kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loc, load = pool.plan(key)
    for _ in range(6):
        key.copy_(requests(pool, g, 12, 4))
        for name in STATE:
            getattr(ref, name).copy_(getattr(pool, name))
        before = pool.resident[key].clone()
        with forced("torch"):
            loc_r, load_r = ref.plan(key)
        graph.replay()
        hit = (key != pool.trash_key) & (before >= 0)
        assert torch.equal(loc[hit], loc_r[hit])
        assert torch.equal(load[load >= 0].sort().values, load_r[load_r >= 0].sort().values)
        assert torch.equal(pool.stats, ref.stats) and torch.equal(pool.last_use, ref.last_use)
        pool.check()


def lists(
    g: torch.Generator, rows: int, slots: int, hkv: int, cap: int, blocks: int, shared: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's decode lists: sel [slots, hkv, cap] (-1 padded, some entries inside the local window or past
    the context), each row's state slot (the last row a padding row, slot -1), token block tables whose first
    `shared` blocks are the same token blocks in every row (a prefix-cache hit: rows list the same head blocks)
    and context lengths."""
    sel = torch.full((slots, hkv, cap), -1, dtype=torch.int32)
    row_slots = torch.randperm(slots, generator=g)[:rows].to(torch.int32)
    row_slots[-1] = -1
    own = (blocks - shared) // rows  # each row's own token blocks, after the shared ones
    perm = torch.randperm(blocks - shared, generator=g)[: rows * own].view(rows, own) + shared
    tables = torch.cat([torch.arange(shared).expand(rows, shared), perm], 1)
    width = shared + own
    seq_lens = torch.randint(0, width * 4, (rows,), generator=g, dtype=torch.int32)  # block size 4
    for s in row_slots[:-1].tolist():
        for h in range(hkv):
            n = int(torch.randint(1, min(cap, width) + 1, (1,), generator=g))
            sel[s, h, :n] = torch.randperm(width, generator=g)[:n].to(torch.int32)
    return sel.to(DEVICE), row_slots.to(DEVICE), tables.to(torch.int32).to(DEVICE), seq_lens.to(DEVICE)


@pytest.mark.parametrize(
    "hkv, cap, slots, ways, bypasses, shared",
    [
        (2, 6, 16, 4, True, 3),  # a pool far smaller than a step's lists: bypass reads every step
        (3, 5, 96, 8, False, 3),  # group 3 (SmolLM2's 3 KV heads of 9 query heads), room for two steps' lists
        (1, 10, 40, 8, False, 0),  # one KV head, longer lists, no shared blocks
    ],
)
def test_triton_read_matches_reference(hkv, cap, slots, ways, bypasses, shared):
    """pool_read (list keys, one plan per distinct key, FlashH2D, repeats resolved, the working-set count) on the
    Triton kernels against the torch reference from the same state, over steps with repeats across rows (shared prefix
    blocks), padding rows, entries inside the local window and bypass reads: every entry reads the host's
    block, the hits, victims, bypass reads per set, statistics and clock stamps are the reference's."""
    from sparseserve.kernels.sparse_decode import read_listed_ref
    from sparseserve.kvcache.host import HostKVStore

    g = torch.Generator().manual_seed(hkv * 10 + cap)
    layers, blocks, local, bs = 2, 48, 1, 4
    host = HostKVStore(layers, blocks, hkv, bs, 4, torch.float32, pin=ON_GPU)
    host.data.copy_(torch.randn(host.data.shape, generator=g))
    pool = HBMPool(layers, blocks, hkv, bs, 4, slots, torch.float32, DEVICE, ways=ways)
    ref = HBMPool(layers, blocks, hkv, bs, 4, slots, torch.float32, DEVICE, ways=ways)
    touch, touch_r = (
        TouchState(
            torch.full((pool.num_keys + 1,), -1, dtype=torch.int64, device=DEVICE),
            torch.zeros(8, 3, dtype=torch.int32, device=DEVICE),
            torch.zeros(8, dtype=torch.int64, device=DEVICE),
            torch.zeros(1, dtype=torch.int64, device=DEVICE),
        )
        for _ in range(2)
    )
    repeats = bypass = 0
    step_lists = {}
    for step in range(12):
        layer = step % layers
        if step % 4 < 2:  # new lists, read again two steps later (hits)
            step_lists[layer] = lists(g, 5, 8, hkv, cap, blocks, shared)
        sel, row_slots, tables, seq_lens = step_lists[layer]
        for name in STATE:
            getattr(ref, name).copy_(getattr(pool, name))
        ref.slots.copy_(pool.slots)
        for a, b in zip(touch, touch_r):
            a.copy_(b)
        if layer == 0:
            for t in (touch, touch_r):
                working_set_begin_step(t.hist, t.clock)
        before = pool.resident.clone()
        with forced("torch"):
            loc_r, key_r = ref.read(host.flat(), layer, sel, row_slots, tables, seq_lens, local, bs, touch_r)
        with forced("triton"):
            loc, key = pool.read(host.flat(), layer, sel, row_slots, tables, seq_lens, local, bs, touch)
        assert torch.equal(key, key_r)
        need = key != pool.trash_key
        step_repeats = int(need.sum()) - int(key[need].unique().numel())
        # The working-set count in the same pass: the reference's buckets and stamps (the trash stamp is
        # scratch). Rows listing the same block in one step each count it in the reference; the kernel's rows
        # race (the later one takes it over), so there a repeat may count once.
        if step_repeats:
            total, total_r = int(touch.hist.sum()), int(touch_r.hist.sum())
            assert total_r - step_repeats <= total <= total_r
        else:
            assert torch.equal(touch.hist, touch_r.hist) and torch.equal(touch.stamp[:-1], touch_r.stamp[:-1])
        with forced("torch"):
            assert torch.equal(
                key,
                list_keys(sel, row_slots, tables, seq_lens, ListLayout(layer, blocks, hkv, local, bs), pool.trash_key),
            )
        flat = host.flat()
        for p, lc in ((pool, loc), (ref, loc_r)):
            got = read_listed_ref((p.slots, flat, lc))
            assert torch.equal(got[need].cpu(), flat[key[need].cpu()])
            assert (lc[~need] == -1 - pool.trash_key).all()  # (view_loc of the trash key)
        hit = need & (before[key] >= 0)
        assert torch.equal(loc[hit], before[key][hit]) and torch.equal(loc_r[hit], before[key][hit])
        # as many loads; which misses of an overflowing set bypass follows the kernel's atomic ranks on a GPU
        assert int((loc >= 0).sum()) == int((loc_r >= 0).sum())
        sets = pool.set_of(key[need & (loc < 0)])
        assert torch.equal(
            torch.bincount(sets, minlength=pool.num_sets),
            torch.bincount(ref.set_of(key[need & (loc_r < 0)]), minlength=pool.num_sets),
        )
        for name in ("last_use", "clock", "stats"):
            assert torch.equal(getattr(pool, name), getattr(ref, name)), name
        pool.check()
        repeats += step_repeats
        bypass += int((need & (loc < 0)).sum())
    assert (repeats > 0) == (shared > 0) and pool.stats[0] > 0 and (bypass > 0) == bypasses  # the cases happened


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_read_moves_keys_out_of_several_buckets(seed):
    """The working-set count in pool_read when a row's keys were last touched by several slots and steps (most
    by one: the kernel moves those in one atomic, the rest one by one): buckets and stamps equal the reference's."""
    g = torch.Generator().manual_seed(seed)
    hkv, cap, slots, blocks, window, num_slots = 2, 8, 64, 48, 3, 8
    from sparseserve.kvcache.host import HostKVStore

    host = HostKVStore(1, blocks, hkv, 4, 4, torch.float32, pin=ON_GPU)
    pools = [HBMPool(1, blocks, hkv, 4, 4, slots, torch.float32, DEVICE, ways=8) for _ in range(2)]
    sel, row_slots, tables, seq_lens = lists(g, 4, num_slots, hkv, cap, blocks, 0)
    n = pools[0].num_keys + 1
    clock = 5
    # a previous touch for most keys: mostly by the row's own slot one step back, else any slot up to 4 steps back
    own = torch.zeros(n, dtype=torch.long)
    for r in range(3):  # (the last row pads)
        keys = pools[0].keys(0, tables[r].cpu()[sel[int(row_slots[r])].cpu().clamp_min(0).long()])
        own[keys.reshape(-1)] = int(row_slots[r])
    step0 = torch.where(torch.rand(n, generator=g) < 0.6, clock - 1, clock - torch.randint(1, 5, (n,), generator=g))
    owner = torch.where(torch.rand(n, generator=g) < 0.6, own, torch.randint(0, num_slots, (n,), generator=g))
    stamp = torch.where(torch.rand(n, generator=g) < 0.9, step0 * num_slots + owner, -1)
    since = torch.randint(0, 3, (num_slots,), generator=g)
    hist = torch.randint(50, 100, (num_slots, window), generator=g, dtype=torch.int32)
    states = [
        TouchState(*(t.clone().to(DEVICE) for t in (stamp, hist, since)), torch.tensor([clock], device=DEVICE))
        for _ in range(2)
    ]
    for pool, touch, backend in zip(pools, states, ("torch", "triton")):
        with forced(backend):
            pool.read(host.flat(), 0, sel, row_slots, tables, seq_lens, 1, 4, touch)
    assert not torch.equal(states[1].hist.cpu(), hist)  # keys moved
    assert torch.equal(states[1].hist, states[0].hist) and torch.equal(states[1].stamp[:-1], states[0].stamp[:-1])


@pytest.mark.parametrize("defer, views", [(False, True), (True, True), (True, False)])
def test_triton_read_of_several_layers_matches_reference(defer, views):
    """One read of every layer's lists at once (sel [L, S, Hkv, cap], lagged selection's plan of a step): the
    keys are each layer's, every entry reads the host's block, and hits, loads, stamps and statistics (a layer step
    per layer) are the reference's. defer: no slot is written until the caller's FlashH2D of `load`, layer by
    layer; the views (repeats included) already name the slots. views=False (the prefetching reads' plan): no
    views, the same plan and loads (the views are then looked up after the loads), the misses' keys, and a hit
    listed twice (a shared prefix) counts twice, in the reference as in the kernels."""
    from sparseserve.kernels.flash_h2d import flash_h2d_ref
    from sparseserve.kernels.pool_plan import list_keys
    from sparseserve.kernels.sparse_decode import read_listed_ref
    from sparseserve.kvcache.host import HostKVStore

    g = torch.Generator().manual_seed(3)
    layers, blocks, local, bs, hkv, cap = 3, 48, 1, 4, 2, 5
    host = HostKVStore(layers, blocks, hkv, bs, 4, torch.float32, pin=ON_GPU)
    host.data.copy_(torch.randn(host.data.shape, generator=g))
    pool = HBMPool(layers, blocks, hkv, bs, 4, 64, torch.float32, DEVICE, ways=8)
    ref = HBMPool(layers, blocks, hkv, bs, 4, 64, torch.float32, DEVICE, ways=8)
    for step in range(6):
        if step % 2 == 0:  # new lists, read again the next step (hits)
            sel, row_slots, tables, seq_lens = lists(g, 5, 8, hkv, cap, blocks, 2)
            sel = torch.stack([sel, sel.roll(1, 0)])  # layers 1 and 2: other lists, same rows
        for name in STATE:
            getattr(ref, name).copy_(getattr(pool, name))
        ref.slots.copy_(pool.slots)
        before, slots_before = pool.resident.clone(), pool.slots.clone()
        with forced("torch"):
            loc_r, key_r, *load_r = ref.read(
                host.flat(), 1, sel, row_slots, tables, seq_lens, local, bs, defer=defer, views=views
            )
        with forced("triton"):
            loc, key, *load = pool.read(
                host.flat(), 1, sel, row_slots, tables, seq_lens, local, bs, defer=defer, views=views
            )
        assert key.shape == (2, row_slots.numel(), hkv, cap)
        if views:
            assert torch.equal(key, key_r)
        else:  # the kernels keep the misses' keys only
            missing = (key_r != pool.trash_key) & (before[key_r] < 0)
            assert torch.equal(key[missing], key_r[missing])
            key = key_r
        if defer:
            assert torch.equal(pool.slots, slots_before)  # nothing loaded yet
            (loads,), (loads_r,) = load, load_r
            assert torch.equal(loads[2], loads_r[2])  # each layer's loads, listed apart
            slots_of = [torch.cat([ld[i, : int(c[i])] for i in range(2)]) for _, ld, c in (loads, loads_r)]
            assert torch.equal(*(v.sort().values for v in slots_of))  # the same victims (atomic order pairs them)
            for i in range(2):
                n = int(loads[2][i])
                for p, (lk, ld, _) in ((pool, loads), (ref, loads_r)):  # the installs of layer i only
                    assert (ld[i, :n] >= 0).all() and torch.equal(p.resident[lk[i, :n]], ld[i, :n])
                    assert (lk[i, :n] // ((blocks + 1) * hkv) == 1 + i).all()
            for p, (lk, ld, count) in ((pool, loads), (ref, loads_r)):
                for i in range(2):  # the caller's loads, a layer at a time
                    flash_h2d_ref(host.flat(), p.slots, lk[i], ld[i], count[i : i + 1])
        with forced("torch"):
            for i in range(2):
                assert torch.equal(
                    key[i],
                    list_keys(
                        sel[i], row_slots, tables, seq_lens, ListLayout(1 + i, blocks, hkv, local, bs), pool.trash_key
                    ),
                )
        need = key != pool.trash_key
        if not views:
            assert loc is None and loc_r is None
            loc, loc_r = (view_loc(p.resident[key], key) for p in (pool, ref))  # the lookups' view
        for p, lc in ((pool, loc), (ref, loc_r)):
            assert torch.equal(read_listed_ref((p.slots, host.flat(), lc))[need].cpu(), host.flat()[key[need].cpu()])
        hit = need & (before[key] >= 0)
        assert torch.equal(loc[hit], before[key][hit]) and int((loc >= 0).sum()) == int((loc_r >= 0).sum())
        for name in ("last_use", "clock", "stats"):
            assert torch.equal(getattr(pool, name), getattr(ref, name)), name
        pool.check()
    assert pool.stats[0] > 0 and pool.stats[1] > 0 and pool.stats[3] == 12


def test_lookup_reads_every_listed_block_and_plans_nothing():
    """pool_lookup_ref (the prefetching read; on the GPU topp's lse kernel does it: tests/kernels/test_topp_prune.py):
    after a plan of some lists filled part of the pool, the lookup of other lists (padding row, entries inside
    the window or past the context, shared prefix blocks): every listed entry reads the host's block through its
    view (pool slot or host row), unlisted ones name the trash key, the counts are (found, not found), and the
    pool's state is untouched."""
    from sparseserve.kernels.sparse_decode import read_listed_ref
    from sparseserve.kvcache.host import HostKVStore

    g = torch.Generator().manual_seed(11)
    hkv, cap, layers, blocks, local, bs = 3, 6, 2, 48, 1, 4
    host = HostKVStore(layers, blocks, hkv, bs, 4, torch.float32, pin=ON_GPU)
    host.data.copy_(torch.randn(host.data.shape, generator=g))
    pool = HBMPool(layers, blocks, hkv, bs, 4, 40, torch.float32, DEVICE, ways=8)
    sel, row_slots, tables, seq_lens = lists(g, 5, 8, hkv, cap, blocks, 3)
    with forced("torch"):  # the prefetch: half the lists' rows
        pool.read(host.flat(), 1, sel, torch.where(row_slots % 2 == 0, row_slots, -1), tables, seq_lens, local, bs)
    state = {name: getattr(pool, name).clone() for name in STATE}
    lay = ListLayout(1, blocks, hkv, local, bs)
    stats = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    loc = pool_lookup_ref(sel, row_slots, tables, seq_lens, lay, pool.resident, stats)
    for name, t in state.items():
        assert torch.equal(getattr(pool, name), t), name
    with forced("torch"):
        key = list_keys(sel, row_slots, tables, seq_lens, lay, pool.trash_key)
    need = key != pool.trash_key
    flat = host.flat()
    got = read_listed_ref((pool.slots, flat, loc))
    assert torch.equal(got[need].cpu(), flat[key[need].cpu()]) and (loc[~need] == -1 - pool.trash_key).all()
    hits, misses = int((need & (loc >= 0)).sum()), int((need & (loc < 0)).sum())
    assert hits > 0 and misses > 0  # both cases happened
    assert stats.tolist() == [hits, misses]
