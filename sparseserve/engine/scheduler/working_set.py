"""Working-set-aware batch control with prefill ahead (KV offload; docs/working_set.md).

A decode batch runs only while the running sequences' working sets fit the HBM pool's limit: the
newest are held back (never the last), a waiting sequence is admitted only if its estimate fits.
With prefill ahead (max_prefilled_waiting > 0) the limit governs decode, not prefill: a sequence
that does not fit is still prefilled (one at a time), then parked until a decode share frees;
shares go in share_order (those that have decoded, then the rest, by arrival), so the first
request in it always makes progress. A sequence goes ahead only if its share is expected to open
at most max_park_steps steps after its prefill ends (decodes finishing at their max_tokens,
estimates unchanged): a bound on its first-token gap."""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple, Protocol

from sparseserve.engine.request import Sequence
from sparseserve.engine.scheduler.output import Preempt, SchedulerOutput
from sparseserve.engine.scheduler.policies import SchedulerPolicy


class WorkingSetLimit(Protocol):
    """The estimates and accounting of kvcache/working_set.py WorkingSetEstimate."""

    enabled: bool  # whether the limit holds back and refuses (else only the gauge)
    limit: int  # head blocks the running working sets may take together

    def estimates(self, seqs: list[Sequence]) -> list[int]: ...
    def due(self) -> bool: ...
    def record(self, total: int, held: int, new_holds: int) -> None: ...
    def record_prefill_ahead(self, parked: int, new_ahead: int) -> None: ...


class Admission(NamedTuple):
    need: int | None  # its estimate; None: it waits
    ahead: bool  # admitted for its prefill only / (need None) parked: newer ones may pass


WAIT = Admission(None, False)


def share_order(seq: Sequence) -> tuple[int, int]:
    """Decode shares go in this order: first the sequences that have decoded (a token after their
    first), then the rest, each in arrival (the engine numbers sequences as requests arrive). A
    sequence given its share back mid-decode resumes before any that has not decoded yet, which
    may be older (a short prompt passes long ones at admission): else it waited seconds between
    two tokens (docs/working_set.md)."""
    return (0 if seq.num_output_tokens > 1 else 1, seq.seq_id)


def share_opens(free: int, decoding: list[tuple[int, int]], queue: list[tuple[int, int]], need: int) -> int:
    """Steps until a sequence needing `need` takes a decode share behind `queue` (the ones before it
    waiting: (need, steps they decode once they have it)), in share order, if each of `decoding` ((steps
    left, need)) frees its need when it ends; free: the limit less the decoding needs. A share
    is taken when its need fits, or by the first sequence of an empty batch."""
    heap = list(decoding)
    heapq.heapify(heap)
    now = 0
    for q_need, q_steps in [*queue, (need, 0)]:
        while free < q_need and heap:
            now, freed = heapq.heappop(heap)
            free += freed
        free -= q_need
        heapq.heappush(heap, (now + q_steps, q_need))
    return now


class _ShareQueue(NamedTuple):
    """The sequences without a decode share that wait for one (ahead or parked)."""

    oldest: tuple[int, int] | None  # the first one's share_order
    waiting: int  # how many
    prefilling_ahead: bool  # one admitted ahead is still prefilling


