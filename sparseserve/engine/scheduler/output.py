"""What one scheduling step decides, and why a sequence left the running batch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sparseserve.engine.request import Sequence

if TYPE_CHECKING:
    from sparseserve.engine.scheduler.segments import LayerSegment
    from sparseserve.kvcache.offload_plan import OffloadPlan


class Preempt(enum.Enum):
    """Why a sequence left the running batch (`Scheduler.preempt`, the one verb for it)."""

    RECOMPUTE = "recompute"  # token blocks ran out: its blocks go back, its tokens are its prompt
    PAUSE = "pause"  # device blocks ran out (KV offload): it keeps its blocks and its work
    HOLD_BACK = "hold_back"  # over the working-set limit: paused, first back in
    PARK = "park"  # prefilled ahead of the limit: paused until a decode share frees
    YIELD = "yield"  # a request's extra sequence makes room for a waiting request: recomputed

    @property
    def limit(self) -> bool:
        """Left because of the working-set limit (not a shortage of blocks)."""
        return self in (Preempt.HOLD_BACK, Preempt.PARK)

    @property
    def shortage(self) -> bool:
        """Left because blocks ran out: admission stops this step, the admission estimate rises."""
        return self in (Preempt.RECOMPUTE, Preempt.PAUSE)

    @property
    def keeps_work(self) -> bool:
        return self not in (Preempt.RECOMPUTE, Preempt.YIELD)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[tuple[Sequence, Preempt]] = field(default_factory=list)
    segments: list[LayerSegment] = field(default_factory=list)  # layer-segmented prefills' work
    offload: OffloadPlan | None = None  # KV offload: what the workers do before the step's kernels

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.segments

    @property
    def held_back(self) -> list[Sequence]:
        """The sequences the working-set limit paused this step."""
        return [s for s, why in self.preempted if why.limit]

    @property
    def num_evicted(self) -> int:
        """Sequences that left for want of blocks."""
        return sum(1 for _, why in self.preempted if why.shortage)
