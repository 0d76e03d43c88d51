"""Layer-segmented prefill, the scheduler's side (KV offload; runner's: engine/layer_prefill.py).

A prefill whose context is longer than `OffloadConfig.segment_min_tokens` (at most one step's
budget) is admitted with every token block of its context and only its first decode's window on
the device, and runs a few layers per step for all its tokens: a segment of L layers over T
tokens costs T*L/num_layers of the budget. One at a time, FCFS. With `decode_steps` N, each segment
that ran beside decodes is followed by N steps of theirs without one (their tokens come more often,
the prefill later). The layer cap and those steps hold while at most `max_waiting` prompts, or no
more than the requests decoding, wait to prefill; a longer queue (a burst) is served first, as
chunked prefill serves it (docs/offload.md, "A burst's queue")."""

from __future__ import annotations

from dataclasses import dataclass

from sparseserve.engine.request import Sequence
from sparseserve.engine.scheduler.output import Preempt, SchedulerOutput
from sparseserve.engine.scheduler.policies import SchedulerPolicy
from sparseserve.kvcache.blocks import blocks_needed


@dataclass(frozen=True)
class LayerSegment:
    """One step's work of a layer-segmented prefill: layers [start, end) over every prompt token."""

    seq: Sequence
    start: int
    end: int
    cost: int  # tokens of the step's budget it takes


class SegmentPlanner:
    """Which prefills go layer by layer, and how many layers a step gives one."""

    def __init__(self, num_layers: int, min_context: int, max_layers: int | None = None) -> None:
        self.num_layers = num_layers
        self.min_context = min_context  # longer prompts go layer by layer (OffloadConfig.segment_min_tokens)
        self.max_layers = max_layers or num_layers

    def wants(self, seq: Sequence) -> bool:
        """A prefill (not a paused decode) whose context is longer than `min_context`."""
        return seq.num_tokens > self.min_context and not decoding(seq)

    def cost(self, tokens: int, layers: int) -> int:
        return -(-tokens * layers // self.num_layers)

    def segment(
        self, seq: Sequence, tokens: int, done: int, budget: int, alone: bool, decodes: bool = True
    ) -> LayerSegment | None:
        """The next segment of a `tokens`-token prefill with `done` layers done, within `budget`
        (None: none fits). alone: at least one layer runs, even over the budget. decodes: other
        requests decode beside it, and wait for its step: at most `max_layers` (without them, as
        many as the budget allows)."""
        cap = self.max_layers if decodes else self.num_layers
        k = min(self.num_layers - done, cap, budget * self.num_layers // max(tokens, 1))
        if k <= 0:
            if not alone:
                return None
            k = 1
        return LayerSegment(seq, done, done + k, self.cost(tokens, k))


def decoding(seq: Sequence) -> bool:
    """Past its prefill: its next step is a decode."""
    return seq.num_computed_tokens + 1 >= seq.num_tokens


def only_decodes(out: SchedulerOutput) -> bool:
    """Nothing but one-token rows so far this step: a segment then runs at least one layer, even
    over the budget (a layer cannot be split; it never starves behind a decode batch)."""
    return not out.segments and all(n == 1 for _, n in out.scheduled)


class LayerSegmentedPrefill(SchedulerPolicy):
    def __init__(self, planner: SegmentPlanner, decode_steps: int = 0, max_waiting: int | None = None) -> None:
        self.planner = planner
        self.layers_done: dict[int, int] = {}  # seq_id -> layers done of its prefill
        self.decode_steps = decode_steps
        self.max_waiting = max_waiting  # None: paced whatever waits
        self.owed = 0  # decode steps still owed to the decodes a segment delayed

    @property
    def num_layers(self) -> int:
        return self.planner.num_layers

    def running(self, seq: Sequence) -> bool:
        return seq.seq_id in self.layers_done

    def wants(self, seq: Sequence) -> bool:
        return self.planner.wants(seq)

    def passable(self) -> bool:
        """A prompt that waits for the one layer-by-layer prefill in progress may be passed by prompts that
        prefill whole (it goes first once that prefill ends: no starvation)."""
        return bool(self.layers_done)

    def next_segment(self, seq: Sequence, budget: int, out: SchedulerOutput) -> LayerSegment | None:
        left = seq.num_tokens - seq.num_computed_tokens
        return self._segment(seq, left, self.layers_done[seq.seq_id], budget, out)

    def _segment(self, seq: Sequence, tokens: int, done: int, budget: int, out: SchedulerOutput) -> LayerSegment | None:
        """The planner's next segment; none while decode steps are owed to the requests decoding beside it."""
        decodes = any(s is not seq and decoding(s) for s in self.sched.running)
        paced = decodes and not self._burst(seq)
        if paced and self.owed:
            return None
        return self.planner.segment(seq, tokens, done, budget, only_decodes(out), paced)

    def _burst(self, seq: Sequence | None = None) -> bool:
        """More prompts other than `seq` wait to prefill (a paused or parked decode is not one) than both
        `max_waiting` and the requests decoding: a decode step would delay more prompts than it gives tokens."""
        if self.max_waiting is None or len(self.sched.waiting) <= self.max_waiting:
            return False
        n = sum(s is not seq and not decoding(s) for s in self.sched.waiting)
        return n > self.max_waiting and n > sum(decoding(s) for s in self.sched.running)

    def admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> LayerSegment | None:
        """Admits the head of the queue if it fits (None: it waits): its prefix-cache hit taken (a
        paused one keeps its blocks), every token block of its context allocated, its first decode's
        window mapped on the device."""
        if self.layers_done:  # one at a time
            return None
        sched = self.sched
        kv = sched.kv
        alloc, bs = kv.allocator, kv.block_size
        hit, parked, computed = None, 0, seq.num_computed_tokens
        if not seq.block_table:
            hit = kv.lookup(seq, host=False)
            parked, computed = hit.parked, len(hit.blocks) * bs
        held = len(seq.block_table) if hit is None else len(hit.blocks)
        seg = self._segment(seq, seq.num_tokens - computed, 0, budget, out)
        need = blocks_needed(seq.num_tokens, bs) - held
        if (
            seg is None
            or not alloc.can_allocate(need + parked)
            or not kv.fits_with_growth(seq, held, parked, sched.running)
        ):
            return None
        before, seq.num_computed_tokens = seq.num_computed_tokens, computed
        if not kv.device_space.can_admit_segmented(seq, sched.running):
            seq.num_computed_tokens = before
            return None
        if hit is not None:
            kv.take(seq, hit)
        blocks = alloc.allocate(need)
        seq.block_table.extend(blocks)
        kv.device_space.on_allocate(blocks)
        kv.device_space.schedule_segmented(seq)
        self.layers_done[seq.seq_id] = 0
        return seg

    def end_step(self, out: SchedulerOutput) -> None:
        """A segment beside decodes owes them `decode_steps` steps (none in a burst); any step without a segment
        pays one (so a prefill waits at most that many steps, whatever runs)."""
        if out.segments and any(n == 1 for _, n in out.scheduled):
            self.owed = 0 if self._burst() else self.decode_steps
        elif not out.segments:
            self.owed = max(self.owed - 1, 0)

    def finish_segment(self, seg: LayerSegment) -> bool:
        """After the step that ran it; True when that completes the prefill."""
        sid = seg.seq.seq_id
        if seg.end < self.num_layers:
            self.layers_done[sid] = seg.end
            return False
        del self.layers_done[sid]
        return True

    def on_leave(self, seq: Sequence, why: Preempt | None) -> None:
        self.layers_done.pop(seq.seq_id, None)  # a preempted one starts again at layer 0