class WorkingSetControl(SchedulerPolicy):
    def __init__(self, limit: WorkingSetLimit, max_prefilled_waiting: int = 0, max_park_steps: int = 8) -> None:
        self.ws = limit
        self.max_waiting = max_prefilled_waiting
        self.max_park = max_park_steps
        self.total = 0  # the decode shares' working sets this step
        self.ahead: set[int] = set()  # running sequences prefilling without a decode share
        self._parked_now: set[int] = set()
        self._new_ahead = 0
        self._queue: _ShareQueue | None = None
        self._resuming = 0  # parked sequences whose share is free at this step's start

    @property
    def ahead_mode(self) -> bool:
        return self.max_waiting > 0 and self.ws.enabled

    # ---- hooks ----------------------------------------------------------------------------------

    def begin_step(self, out: SchedulerOutput) -> None:
        self._parked_now.clear()
        self._new_ahead = 0
        self._queue = None
        self._resuming = 0
        if self.ahead_mode:
            self._share_out(out)
            self._resuming = self._resumable()
            return
        self.ahead.clear()
        if not self.ws.enabled:
            self.total = 0
            return
        sched = self.sched
        est = self.ws.estimates(sched.running)
        total = sum(est)
        while len(sched.running) > 1 and total > self.ws.limit:
            seq = sched.running[-1]
            if sched.segments is not None and sched.segments.running(seq):  # never paused
                break
            total -= est.pop()
            sched.preempt(seq, Preempt.HOLD_BACK, out)
        self.total = total

    def prefill_budget(self, seq: Sequence, budget: int) -> int:
        """The step's budget for a running sequence's prefill: one prefilling ahead leaves a token for
        each parked sequence that resumes this step (older: it never delays their decode)."""
        return max(budget - self._resuming, 0) if seq.seq_id in self.ahead else budget

    def stops_admission(self, out: SchedulerOutput) -> bool:
        """A preemption stops admission; a hold-back too, unless prefill ahead runs."""
        return out.num_evicted > 0 or (not self.ahead_mode and bool(out.held_back))

    def admission(self, seq: Sequence) -> Admission:
        """The working-set side of admitting the head candidate `seq`."""
        if not self.ahead_mode:
            if not self.ws.enabled:
                return Admission(0, False)
            need = self.ws.estimates([seq])[0]
            if self.sched.running and self.total + need > self.ws.limit:
                return WAIT
            return Admission(need, False)
        self._queue = self._queue or self._share_queue()
        return self._decode_share(seq, self._queue)

    def admitted(self, seq: Sequence, adm: Admission) -> None:
        self._queue = None
        if adm.ahead:
            self.ahead.add(seq.seq_id)
            self._new_ahead += 1
        else:
            self.total += adm.need

    def end_step(self, out: SchedulerOutput) -> None:
        """Statistics: the running working sets, requests the limit keeps waiting, hold-backs."""
        ws, sched = self.ws, self.sched
        if self.ahead_mode:
            sharing = [s for s in sched.running if s.seq_id not in self.ahead]
            parked = sum(1 for w in sched.waiting if self._is_parked(w))
            limited = bool(out.held_back or self.ahead or parked)
            kept = len(sched.waiting) + len(self.ahead) if limited else 0
            ws.record(sum(ws.estimates(sharing)), kept, len(out.held_back))
            ws.record_prefill_ahead(parked, self._new_ahead)
            return
        if not ws.enabled:  # the gauge only, when due
            if ws.due():
                ws.record(sum(ws.estimates(sched.running)), 0, 0)
            return
        held = out.held_back
        limited = bool(held) or (bool(sched.waiting) and self._limited_admission())
        exact = out.num_evicted == 0  # else the running set is not what the step summed
        total = self.total if exact else sum(ws.estimates(sched.running))
        ws.record(total, len(sched.waiting) if limited else 0, len(held))

    def on_leave(self, seq: Sequence, why: Preempt | None) -> None:
        self.ahead.discard(seq.seq_id)  # it asks for a decode share again when readmitted

    # ---- the rules ------------------------------------------------------------------------------

    def _limited_admission(self) -> bool:
        """Whether the queue's head is refused by the limit (and not by a full batch first)."""
        sched = self.sched
        if len(sched.running) >= sched.config.max_num_seqs:
            return False
        return self.admission(sched.waiting[0]).need is None

    def _prefilled(self, seq: Sequence) -> bool:
        """Its prompt is computed and its next token sampled: only decode is left."""
        segments = self.sched.segments
        return (
            seq.num_computed_tokens > 0
            and seq.num_tokens - seq.num_computed_tokens == 1
            and not (segments is not None and segments.running(seq))
        )

    def _is_parked(self, seq: Sequence) -> bool:
        """A waiting sequence paused with only decode left (it holds its blocks)."""
        return bool(seq.block_table) and self._prefilled(seq)

    def _share_out(self, out: SchedulerOutput) -> None:
        """Over the limit the last shares in share order are given back (never the first): a decoding
        sequence is parked, a prefilling one becomes ahead. Then each ahead sequence whose
        prefill is done, in share order, takes a share if it fits and none before it waits, or is
        parked."""
        ws, sched = self.ws, self.sched
        sharing = sorted((s for s in sched.running if s.seq_id not in self.ahead), key=share_order)
        est = ws.estimates(sharing)
        total = sum(est)
        while len(sharing) > 1 and total > ws.limit:
            seq = sharing.pop()
            total -= est.pop()
            if self._prefilled(seq):
                self._park(seq, out)
            else:
                self.ahead.add(seq.seq_id)
        done = [s for s in sched.running if s.seq_id in self.ahead and self._prefilled(s)]
        done.sort(key=share_order)
        for seq, need in zip(done, ws.estimates(done)):
            # a fresh scan per sequence: the one before it got a share or was parked
            if not self._blocked(seq, self._share_queue()) and (not sharing or total + need <= ws.limit):
                self.ahead.discard(seq.seq_id)
                sharing.append(seq)
                total += need
            else:
                self._park(seq, out)
        self.total = total

    def _resumable(self) -> int:
        """Parked sequences whose decode share is free now, in share order up to the first that does
        not fit (or one before it still prefilling ahead)."""
        sched = self.sched
        oldest_ahead = min((share_order(s) for s in sched.running if s.seq_id in self.ahead), default=None)
        parked = sorted(
            (w for w in sched.waiting if self._is_parked(w) and w.seq_id not in self._parked_now), key=share_order
        )
        free, sharing, n = self.ws.limit - self.total, len(sched.running) > len(self.ahead), 0
        for seq, need in zip(parked, self.ws.estimates(parked)):
            if (oldest_ahead is not None and oldest_ahead < share_order(seq)) or (sharing and need > free):
                break
            free, sharing, n = free - need, True, n + 1
        return n

    def _park(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.sched.preempt(seq, Preempt.PARK, out)
        self._parked_now.add(seq.seq_id)

    def _share_queue(self) -> _ShareQueue:
        sched = self.sched
        ahead = [s for s in sched.running if s.seq_id in self.ahead]
        parked = [share_order(w) for w in sched.waiting if self._is_parked(w)]
        oldest = min([share_order(s) for s in ahead] + parked, default=None)
        prefilling = any(not self._prefilled(s) for s in ahead)
        return _ShareQueue(oldest, len(self.ahead) + len(parked), prefilling)

    @staticmethod
    def _blocked(seq: Sequence, queue: _ShareQueue) -> bool:
        """A sequence before it in share order waits for a decode share."""
        return queue.oldest is not None and queue.oldest < share_order(seq)

    def _decode_share(self, seq: Sequence, queue: _ShareQueue) -> Admission:
        """(need, False): a decode share; (need, True): ahead, for its prefill only; (None, True):
        parked, newer ones may still prefill; (None, False): it and every later one wait (the bound
        on prefilled waiting sequences is reached, or one prefills ahead already: one at a time,
        docs/working_set.md)."""
        need = self.ws.estimates([seq])[0]
        sharing = len(self.sched.running) > len(self.ahead)
        if (
            seq.seq_id not in self._parked_now
            and not self._blocked(seq, queue)
            and (not sharing or self.total + need <= self.ws.limit)
        ):
            return Admission(need, False)
        if self._is_parked(seq):
            return Admission(None, True)
        if queue.waiting >= self.max_waiting or queue.prefilling_ahead or self._park_steps(seq, need) > self.max_park:
            return WAIT
        return Admission(need, True)

    def _steps_left(self, seq: Sequence) -> int:
        """Steps until `seq` ends at its max_tokens (or max_model_len), if nothing pauses it: its
        prompt left at a whole step's budget a step (the last one samples a token), then a token
        a step."""
        sched = self.sched
        left = [seq.params.max_tokens - seq.num_output_tokens] if seq.params.max_tokens is not None else []
        if sched.kv.max_model_len is not None:
            left.append(sched.kv.max_model_len - seq.num_tokens)
        return self._prefill_steps(seq) + max(min(left, default=1 << 40) - 1, 0)

    def _prefill_steps(self, seq: Sequence) -> int:
        """The fewest steps its prompt left takes (1 once prefilled): a step's budget each, or for a
        layer-segmented prefill a layer each where one layer of it exceeds the budget."""
        sched = self.sched
        steps = math.ceil((seq.num_tokens - seq.num_computed_tokens) / sched.config.max_num_batched_tokens)
        segments = sched.segments
        if segments is not None and (segments.running(seq) or segments.wants(seq)):
            steps = min(steps, segments.num_layers)
        return steps

    def _park_steps(self, seq: Sequence, need: int) -> int:
        """Steps `seq`, prefilled ahead from now, is expected to wait parked for its decode share:
        when the share opens (share_opens) less its prefill's steps (at least that many without a
        prefix-cache hit)."""
        sched, ws = self.sched, self.ws
        sharing = [s for s in sched.running if s.seq_id not in self.ahead]
        decoding = [(self._steps_left(s), n) for s, n in zip(sharing, ws.estimates(sharing))]
        older = [w for w in sched.waiting if self._is_parked(w) and share_order(w) < share_order(seq)]
        older.sort(key=share_order)
        queue = [(n, self._steps_left(w)) for w, n in zip(older, ws.estimates(older))]
        return share_opens(self.ws.limit - self.total, decoding, queue, need) - self._prefill_steps(seq)
