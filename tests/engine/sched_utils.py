"""Building a Scheduler in tests from the pieces an engine would wire (engine/scheduler/)."""

from __future__ import annotations

from sparseserve.config import SchedulerConfig
from sparseserve.engine.scheduler import (
    KVCacheManager,
    LayerSegmentedPrefill,
    LongPrefillLimit,
    RequestFairness,
    Scheduler,
    SchedulerPolicies,
    SegmentPlanner,
    WorkingSetControl,
)
from sparseserve.kvcache.blocks import BlockAllocator
from sparseserve.profiler import Profiler


def make_scheduler(
    config: SchedulerConfig,
    allocator: BlockAllocator,
    block_size: int,
    device_space=None,
    host_cache=None,
    *,
    max_model_len: int | None = None,
    min_chunk: int = 1,
    segments: SegmentPlanner | None = None,
    long_prefill_token_threshold: int = 0,
    max_prefilled_waiting: int = 0,
    max_park_steps: int = 8,
    kv_cls: type[KVCacheManager] = KVCacheManager,
    fair: bool = True,
) -> Scheduler:
    """A working-set limit, if any, is the device space's `working_set` (as the engine's offload space);
    fairness between requests on, as in the engine."""
    kv = kv_cls(
        config,
        allocator,
        block_size,
        device_space=device_space,
        host_cache=host_cache,
        max_model_len=max_model_len,
        min_chunk=min_chunk,
    )
    long = None
    if long_prefill_token_threshold:
        long = LongPrefillLimit(long_prefill_token_threshold, config.max_long_partial_prefills, min_chunk)
    ws = getattr(device_space, "working_set", None)
    control = WorkingSetControl(ws, max_prefilled_waiting, max_park_steps) if ws is not None else None
    seg = LayerSegmentedPrefill(segments) if segments is not None else None
    return Scheduler(config, kv, SchedulerPolicies(long, control, seg, RequestFairness() if fair else None))


def left(out) -> list:
    """The sequences that left the running batch, in order."""
    return [s for s, _ in out.preempted]


class LastSchedule(Profiler):
    """Keeps the newest step's SchedulerOutput (`engine.profiler.out`): what a step ran."""

    def __init__(self) -> None:
        self.out = None

    def on_schedule(self, out) -> None:
        self.out = out
