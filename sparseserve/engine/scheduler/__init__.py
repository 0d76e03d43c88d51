"""The scheduler: a core composing block accounting and policy components (docs/scheduler.md)."""

from sparseserve.engine.scheduler.fairness import RequestFairness
from sparseserve.engine.scheduler.kv_cache import DeviceSpace, HostCache, KVCacheManager, PrefixCacheStats
from sparseserve.engine.scheduler.output import Preempt, SchedulerOutput
from sparseserve.engine.scheduler.policies import LongPrefillLimit, SchedulerPolicy
from sparseserve.engine.scheduler.scheduler import Scheduler, SchedulerPolicies, build_scheduler
from sparseserve.engine.scheduler.segments import LayerSegment, LayerSegmentedPrefill, SegmentPlanner
from sparseserve.engine.scheduler.working_set import WorkingSetControl, WorkingSetLimit

__all__ = [
    "DeviceSpace",
    "HostCache",
    "KVCacheManager",
    "LayerSegment",
    "LayerSegmentedPrefill",
    "LongPrefillLimit",
    "Preempt",
    "PrefixCacheStats",
    "RequestFairness",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerPolicies",
    "SchedulerPolicy",
    "SegmentPlanner",
    "WorkingSetControl",
    "WorkingSetLimit",
    "build_scheduler",
]
