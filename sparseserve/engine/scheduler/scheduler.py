"""Continuous batching (docs/scheduler.md): FCFS, chunked prefill mixed with decode under a per-step
token budget, prefix-cache admission, and preemption when blocks run out (out of memory is a
scheduling event, never a crash). Block accounting is the KVCacheManager's; request fairness,
the long-prefill limit, working-set control and layer-segmented prefill are policy components
consulted at named points of a step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sparseserve.config import EngineConfig, SchedulerConfig
from sparseserve.engine.request import Sequence, SequenceStatus
from sparseserve.engine.scheduler.fairness import RequestFairness
from sparseserve.engine.scheduler.kv_cache import KVCacheManager
from sparseserve.engine.scheduler.output import Preempt, SchedulerOutput
from sparseserve.engine.scheduler.policies import LongPrefillLimit, SchedulerPolicy
from sparseserve.engine.scheduler.segments import LayerSegmentedPrefill, SegmentPlanner
from sparseserve.engine.scheduler.working_set import Admission, WorkingSetControl, share_order

RUNNING, WAITING = SequenceStatus.RUNNING, SequenceStatus.WAITING
FREE = Admission(0, False)


@dataclass(frozen=True)
class SchedulerPolicies:
    long_prefill: LongPrefillLimit | None = None
    working_set: WorkingSetControl | None = None
    segments: LayerSegmentedPrefill | None = None
    fairness: RequestFairness | None = None

    def all(self) -> list[SchedulerPolicy]:
        ps = (self.fairness, self.long_prefill, self.working_set, self.segments)
        return [p for p in ps if p is not None]


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, policies: SchedulerPolicies = SchedulerPolicies()
    ) -> None:
        self.config = config
        self.kv = kv
        self.long = policies.long_prefill
        self.working_set = policies.working_set
        self.segments = policies.segments
        self.fairness = policies.fairness
        self.policies = policies.all()
        for p in self.policies:
            p.bind(self)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        for p in self.policies:
            p.begin_step(out)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        self._admit_waiting(out, budget)
        self.kv.adapt_ratio(out.num_evicted > 0, bool(self.running))
        for p in self.policies:
            p.end_step(out)
        space = self.kv.device_space
        if space is not None and not out.is_empty:
            out.offload = space.take_plan(out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running sequences, oldest first; the newest are preempted when blocks run out."""
        kv, i = self.kv, 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            i += 1
            if self.segments is not None and self.segments.running(seq):  # its next layers
                seg = self.segments.next_segment(seq, self._prefill_budget(seq, budget), out)
                if seg is not None:
                    out.segments.append(seg)
                    budget -= seg.cost
                continue
            if kv.steady_decode(seq):  # most rows of a decode batch: nothing to allocate or map
                out.scheduled.append((seq, 1))
                budget -= 1
                continue
            n = self._chunk(seq, seq.num_computed_tokens, self._prefill_budget(seq, budget))
            if n == 0:  # a prefill chunk the budget left cannot hold: next step
                continue
            while True:
                tokens_ok = kv.can_allocate(seq, n)
                if tokens_ok and kv.device_fits(seq, n):
                    self._count_long(seq)
                    kv.grow(seq, n)
                    out.scheduled.append((seq, n))
                    budget -= n
                    break
                if not tokens_ok and self._drop_paused():
                    continue
                victim = self._victim(i - 1)
                keep = tokens_ok and kv.device_space is not None
                self.preempt(victim, Preempt.PAUSE if keep else Preempt.RECOMPUTE, out)
                if victim is seq:
                    i -= 1
                    break
        return budget

    def _prefill_budget(self, seq: Sequence, budget: int) -> int:
        """What a running sequence may take of the step's budget left (a prefill ahead leaves parked
        sequences' resumes theirs)."""
        return budget if self.working_set is None else self.working_set.prefill_budget(seq, budget)

    def _victim(self, start: int) -> Sequence:
        """Who leaves when blocks run out: the newest of running[start:] (not yet scheduled this step),
        or, with fairness, the newest of the request running the most sequences among them."""
        if self.fairness is None:
            return self.running[-1]
        return self.fairness.victim(self.running[start:])

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """FCFS while budget, batch slots and blocks allow (not after a preemption: admitting
        would only evict again); shorter prompts may pass one waiting for a long-prompt slot or for
        the layer-by-layer prefill in progress.
        With fairness, first the sequences of requests with nothing running, then the others (n > 1)."""
        ws = self.working_set
        if not self.waiting or (ws.stops_admission(out) if ws is not None else out.num_evicted > 0):
            return  # (a steady decode batch's usual step: nothing waits, no pass over the running ones)
        requests = {s.request_id for s in self.running} if self.fairness is not None else set()
        for extras in (False, True) if self.fairness is not None else (None,):
            budget = self._admit_pass(out, budget, requests, extras)
            if budget is None:
                return

    def _admit_pass(self, out: SchedulerOutput, budget: int, requests: set[str], extras: bool | None) -> int | None:
        """One admission pass over the sequences of requests with something running (extras) or not
        (None: all); None: admission stops for this step."""
        ws, j = self.working_set, 0
        while j < len(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return None
            seq = self.waiting[j]
            if extras is not None and (seq.request_id in requests) != extras:
                j += 1
                continue
            adm = ws.admission(seq) if ws is not None else FREE
            if adm.need is None:
                if adm.ahead:  # parked: waits for a decode share, newer ones may still prefill
                    j += 1
                    continue
                return None
            if self.segments is not None and self.segments.wants(seq):
                seg = self.segments.admit(seq, budget, out)
                if seg is None:
                    if self.segments.passable():
                        j += 1
                        continue
                    return None
                out.segments.append(seg)
                budget -= seg.cost
            else:
                n = self._admit(seq, budget)
                if n == 0:
                    if self.long is not None and self.long.passable(seq):
                        j += 1
                        continue
                    return None
                self._count_long(seq)
                out.scheduled.append((seq, n))
                budget -= n
            del self.waiting[j]
            seq.status = RUNNING
            self.running.append(seq)
            requests.add(seq.request_id)
            if ws is not None:
                ws.admitted(seq, adm)
        return budget

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Admits `seq` if it fits; the tokens it computes this step (0: it waits, no change)."""
        kv = self.kv
        if seq.block_table:  # paused under KV offload: everything computed is still there
            n = self._chunk(seq, seq.num_computed_tokens, budget)
            if n == 0 or not kv.resumes(seq, n, self.running):
                return 0
        else:
            hit = kv.lookup(seq)
            n = self._chunk(seq, hit.computed(kv.block_size), budget)
            if n == 0 or not kv.admits(seq, hit, n, self.running):
                return 0
            kv.take(seq, hit)
        kv.grow(seq, n)
        return n

    def _chunk(self, seq: Sequence, computed: int, budget: int) -> int:
        """Tokens to compute this step (0: none). With min_chunk > 1 a prefill chunk never has fewer
        tokens, nor leaves fewer behind; only a decode's single token runs alone."""
        remaining = seq.num_tokens - computed
        if remaining > budget and not self.config.enable_chunked_prefill:
            return 0
        if self.long is not None:
            budget = self.long.budget(remaining, budget)
            if budget == 0:
                return 0
        n = min(remaining, budget)
        mc = self.kv.min_chunk
        if remaining > 1 and mc > 1:
            if 0 < remaining - n < mc:
                n = remaining - mc
            if n < mc:  # a budget this small for the whole step: run it anyway, never starve
                return 0 if budget < self.config.max_num_batched_tokens else min(remaining, budget)
        return n

    def _count_long(self, seq: Sequence) -> None:
        if self.long is not None:
            self.long.count(seq)

    def preempt(self, seq: Sequence, why: Preempt, out: SchedulerOutput) -> None:
        """Takes a running sequence out of the batch. RECOMPUTE gives its blocks back (full ones
        stay cached); the others pause it with its K/V in the host store. Requeued at the front,
        a parked one in share_order (parked sequences resume in that order)."""
        if self.running and self.running[-1] is seq:
            self.running.pop()
        else:
            self.running.remove(seq)
        for p in self.policies:
            p.on_leave(seq, why)
        if not why.keeps_work:
            self.kv.release(seq)
            seq.num_computed_tokens = 0
        else:
            self.kv.pause(seq)
        seq.status = WAITING
        if why is Preempt.PARK:
            key = share_order(seq)
            at = next((k for k, w in enumerate(self.waiting) if share_order(w) > key), len(self.waiting))
            self.waiting.insert(at, seq)
        else:
            self.waiting.appendleft(seq)
        if not why.limit:
            seq.num_preemptions += 1
            self.num_preemptions += 1
        out.preempted.append((seq, why))

    def _drop_paused(self) -> bool:
        """Token blocks ran short: the newest paused sequence gives its blocks back (False: none)"""
        for seq in reversed(self.waiting):
            if seq.block_table:
                self.kv.release(seq)
                seq.num_computed_tokens = 0
                return True
        return False

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence wherever it is and returns its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.release(seq)
        for p in self.policies:
            p.on_leave(seq, None)
        seq.status = SequenceStatus.FINISHED

    def finish_segment(self, seg) -> bool:
        """After the step that ran a layer segment: True when its prefill is complete."""
        return self.segments.finish_segment(seg)


def build_scheduler(config: EngineConfig, kv: KVCacheManager, *, num_layers: int, device_type: str) -> Scheduler:
    """The scheduler of an engine: the policies its config turns on, over `kv`'s block spaces."""
    sc, oc = config.scheduler_config, config.offload_config
    threshold = sc.prefill_token_threshold(device_type)
    long = LongPrefillLimit(threshold, sc.max_long_partial_prefills, kv.min_chunk) if threshold else None
    ws = getattr(kv.device_space, "working_set", None)
    control = WorkingSetControl(ws, oc.max_prefilled_waiting, oc.max_park_steps) if ws is not None else None
    segments = None
    if oc.layer_segmented_prefill:
        planner = SegmentPlanner(num_layers, oc.segment_min_tokens(sc.max_num_batched_tokens), oc.segment_layers)
        segments = LayerSegmentedPrefill(planner, oc.segment_decode_steps, oc.segment_pacing_max_waiting)
    return Scheduler(sc, kv, SchedulerPolicies(long, control, segments, RequestFairness()))
