"""The prefix cache and the reference-counted token-block allocator on their own (kvcache/prefix_cache.py,
kvcache/blocks.py): hash chains and salts, sharing, LRU eviction of free cached blocks only, never-cached
blocks taken first, and the accounting over random operations against a plain model of the state."""

from __future__ import annotations

import random

import pytest

from sparseserve.kvcache.blocks import BlockAllocator
from sparseserve.kvcache.prefix_cache import extend_block_hashes, hash_block, root_hash


def chain(tokens: list[int], bs: int = 4, salt: str | None = None) -> list[bytes]:
    return extend_block_hashes([], tokens, bs, len(tokens) // bs, salt)


def test_hash_chain_and_salt():
    a = list(range(100, 112))
    h = chain(a)
    assert len(h) == 3 and len(set(h)) == 3 and all(len(x) == 32 for x in h)
    assert h == chain(a + [7, 8])  # a partial block gets no hash
    assert chain(a[:8]) == h[:2]  # a prefix's chain is a prefix of the chain
    b = [100, 101, 102, 999] + a[4:]
    assert chain(b)[0] != h[0] and chain(b)[1] != h[1]  # a changed block changes every later hash
    assert hash_block(h[0], a[4:8]) == h[1] and hash_block(root_hash(None), a[:4]) == h[0]
    assert chain(a, salt="tenant-1") != h and chain(a, salt="tenant-1") != chain(a, salt="tenant-2")
    assert chain(a, salt="tenant-1") == chain(a, salt="tenant-1")
    assert hash_block(h[0], [1, 2]) != hash_block(h[0], [1, 2, 0])  # widths are fixed: no ambiguity
    grown = chain(a[:4])
    assert extend_block_hashes(grown, a, 4, 3, None) is grown and grown == h  # extends in place


def test_share_evict_lru_tail_first_and_uncached_first():
    alloc = BlockAllocator(6, enable_caching=True)
    toks = list(range(12))
    hashes = chain(toks)
    table = alloc.allocate(3)
    for b, h in zip(table, hashes):
        assert alloc.cache_block(b, h)
    assert alloc.lookup(hashes) == table and alloc.lookup(chain([5] * 12)) == []
    other = alloc.allocate(1)
    assert not alloc.cache_block(other[0], hashes[0])  # the same tokens in a second block: stays private
    alloc.free(other)
    alloc.free(table)
    assert alloc.num_used == 0 and alloc.num_evictable == 3 and alloc.num_free == 6 and alloc.num_cached == 3
    alloc.check()
    hit = alloc.lookup(hashes[:2])
    alloc.share(hit)  # a hit on free cached blocks takes them off the eviction order
    assert alloc.num_evictable == 1 and alloc.num_used == 2 and alloc.ref_count(hit[0]) == 1
    alloc.share(hit[:1])
    assert alloc.ref_count(hit[0]) == 2
    alloc.check()
    fresh = alloc.allocate(3)  # three never-cached free blocks first: nothing evicted
    assert not set(fresh) & set(table) and alloc.num_evictions == 0
    assert alloc.allocate(1) == [table[2]] and alloc.num_evictions == 1  # then the evictable one
    assert alloc.lookup(hashes) == table[:2]
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        alloc.allocate(1)  # the referenced cached blocks are never evicted
    alloc.free(hit)
    alloc.free(hit[:1])
    alloc.free(fresh)
    assert alloc.num_evictable == 2
    # Freed in table order, parked tail first: the chain's last block is evicted before its first.
    got = alloc.allocate(4)  # the three free blocks, then one evicted: the tail
    assert table[1] in got and table[0] not in got and alloc.lookup(hashes) == [table[0]]
    assert got == sorted(got)  # ascending ids (runs for the host store's copies)
    assert alloc.allocate(1) == [table[0]] and alloc.lookup(hashes) == []
    alloc.check()
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(got[:1] * 2)


def test_share_refuses_a_free_uncached_block_and_reset():
    alloc = BlockAllocator(4, enable_caching=True)
    with pytest.raises(RuntimeError, match="cannot be shared"):
        alloc.share([0])
    b = alloc.allocate(2)
    alloc.cache_block(b[0], chain([1, 2, 3, 4])[0])
    alloc.free(b)
    assert alloc.num_evictable == 1 and alloc.reset_prefix_cache() == 1
    assert alloc.num_cached == 0 and alloc.num_free == 4
    alloc.check()
    plain = BlockAllocator(4)
    x = plain.allocate(2)
    assert not plain.cache_block(x[0], b"h" * 32) and plain.lookup([b"h" * 32]) == []
    plain.free(x)
    plain.check()


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_against_a_model(seed):
    """Random allocate / cache / share / free against a plain model: reference counts as held, no referenced
    block ever evicted (its hash stays), every block in exactly one state, the cache's map consistent."""
    rng = random.Random(seed)
    alloc = BlockAllocator(24, enable_caching=True)
    holders: list[list[int]] = []  # each a table of blocks it holds one reference to
    hash_of: dict[int, bytes] = {}  # what we cached and expect to stay while referenced
    for step in range(600):
        op = rng.random()
        if op < 0.35 and alloc.num_free:
            blocks = alloc.allocate(rng.randint(1, min(4, alloc.num_free)))
            for b in blocks:
                hash_of.pop(b, None)  # reused: an evicted block's hash is gone
                if rng.random() < 0.6:
                    h = bytes([rng.randrange(12)]) * 32  # few distinct contents: duplicates happen
                    if alloc.cache_block(b, h):
                        hash_of[b] = h
            holders.append(blocks)
        elif op < 0.55 and hash_of:
            h = rng.choice(sorted(set(hash_of.values())))
            hit = alloc.lookup([h])
            if hit:
                alloc.share(hit)
                holders.append(hit)
        elif holders:
            alloc.free(holders.pop(rng.randrange(len(holders))))
        held = [b for t in holders for b in t]
        assert all(alloc.ref_count(b) == held.count(b) for b in set(held))
        assert alloc.num_used == len(set(held))
        for b in set(held):
            if b in hash_of:
                assert alloc.cache.hash_of(b) == hash_of[b], "a referenced block lost its cached contents"
        alloc.check()
    for t in holders:
        alloc.free(t)
    assert alloc.num_used == 0 and alloc.num_free == 24
    alloc.check()
