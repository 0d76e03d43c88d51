"""The HBM pool plan's Triton kernels (kernels/pool_plan.py; TRITON_INTERPRET on CPU) against the torch
reference pool_plan_ref, step by step from the same state: the hits and their slots, the victims
chosen in each set, the bypass reads per set, the LRU clock stamps, the statistics and the invariants
are the reference's; only which miss of a set gets which victim may differ (atomic ranks on a GPU)."""
from __future__ import annotations

import random

import pytest
import torch

from sparseserve.kernels.dispatch import forced
from sparseserve.kvcache.pool import HBMPool
from tests.kernel_utils import DEVICE, gpu_only

STATE = ("resident", "owner", "last_use", "clock", "stats")


def make(layers: int, blocks: int, hkv: int, slots: int, ways: int) -> HBMPool:
    return HBMPool(layers, blocks, hkv, 2, 4, slots, torch.float32, DEVICE, ways=ways)


def requests(pool: HBMPool, g: torch.Generator, per_head: int, batch: int) -> torch.Tensor:
    """Keys of one layer's step: `batch` sequences x Hkv heads x per_head blocks, -1 padding; sequences
    own distinct blocks (each key at most once a call, as plan requires)."""
    layer = int(torch.randint(pool.num_keys // ((pool.num_blocks + 1) * pool.num_kv_heads), (1,), generator=g))
    pad = batch * per_head // 4
    heads = [torch.randperm(pool.num_blocks + pad, generator=g)[: batch * per_head] - pad  # < 0: padding
             for _ in range(pool.num_kv_heads)]
    blocks = torch.stack(heads).clamp_min(-1).view(pool.num_kv_heads, batch, per_head).transpose(0, 1)
    return pool.keys(layer, blocks.to(DEVICE)).reshape(-1)


def compare_step(pool: HBMPool, ref: HBMPool, key: torch.Tensor) -> int:
    """One plan of `pool` (Triton) against the reference plan of `ref` started from the same state; returns the
    step's bypass reads."""
    for name in STATE:
        getattr(ref, name).copy_(getattr(pool, name))
    before = pool.resident[key].clone()
    with forced("torch"):
        loc_r, load_r = ref.plan(key)
    with forced("triton"):
        loc, load = pool.plan(key)
    need = key != pool.trash_key
    hit, miss = need & (before >= 0), need & (before < 0)
    for lc, ld in ((loc, load), (loc_r, load_r)):
        assert torch.equal(lc[hit], before[hit]) and (ld[hit] == -1).all() and (lc[~need] == -1).all()
        assert torch.equal(lc[miss], ld[miss])
    assert torch.equal(load[load >= 0].sort().values, load_r[load_r >= 0].sort().values)  # same victims
    sets = pool.set_of(key)
    bypass = miss & (loc < 0)
    assert torch.equal(torch.bincount(sets[bypass], minlength=pool.num_sets),
                       torch.bincount(sets[miss & (loc_r < 0)], minlength=pool.num_sets))
    assert torch.equal(pool.resident[key[load >= 0]], load[load >= 0])  # installed where loaded
    for name in ("last_use", "clock", "stats"):
        assert torch.equal(getattr(pool, name), getattr(ref, name)), name
    kept = torch.ones(pool.num_slots + 1, dtype=torch.bool, device=key.device)
    kept[load[load >= 0]] = False
    assert torch.equal(pool.owner[kept], ref.owner[kept])  # slots no miss took are untouched
    pool.check()
    return int(bypass.sum())


@pytest.mark.parametrize("slots, ways, per_head, batch, bypasses, hkv", [
    (8, 4, 6, 2, True, 2),      # two sets: many misses per set, bypass reads every step
    (6, 8, 3, 2, True, 2),      # ways clipped to 6 slots: one set, ways not a power of two
    (1, 8, 2, 2, True, 2),      # a single slot
    (64, 8, 10, 8, True, 2),    # 160 requests: several programs in kernel 2
    (16, 8, 3, 1, False, 2),    # few misses per set: which free / equally old ways go first matters
    pytest.param(24, 8, 4, 3, True, 3, id="group-3kv"),  # 3 KV heads (SmolLM2): keys of (layer, block, head)
])
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


def test_triton_plan_empty_and_padding_only():
    """A call without requests, or only padding, still advances the clock and counts a layer step."""
    pool, ref = make(1, 4, 1, 4, 4), make(1, 4, 1, 4, 4)
    for key in (torch.empty(0, dtype=torch.int64, device=DEVICE),
                torch.full((5,), pool.trash_key, dtype=torch.int64, device=DEVICE)):
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
