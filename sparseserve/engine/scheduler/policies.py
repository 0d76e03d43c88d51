"""The scheduler's policy components: the hooks it consults, and the long-prefill limit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparseserve.engine.request import Sequence
from sparseserve.engine.scheduler.output import Preempt, SchedulerOutput

if TYPE_CHECKING:
    from sparseserve.engine.scheduler.scheduler import Scheduler


class SchedulerPolicy:
    """A component the Scheduler consults at named points of a step; every hook is optional."""

    sched: Scheduler

    def bind(self, sched: Scheduler) -> None:
        self.sched = sched

    def begin_step(self, out: SchedulerOutput) -> None:
        """Before the running sequences are scheduled."""

    def end_step(self, out: SchedulerOutput) -> None:
        """After admission."""

    def on_leave(self, seq: Sequence, why: Preempt | None) -> None:
        """A sequence left the running batch (why) or finished (None)."""


class LongPrefillLimit(SchedulerPolicy):
    """A prompt with more than `threshold` tokens left computes at most that many a step, and at most
    `max_long` such prompts run a step (vLLM's long_prefill_token_threshold, max_long_partial_prefills):
    a request arriving behind a long prompt waits one limited step, not the whole prompt."""

    def __init__(self, threshold: int, max_long: int, min_chunk: int = 1) -> None:
        # at least two min_chunks, so the chunk rule never rounds a limited chunk to nothing
        self.threshold = max(threshold, 2 * min_chunk)
        self.max_long = max_long
        self.left = 0  # long prompts the step may still take

    def begin_step(self, out: SchedulerOutput) -> None:
        self.left = self.max_long

    def is_long(self, seq: Sequence) -> bool:
        return seq.num_tokens - seq.num_computed_tokens > self.threshold

    def budget(self, remaining: int, budget: int) -> int:
        """The budget a prompt with `remaining` tokens may use this step (0: none)."""
        if remaining > self.threshold:
            return min(budget, self.threshold) if self.left else 0
        return budget

    def count(self, seq: Sequence) -> None:
        """A scheduled long prompt takes one of the step's slots."""
        if self.is_long(seq):
            self.left -= 1

    def passable(self, seq: Sequence) -> bool:
        """Shorter prompts may pass a long one that waits only for a long-prompt slot."""
        return self.left == 0 and self.is_long(seq)
