"""Token-block allocation: a request owns token blocks (every layer and KV head of block_size
tokens). With prefix caching (docs/prefix_cache.md) blocks are reference-counted and a cached block
without references stays cached until needed: new blocks come from never-cached free blocks first,
then the least recently freed cached ones. Invariant: every block is free, evictable (cached, no
reference) or in use, so free + evictable + in use == total.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from sparseserve.kvcache.prefix_cache import BlockHash, PrefixCache


class BlockAllocator:
    """Reference-counted free-list allocator, with an optional prefix cache over its full blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._num_used = 0
        self.cache: PrefixCache | None = PrefixCache() if enable_caching else None

    @property
    def enable_caching(self) -> bool:
        return self.cache is not None

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take now: the free ones and the evictable cached ones."""
        return len(self._free) + self.num_evictable

    @property
    def num_evictable(self) -> int:
        return self.cache.num_evictable if self.cache is not None else 0

    @property
    def num_cached(self) -> int:
        return self.cache.num_cached if self.cache is not None else 0

    @property
    def num_evictions(self) -> int:
        return self.cache.num_evictions if self.cache is not None else 0

    @property
    def num_used(self) -> int:
        return self._num_used

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n blocks with one reference each: never-cached free blocks first, then evicted cached
        ones (the least recently freed), in ascending order: evicted blocks come tail first, and a
        prompt's ascending ids are runs the host store's per-layer copies take whole (kvcache/host.py
        LayerD2H). Callers that keep per-block state elsewhere learn of the reuse from the returned
        ids (OffloadSpace.on_allocate)."""
        if n > self.num_free:
            raise RuntimeError(f"out of KV blocks: asked for {n}, {self.num_free} free")
        blocks = []
        for _ in range(n):
            b = self._free.popleft() if self._free else self.cache.evict()[0]
            self._ref[b] = 1
            blocks.append(b)
        self._num_used += n
        return sorted(blocks)

    def share(self, blocks: Sequence[int]) -> None:
        """One more reference to each of these cached blocks (a prefix-cache hit); evictable ones
        leave the eviction order."""
        for b in blocks:
            if self._ref[b] == 0:
                if self.cache is None or not self.cache.is_evictable(b):
                    raise RuntimeError(f"KV block {b} is free and not cached: it cannot be shared")
                self.cache.unpark(b)
                self._num_used += 1
            self._ref[b] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drops one reference to each block. A block left without references becomes free, or
        evictable if cached; a sequence's blocks are given in table order and parked tail first,
        so a prefix outlives its continuations in the eviction order."""
        released = []
        for b in blocks:
            if self._ref[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                released.append(b)
        self._num_used -= len(released)
        for b in reversed(released):
            if self.cache is not None and self.cache.is_cached(b):
                self.cache.park(b)
        self._free.extend(b for b in released if self.cache is None or not self.cache.is_cached(b))

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the longest cached prefix of a hash chain (none without caching)."""
        return self.cache.lookup(hashes) if self.cache is not None else []

    def cache_block(self, block: int, h: BlockHash) -> bool:
        """Offers a just-full (referenced) block to the prefix cache; False: not cached."""
        if self.cache is None:
            return False
        assert self._ref[block] > 0, f"KV block {block} is cached while free"
        return self.cache.insert(block, h)

    def reset_prefix_cache(self) -> int:
        """Forgets every unreferenced cached block (benchmarks start cold); returns how many."""
        if self.cache is None:
            return 0
        blocks = self.cache.clear()
        self._free.extend(blocks)
        return len(blocks)

    def check(self) -> None:
        """Accounting invariants (tests): every block in exactly one state, no negative count, no
        referenced block evictable, the free list without duplicates or cached blocks."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice on the free list"
        assert all(r >= 0 for r in self._ref), "negative reference count"
        used = {b for b, r in enumerate(self._ref) if r > 0}
        assert len(used) == self._num_used, "used count out of step with the reference counts"
        assert not used & free, "a referenced block is on the free list"
        evictable = set(self.cache._evictable) if self.cache is not None else set()
        assert not evictable & used, "a referenced block is evictable"
        assert not evictable & free
        assert len(free) + len(evictable) + len(used) == self.num_blocks, "KV block leak"
        if self.cache is not None:
            self.cache.check()
            assert not any(self.cache.is_cached(b) for b in free), "a free block is still cached"


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
