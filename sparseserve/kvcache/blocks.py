"""Token-block allocation: a request owns token blocks (every layer and KV head of block_size tokens)."""
from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Free-list allocator with an accounting invariant: free + used == total, no block twice."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: asked for {n}, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise RuntimeError(f"double free of KV block {b}")
            self._used.remove(b)
            self._free.append(b)

    def check(self) -> None:
        assert len(self._free) + len(self._used) == self.num_blocks, "KV block leak"
        assert len(set(self._free)) == len(self._free) and not self._used.intersection(self._free)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class DeviceBlockMap:
    """kv_offload: the device KV cache holds only each sequence's working set (DESIGN.md principle 4).

    Token blocks (the scheduler's BlockAllocator) are host store rows, metadata rows and HBM pool keys;
    device blocks are rows of the smaller device KV cache. A sequence maps a contiguous range of its token
    blocks to device blocks (Sequence.device_start, Sequence.device_blocks):
      - a step that prefills (more than one new token, or one token that is not the last one to compute)
        needs every block of the sequence: dense prefill attention reads all earlier blocks;
      - a decode (the one token left) needs the local window only (the last `local_blocks` blocks, tail
        included): the sparse kernel reads every other listed block through the HBM pool or the host store.
    Blocks leaving that range are released when the step is scheduled. The range only moves forward (a
    sequence never prefills after decoding unless preempted, which releases everything), so no block is
    ever loaded back into the device cache.

    Why releasing at scheduling time is safe: a released block left the window, so it is full and was
    written in an earlier step; the runner calls HostKVStore.fence() before it launches a step's kernels
    (every FlashD2H copy and write-through of earlier steps is in the store), and the step reads the block
    through the pool / host row only, so a new owner may overwrite the device block in that same step."""

    def __init__(self, num_blocks: int, local_blocks: int, block_size: int, token_blocks: int) -> None:
        self.allocator = BlockAllocator(num_blocks)
        self.token_blocks = token_blocks
        self.local_blocks = local_blocks
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def hot_range(self, seq, n: int) -> tuple[int, int]:
        """Token-block indices [lo, hi) that must be on the device for a step computing n new tokens."""
        c = seq.num_computed_tokens
        hi = blocks_needed(c + n, self.block_size)
        decode = n == 1 and c + 1 == seq.num_tokens
        return (max(hi - self.local_blocks, 0) if decode else 0), hi

    def num_to_allocate(self, seq, n: int) -> int:
        """Device blocks this step takes from the free list, net of what the sequence itself releases."""
        lo, hi = self.hot_range(seq, n)
        start, held = seq.device_start, len(seq.device_blocks)
        missing = hi - max(lo, start + held) if held else hi - lo
        releasable = min(max(lo - start, 0), held)
        return missing - releasable

    def can_map(self, seq, n: int) -> bool:
        return self.allocator.can_allocate(max(self.num_to_allocate(seq, n), 0))

    def can_admit(self, seq, running: list) -> bool:
        """Whether a waiting sequence may start: the device blocks its whole prefill will need fit next to
        what the running prefills still need (admitting a prompt whose later chunks cannot get their
        blocks would only preempt it again and recompute). Always true when the device space is as large
        as the token space: device blocks then never run out before token blocks do, and the schedule is
        the one without offload."""
        if self.num_blocks >= self.token_blocks:
            return True
        reserved = sum(self._prefill_rest(s) for s in running)
        return self.allocator.num_free - reserved >= blocks_needed(seq.num_tokens, self.block_size)

    def _prefill_rest(self, seq) -> int:
        """Device blocks a running sequence still has to map to finish its prefill."""
        if seq.num_computed_tokens + 1 >= seq.num_tokens:
            return 0
        return blocks_needed(seq.num_tokens, self.block_size) - seq.device_start - len(seq.device_blocks)

    def map(self, seq, n: int) -> list[int]:
        """Releases the sequence's device blocks before the step's range and maps the blocks it adds.
        Returns the released device blocks (already back on the free list)."""
        lo, hi = self.hot_range(seq, n)
        if not seq.device_blocks:
            seq.device_start = lo
        if lo < seq.device_start:
            raise RuntimeError(f"sequence {seq.seq_id} needs token block {lo} on the device again after "
                               f"releasing it (device range starts at {seq.device_start})")
        cut = min(lo - seq.device_start, len(seq.device_blocks))
        released: list[int] = []
        if cut:  # a decode's window moves once per block_size steps: most steps release nothing
            released = seq.device_blocks[:cut]
            self.allocator.free(released)
            seq.device_blocks = seq.device_blocks[cut:]
            seq.device_start += cut
            if not seq.device_blocks:
                seq.device_start = lo
        end = seq.device_start + len(seq.device_blocks)
        if hi > end:
            seq.device_blocks.extend(self.allocator.allocate(hi - end))
        return released

    def release(self, seq) -> None:
        self.allocator.free(seq.device_blocks)
        seq.device_blocks, seq.device_start = [], 0
