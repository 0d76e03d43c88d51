"""The scheduler's block accounting: token blocks (allocator, prefix cache, its host tier), the
KV-offload device block space, and the admission estimate (docs/scheduler.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from sparseserve.config import SchedulerConfig
from sparseserve.engine.request import Sequence
from sparseserve.kvcache.blocks import BlockAllocator, blocks_needed
from sparseserve.kvcache.prefix_cache import extend_block_hashes

# The admission estimate counts at most this many outputs of a request.
RESERVE_CLIP_TOKENS = 4096


class DeviceSpace(Protocol):
    """A second, smaller block space a step must also fit (KV offload: kvcache/device_space.py)."""

    def can_schedule(self, seq: Sequence, n: int) -> bool: ...
    def steady_decode(self, seq: Sequence) -> bool: ...  # fits, and `schedule` would do nothing
    def can_admit(self, seq: Sequence, running: list[Sequence]) -> bool: ...
    def schedule(self, seq: Sequence, n: int) -> None: ...
    def free(self, seq: Sequence) -> None: ...
    def pause(self, seq: Sequence) -> None: ...
    def on_allocate(self, blocks: list[int]) -> None: ...
    def take_plan(self, scheduled: list) -> Any: ...  # the step's work for the runner (OffloadPlan)
    def gauges(self) -> dict[str, float]: ...
    # layer-segmented prefill: only its first decode's window is on the device
    def can_admit_segmented(self, seq: Sequence, running: list[Sequence]) -> bool: ...
    def schedule_segmented(self, seq: Sequence) -> None: ...


class HostCache(Protocol):
    """The prefix cache's host tier without KV offload (kvcache/host_cache.py)."""

    def lookup(self, hashes: list[bytes]) -> int: ...
    def restore(self, blocks: list[int], hashes: list[bytes]) -> None: ...
    def store(self, blocks: list[int], hashes: list[bytes]) -> None: ...


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up and found at first admissions, per tier (vLLM's meaning)."""

    queries: int = 0
    hits: int = 0
    host_queries: int = 0
    host_hits: int = 0


class PrefixHit(NamedTuple):
    blocks: list[int]  # cached token blocks of the prompt's prefix
    host: int  # blocks after them found in the host tier
    parked: int  # of `blocks`, those no one holds (they leave the free list when taken)

    def computed(self, block_size: int) -> int:
        return (len(self.blocks) + self.host) * block_size


class KVCacheManager:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: BlockAllocator,
        block_size: int,
        *,
        device_space: DeviceSpace | None = None,
        host_cache: HostCache | None = None,
        max_model_len: int | None = None,
        min_chunk: int = 1,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.block_size = block_size
        self.device_space = device_space
        self.host_cache = host_cache
        self.max_model_len = max_model_len
        self.min_chunk = min_chunk
        self.prefix_stats = PrefixCacheStats()
        self.new_token_ratio = config.init_new_token_ratio
        self._decay = (config.init_new_token_ratio - config.min_new_token_ratio) / config.new_token_ratio_decay_steps

    # ---- prefix cache ---------------------------------------------------------------------------

    def prompt_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of the blocks a hit may cover: full blocks leaving >= min_chunk tokens."""
        if not self.allocator.enable_caching:
            return []
        bs = self.block_size
        limit = max(seq.num_tokens - self.min_chunk, 0) // bs
        return extend_block_hashes(seq.block_hashes, seq.token_ids, bs, limit, seq.cache_salt)[:limit]

    def lookup(self, seq: Sequence, host: bool = True) -> PrefixHit:
        alloc = self.allocator
        hashes = self.prompt_hashes(seq)
        hit = alloc.lookup(hashes)
        tier = self.host_cache is not None and host and hit != hashes
        host_hit = self.host_cache.lookup(hashes[len(hit) :]) if tier else 0
        return PrefixHit(hit, host_hit, sum(1 for b in hit if alloc.ref_count(b) == 0))

    def admits(self, seq: Sequence, hit: PrefixHit, n: int, running: list[Sequence]) -> bool:
        """Whether a new sequence taking `hit` and computing n tokens fits (nothing changes)."""
        computed = hit.computed(self.block_size)
        need = blocks_needed(computed + n, self.block_size) - len(hit.blocks)
        if not self.allocator.can_allocate(need + hit.parked):
            return False
        if not self.fits_with_growth(seq, len(hit.blocks), hit.parked, running):
            return False
        seq.num_computed_tokens = computed  # what the device space reads
        if self.device_space is not None and not (
            self.device_space.can_admit(seq, running) and self.device_space.can_schedule(seq, n)
        ):
            seq.num_computed_tokens = 0
            return False
        return True

    def take(self, seq: Sequence, hit: PrefixHit) -> None:
        """Gives a new sequence its prefix-cache hit (host-tier blocks copied back)."""
        alloc = self.allocator
        alloc.share(hit.blocks)
        seq.block_table = list(hit.blocks)
        if hit.host:
            restored = alloc.allocate(hit.host)
            hashes = self.prompt_hashes(seq)[len(hit.blocks) : len(hit.blocks) + hit.host]
            self.host_cache.restore(restored, hashes)
            for b, h in zip(restored, hashes):
                alloc.cache_block(b, h)
            seq.block_table += restored
        seq.num_cached_blocks = len(seq.block_table)
        self.count_first_admission(seq, hit)

    def count_first_admission(self, seq: Sequence, hit: PrefixHit) -> None:
        if seq.num_cached_tokens is not None:  # re-admission after a preemption: not counted
            return
        bs = self.block_size
        seq.num_cached_tokens = hit.computed(bs)
        st = self.prefix_stats
        st.queries += seq.num_tokens
        st.hits += len(hit.blocks) * bs
        if self.host_cache is not None:
            st.host_queries += seq.num_tokens - len(hit.blocks) * bs
            st.host_hits += hit.host * bs

    def cache_full_blocks(self, seq: Sequence) -> None:
        """After a step: blocks its computed tokens filled join the prefix cache (and host tier)."""
        alloc, bs = self.allocator, self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if not alloc.enable_caching or full <= seq.num_cached_blocks:
            return
        hashes = extend_block_hashes(seq.block_hashes, seq.token_ids, bs, full, seq.cache_salt)
        fresh_blocks, fresh_hashes = [], []
        for j in range(seq.num_cached_blocks, full):
            if alloc.cache_block(seq.block_table[j], hashes[j]):
                fresh_blocks.append(seq.block_table[j])
                fresh_hashes.append(hashes[j])
        seq.num_cached_blocks = full
        if self.host_cache is not None and fresh_blocks:
            self.host_cache.store(fresh_blocks, fresh_hashes)

    # ---- a running sequence's blocks ------------------------------------------------------------

    def new_blocks(self, seq: Sequence, n: int) -> int:
        have = len(seq.block_table)
        return max(blocks_needed(seq.num_computed_tokens + n, self.block_size) - have, 0)

    def can_allocate(self, seq: Sequence, n: int) -> bool:
        return self.allocator.can_allocate(self.new_blocks(seq, n))

    def device_fits(self, seq: Sequence, n: int) -> bool:
        return self.device_space is None or self.device_space.can_schedule(seq, n)

    def steady_decode(self, seq: Sequence) -> bool:
        """A decode whose token fits its last block and whose device window is mapped: what the
        general path would decide, without its calls (most rows of a decode batch)."""
        c = seq.num_computed_tokens
        return (
            seq.num_tokens - c == 1
            and c < len(seq.block_table) * self.block_size
            and (self.device_space is None or self.device_space.steady_decode(seq))
        )

    def grow(self, seq: Sequence, n: int) -> None:
        need = self.new_blocks(seq, n)
        space = self.device_space
        if need > 0:
            blocks = self.allocator.allocate(need)
            seq.block_table.extend(blocks)
            if space is not None:
                space.on_allocate(blocks)
        if space is not None:
            space.schedule(seq, n)

    def resumes(self, seq: Sequence, n: int, running: list[Sequence]) -> bool:
        """Whether a paused sequence (it holds its blocks) may compute n tokens again."""
        if not self.can_allocate(seq, n):
            return False
        if not self.fits_with_growth(seq, len(seq.block_table), 0, running):
            return False
        space = self.device_space
        return space is None or (space.can_admit(seq, running) and space.can_schedule(seq, n))

    def pause(self, seq: Sequence) -> None:
        self.device_space.pause(seq)

    def gauges(self) -> dict[str, int]:
        """The device space's statistics (KV offload), else none."""
        return {} if self.device_space is None else self.device_space.gauges()

    def release(self, seq: Sequence) -> None:
        if self.device_space is not None:
            self.device_space.free(seq)
        self.allocator.free(seq.release_blocks())

    # ---- the admission estimate (SGLang's, adapted) ---------------------------------------------

    def _expected_outputs(self, seq: Sequence) -> int:
        left = RESERVE_CLIP_TOKENS
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens)
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - seq.num_tokens)
        return math.ceil(self.new_token_ratio * max(left, 0))

    def _future_blocks(self, seq: Sequence, held: int) -> int:
        """Blocks a sequence holding `held` is still expected to take."""
        total = seq.num_tokens + self._expected_outputs(seq)
        return max(blocks_needed(total, self.block_size) - held, 0)

    def fits_with_growth(self, seq: Sequence, held: int, taken: int, running: list[Sequence]) -> bool:
        """The free blocks, less `taken` (hits leaving the free list), cover the running sequences'
        expected blocks and the candidate's. True when nothing runs or the rule is off (ratio 0)."""
        if not running or self.config.init_new_token_ratio == 0.0:
            return True
        reserved = sum(self._future_blocks(s, len(s.block_table)) for s in running)
        return self.allocator.num_free - taken - reserved >= self._future_blocks(seq, held)

    def adapt_ratio(self, preempted: bool, running: bool) -> None:
        """Halfway to 1 at a preemption, else a decay step towards min_new_token_ratio."""
        if preempted:
            self.new_token_ratio += (1.0 - self.new_token_ratio) / 2
        elif running:
            floor = self.config.min_new_token_ratio
            self.new_token_ratio = max(floor, self.new_token_ratio - self._decay)
