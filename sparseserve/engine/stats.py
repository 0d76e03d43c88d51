"""The engine's statistics: one named snapshot (EngineStats); device counters are read without a
sync on the serving path, a little late (docs/architecture.md, principle 2; docs/engine.md).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_blocks_used: int = 0
    num_blocks_total: int = 0
    num_preemptions: int = 0  # cumulative counters from here on
    num_prompt_tokens: int = 0  # prompt tokens computed (recomputed ones included)
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up at first admissions (vLLM's)
    prefix_cache_hits: int = 0  # ... and found in the prefix cache
    prefix_cache_blocks: int = 0  # blocks holding a cached block, referenced or not (gauge)
    prefix_cache_evictions: int = 0  # cached blocks taken back for new contents
    host_prefix_cache_queries: int = 0  # host tier (no offload): prompt tokens the device missed
    host_prefix_cache_hits: int = 0  # ... and found in host memory (restored by copy)
    host_prefix_cache_blocks: int = 0  # host tier blocks in use (gauge)
    host_prefix_cache_evictions: int = 0
    sparse_blocks_selected: int = 0  # sparse decode: blocks in all selections so far
    sparse_selections: int = 0  # one per (decode sequence, sparse layer, KV head) list selected or held
    sparse_flat_lists: int = 0  # topp: selections whose candidates were flat (attended unpruned)
    sparse_held_lists: int = 0  # topp: flat lists kept instead of selected (sparse_topp_flat_hold)
    sparse_block_size: int = 0
    offload_hbm_hits: int = 0  # KV offload: listed head blocks found in the HBM pool
    offload_hbm_misses: int = 0  # ... and not found (loaded, or read from the host)
    offload_blocks_loaded: int = 0  # head blocks copied host -> HBM pool (FlashH2D)
    offload_bypass_reads: int = 0  # misses the attention read from the host store (no free way; not prefetched)
    offload_layer_steps: int = 0  # (decode step, sparse layer) pairs read through the pool
    offload_blocks_seeded: int = 0  # head blocks put in the pool by layer-segmented prefill (no FlashH2D)
    offload_blocks_filled: int = 0  # ... into free slots, beyond the first decode's lists
    offload_prune_key_reads: int = 0  # topp's candidate head blocks whose keys its prune read from the host
    offload_host_blocks: int = 0  # token blocks of the host store (gauge)
    offload_hbm_slots: int = 0  # head-block slots of the HBM pool (gauge)
    offload_h2d_bytes: int = 0  # bytes loaded host -> HBM pool
    offload_uva_bytes: int = 0  # bytes read straight from the host store (bypass reads, the prune's keys)
    offload_d2h_bytes: int = 0  # bytes written through to the host store
    offload_device_blocks_used: int = 0  # device block cache: blocks mapped (gauge)
    offload_device_blocks: int = 0  # device block cache: blocks (gauge)
    prefill_tiles_computed: int = 0  # sparse prefill: (q tile, k tile, KV head) tiles, all layers
    prefill_tiles_dense: int = 0  # ... and the causally visible ones (dense prefill's)
    offload_blocks_restored: int = 0  # token blocks host -> device block cache (hits, resumes)
    offload_device_rows: int = 0  # device rows (running token blocks: dense layers + metadata; gauge)
    offload_device_rows_used: int = 0  # ... mapped (gauge)
    offload_rows_saved: int = 0  # device rows saved to their host rows (pauses, releases)
    offload_rows_restored: int = 0  # ... and restored (resumes, prefix hits)
    offload_hbm_bytes_pool: int = 0  # the offload's device memory by part (gauges)
    offload_hbm_bytes_dense_layers: int = 0
    offload_hbm_bytes_metadata: int = 0
    offload_hbm_bytes_device_block_cache: int = 0
    offload_hbm_bytes_buffers: int = 0  # ... layer-segmented prefill's scratch and hidden states
    layer_prefills_running: int = 0  # layer-segmented prefills in progress (gauge)
    layer_prefill_layers_done: int = 0  # ... and the layers they have done (gauge)
    working_set_blocks: int = 0  # KV offload: the running working sets, head blocks (gauge)
    working_set_capacity: int = 0  # ... the HBM pool's slots they compare with (gauge)
    working_set_limit: int = 0  # ... what they may take (the margin left free; gauge)
    working_set_held_back: int = 0  # requests the working-set limit keeps waiting (gauge)
    working_set_hold_backs: int = 0  # running requests paused by the working-set limit
    working_set_parked: int = 0  # prefilled requests waiting for a decode share (gauge)
    working_set_prefill_aheads: int = 0  # ... admitted for prefill beyond the working-set limit
    working_set_growth: float = 0.0  # a whole window's working set over one step's list (running mean; gauge)

    # The cumulative fields (the rest are gauges and sizes).
    COUNTERS: ClassVar[frozenset[str]] = frozenset(
        {
            "num_preemptions",
            "num_prompt_tokens",
            "num_generation_tokens",
            "prefix_cache_queries",
            "prefix_cache_hits",
            "prefix_cache_evictions",
            "host_prefix_cache_queries",
            "host_prefix_cache_hits",
            "host_prefix_cache_evictions",
            "sparse_blocks_selected",
            "sparse_selections",
            "sparse_flat_lists",
            "sparse_held_lists",
            "offload_hbm_hits",
            "offload_hbm_misses",
            "offload_blocks_loaded",
            "offload_bypass_reads",
            "offload_layer_steps",
            "offload_blocks_seeded",
            "offload_blocks_filled",
            "offload_prune_key_reads",
            "offload_h2d_bytes",
            "offload_uva_bytes",
            "offload_d2h_bytes",
            "prefill_tiles_computed",
            "prefill_tiles_dense",
            "offload_blocks_restored",
            "offload_rows_saved",
            "offload_rows_restored",
            "working_set_hold_backs",
            "working_set_prefill_aheads",
        }
    )

    @classmethod
    def from_values(cls, values: dict[str, int]) -> "EngineStats":
        """Fills the fields by name (values may hold more keys)."""
        return cls(
            **{f.name: type(f.default)(values[f.name]) for f in fields(cls) if f.name in values}  # int or float
        )

    def since(self, start: "EngineStats") -> "EngineStats":
        """The counters counted from `start` on (the engine's warm-up is not the served traffic)."""
        return replace(self, **{n: getattr(self, n) - getattr(start, n) for n in self.COUNTERS})


class DeviceCounters:
    """Named cumulative int64 device counters, read without a sync. `refresh()` (after a step)
    marks them changed; a copy into pinned memory starts when changed, none is in flight and the
    last began `interval_s` ago. `values()` is the newest landed copy: at most a step plus
    interval_s late on a busy GPU, exact with sync=True; on CPU both are immediate."""

    def __init__(self, tensors: dict[str, torch.Tensor], interval_s: float = 0.005) -> None:
        self.names = list(tensors)
        self._src = [t.reshape(()) for t in tensors.values()]
        self._values = {n: 0 for n in self.names}
        self._cuda = bool(self._src) and self._src[0].is_cuda
        self._pinned = torch.zeros(len(self._src), dtype=torch.int64, pin_memory=self._cuda)
        self._event = torch.cuda.Event() if self._cuda else None
        self._in_flight = self._changed = False
        self._interval_s, self._started = interval_s, -math.inf

    def refresh(self) -> None:
        if not self._src:
            return
        if not self._cuda:
            self._values = dict(zip(self.names, torch.stack(self._src).tolist()))
            return
        self._changed = True
        self._poll()

    def _poll(self) -> None:
        """Lands a finished copy; starts the next one when due."""
        if self._in_flight:
            if not self._event.query():
                return
            self._values = dict(zip(self.names, self._pinned.tolist()))
            self._in_flight = False
        now = time.perf_counter()
        if self._changed and now - self._started >= self._interval_s:
            self._pinned.copy_(torch.stack(self._src), non_blocking=True)
            self._event.record()
            self._in_flight, self._changed, self._started = True, False, now

    def values(self, sync: bool = False) -> dict[str, int]:
        """The newest landed copy; sync=True waits for the device first (tests, benchmarks)."""
        if sync and self._src:
            if self._cuda:
                torch.cuda.current_stream(self._src[0].device).synchronize()
                self._in_flight = self._changed = False
                self._values = dict(zip(self.names, torch.stack(self._src).tolist()))
            else:
                self.refresh()
        elif self._cuda:
            self._poll()
        return dict(self._values)
