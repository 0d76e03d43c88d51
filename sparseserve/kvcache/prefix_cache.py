"""Automatic prefix caching: which full token blocks hold which tokens (docs/architecture.md,
principle 7; docs/prefix_cache.md).

A full block is named by SHA-256 over its parent's hash and its token ids, the first block's
parent derived from the request's `cache_salt`. The trap: never Python's `hash`, since a
collision would serve another prompt's K/V. `PrefixCache` is the hash -> block map and the LRU of
cached blocks no one references; the allocator (kvcache/blocks.py) owns the reference counts.
A cached block is full and never written again, so sharing needs no copy.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

BlockHash = bytes


def root_hash(cache_salt: str | None) -> BlockHash:
    """The parent hash of a request's first block: one per salt (no salt: the shared root)."""
    h = hashlib.sha256(b"sparseserve:prefix-root")
    if cache_salt is not None:
        h.update(b"salt:" + cache_salt.encode("utf-8"))
    return h.digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """SHA-256 of the parent's 32-byte hash and the block's token ids as int64 (unambiguous)."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, num_blocks: int, cache_salt: str | None
) -> list[BlockHash]:
    """Appends to `hashes` (in place; returned) the hashes of full blocks len(hashes) ..
    num_blocks - 1 of token_ids. A sequence's tokens only grow, so the hashes of its full blocks
    never change."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    parent = hashes[-1] if hashes else root_hash(cache_salt)
    for j in range(len(hashes), num_blocks):
        parent = hash_block(parent, token_ids[j * block_size : (j + 1) * block_size])
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Hash -> cached block, and the unreferenced cached blocks in least-recently-freed order."""

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # first = least recently freed
        self.num_evictions = 0

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix block, referenced or not."""
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of.get(block)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the longest cached prefix of a chain of block hashes."""
        hit = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def insert(self, block: int, h: BlockHash) -> bool:
        """Caches a block that just became full. False (and nothing cached) when another block
        already holds the same tokens (two requests computed the same block at once): block
        tables are append-only, so the duplicate stays private to its sequence and is freed like
        an uncached block."""
        if h in self._block_of or block in self._hash_of:
            return False
        self._block_of[h] = block
        self._hash_of[block] = h
        return True

    def park(self, block: int) -> None:
        """A cached block's last reference was dropped: the most recently freed evictable block."""
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """A request hit a cached free block: it is referenced again, no longer evictable."""
        del self._evictable[block]

    def evict(self) -> tuple[int, BlockHash]:
        """Forgets the least recently freed evictable block; returns it (now free) and its hash."""
        block, _ = self._evictable.popitem(last=False)
        h = self._hash_of.pop(block)
        del self._block_of[h]
        self.num_evictions += 1
        return block, h

    def clear(self) -> list[int]:
        """Forgets every evictable block (returned; referenced blocks stay cached)."""
        blocks = list(self._evictable)
        self._evictable.clear()
        for b in blocks:
            del self._block_of[self._hash_of.pop(b)]
        return blocks

    def check(self) -> None:
        assert len(self._block_of) == len(self._hash_of)
        assert all(self._hash_of[b] == h for h, b in self._block_of.items()), "hash map not inverse"
        assert all(b in self._hash_of for b in self._evictable), "an evictable block is not cached"
