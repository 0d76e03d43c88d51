"""Fairness between requests with several sequences (n > 1; docs/scheduler.md, "Fairness").

A request's extra sequences never keep another request waiting: admission takes the sequences of
requests with nothing running first (the core's first pass), a preemption takes the newest sequence
of the request running the most, and a request that cannot start makes a request running several
sequences give its newest back (Preempt.YIELD). With one sequence a request nothing changes."""

from __future__ import annotations

from collections import Counter

from sparseserve.engine.request import Sequence
from sparseserve.engine.scheduler.output import Preempt, SchedulerOutput
from sparseserve.engine.scheduler.policies import SchedulerPolicy
from sparseserve.kvcache.blocks import blocks_needed


class RequestFairness(SchedulerPolicy):
    def begin_step(self, out: SchedulerOutput) -> None:
        sched = self.sched
        if not sched.waiting or not sched.running:
            return
        counts = Counter(s.request_id for s in sched.running)
        if max(counts.values()) < 2:  # nobody runs extra sequences (every n = 1 workload)
            return
        starved = next((w for w in sched.waiting if w.request_id not in counts and not w.block_table), None)
        while starved is not None and not self._fits(starved):
            victim = self.victim(sched.running, counts)
            if counts[victim.request_id] < 2:
                return
            counts[victim.request_id] -= 1
            sched.preempt(victim, Preempt.YIELD, out)

    def victim(self, candidates: list[Sequence], counts: Counter | None = None) -> Sequence:
        """The newest sequence of the request running the most sequences (of `candidates`), else the
        newest of all (the core's rule)."""
        counts = counts if counts is not None else Counter(s.request_id for s in self.sched.running)
        most = max(candidates, key=lambda s: counts[s.request_id])
        if counts[most.request_id] < 2:
            return candidates[-1]
        return next(s for s in reversed(candidates) if s.request_id == most.request_id)

    def _fits(self, seq: Sequence) -> bool:
        """Whether a new sequence's first chunk would find blocks and a batch slot now."""
        sched, kv = self.sched, self.sched.kv
        if len(sched.running) >= sched.config.max_num_seqs:
            return False
        hit = kv.lookup(seq, host=False)
        computed = len(hit.blocks) * kv.block_size
        n = min(seq.num_tokens - computed, sched.config.max_num_batched_tokens)
        need = blocks_needed(computed + n, kv.block_size) - len(hit.blocks)
        return kv.allocator.can_allocate(need + hit.parked) and kv.fits_with_growth(
            seq, len(hit.blocks), hit.parked, sched.running
        )
