"""Continuous batching: FCFS, chunked prefill mixed with decode under a per-step token budget, automatic prefix
caching, admission that leaves the running batch room to grow, and preemption when KV blocks run out anyway
(the scheduler owns memory: out of blocks is a scheduling event, never a crash). docs/prefix_cache.md has the
whole design.

Prefix caching (kvcache/prefix_cache.py, kvcache/blocks.py): a sequence admitted without blocks first takes
the longest cached prefix of its full blocks by reference (then, when there is one, the next blocks found in
the host tier, `HostCache`, copied back into new blocks), and computes only the rest; every block its steps
fill is offered to the cache (`cache_full_blocks`). A sequence always computes at least `min_chunk` tokens
of its own (one; two with a sparse attention policy, see below).

Admission (SGLang's conservative estimate, adapted): a waiting sequence is admitted only if the free KV
blocks cover what the running sequences still need (their prompt remainders plus `new_token_ratio` of their
remaining max_tokens) and its own prompt and expected output. The ratio decays each step towards
min_new_token_ratio and rises halfway to 1 at every preemption, so the estimate follows what the workload
really generates.

Preemption: the newest running sequences give their blocks back. A recompute victim's full blocks stay in
the prefix cache (free, evicted last-in-first-out along its chain), so it re-admits through the cache and
recomputes only what was evicted. Under KV offload there is a second block space (`device_space`,
kvcache/offload.py OffloadCache): token blocks (the allocator) are host store rows, and the device block
cache holds only the working set: every block of a prefilling sequence, the local window of a decoding one.
A step is scheduled only if both fit; when only the device space is short the victim is paused instead
(`DeviceSpace.pause`): it keeps its token blocks and computed tokens (all of its K/V is in the host store)
and resumes by copying its window back, with no prefill at all. A paused sequence gives its token blocks
back (becoming a recompute victim) when token blocks run short.

Prefill-decode interference: a step's time grows with its tokens, so a whole-budget prompt chunk would stall
every decoding stream for that long. In a step that runs decodes, a prompt with more than
long_prefill_token_threshold tokens left computes at most that many, and at most max_long_partial_prefills such
prompts run (vLLM's names); a step without decodes gives a prompt the whole budget.

Working-set-aware batch control (SparseServe section 3.3; `working_set_control` with KV offload): a step runs
only while the running sequences' working sets (head blocks their selections touched over the last w decode
steps, measured on the GPU one step late; kvcache/working_set.py) sum to at most the HBM pool's slots less a
margin, besides max_num_seqs and the token budget. Before the step, the newest running sequences are held back
until the sum fits (paused: no recompute; at least one keeps running), and a waiting sequence is admitted only
if its estimate fits beside them. No starvation: the running batch is always the oldest requests (held-back ones
wait at the front of the queue, admission is first come first served and stops at the first that does not fit),
and the oldest unfinished request always runs, since the limit never holds back the last running sequence and
admits any sequence into an empty batch; so every request runs once the requests before it are done or fit.

Prefill ahead (`max_prefilled_waiting` > 0 with working-set control): the limit governs decode, not prefill. Under
KV offload a prefill needs none of the HBM pool (its K/V goes to the host store), so a waiting sequence whose
working set does not fit is still admitted for its prefill when blocks, budget and batch slots allow ("ahead":
it holds no share of the limit). When its prefill is done (its first token sampled) it gets a decode share if it
fits and no older sequence waits for one; otherwise it is parked: paused like a hold-back, its K/V in the host
store, waiting for a decode share. Decode shares go in arrival order (a parked or ahead sequence blocks every
newer one from taking a share), and over the limit the newest sharing sequence gives its share back (a decoding
one is parked, one still prefilling becomes ahead); the oldest keeps its share, so the no-starvation argument
above holds for decode. At most max_prefilled_waiting sequences are ahead or parked (each holds its context in
the host store), and one prefills ahead at a time (several would share the steps' prefill budget and all finish
later). A hold-back then stops no admission (a real preemption still does).

With a sparse attention policy a one-token chunk runs as a decode row (attended sparsely), so a prompt token
computed alone would be attended differently than in a prefill chunk: prefill chunks then have at least two
tokens (`min_chunk`), which also keeps a prefix-cache hit from changing any token.

Layer-segmented prefill (KV offload, engine/layer_prefill.py `SegmentPlanner`): a prefill whose context is longer
than one step's budget is admitted with every token block of its context and only its first decode's window on
the device, and runs a few layers per step for all its tokens (`SchedulerOutput.segments`; a segment costs
tokens x layers / num_layers of the budget); one at a time, FCFS like any admission."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from sparseserve.config import SchedulerConfig
from sparseserve.engine.layer_prefill import LayerSegment, SegmentPlanner
from sparseserve.engine.request import Sequence, SequenceStatus
from sparseserve.kvcache.blocks import BlockAllocator, blocks_needed
from sparseserve.kvcache.prefix_cache import extend_block_hashes

# The admission estimate of a request without max_tokens (or a huge one) counts at most this many outputs.
RESERVE_CLIP_TOKENS = 4096


class DeviceSpace(Protocol):
    """A second, smaller block space a step must also fit (the offload cache's device block cache)."""

    def can_schedule(self, seq: Sequence, n: int) -> bool: ...
    def steady_decode(self, seq: Sequence) -> bool: ...  # its decode fits and `schedule` would do nothing
    def can_admit(self, seq: Sequence, running: list[Sequence]) -> bool: ...
    def schedule(self, seq: Sequence, n: int) -> None: ...
    def free(self, seq: Sequence) -> None: ...
    def pause(self, seq: Sequence) -> None: ...
    def on_allocate(self, blocks: list[int]) -> None: ...
    # layer-segmented prefill (engine/layer_prefill.py): only its first decode's window is on the device
    def can_admit_segmented(self, seq: Sequence, running: list[Sequence]) -> bool: ...
    def schedule_segmented(self, seq: Sequence) -> None: ...


def _arrival(seq: Sequence) -> int:
    """Arrival order (the engine numbers sequences as requests arrive)."""
    return seq.seq_id


class _ShareQueue(NamedTuple):
    """Prefill ahead: the sequences without a decode share that wait for one (ahead or parked)."""
    oldest: int | None      # the oldest one's arrival
    waiting: int            # how many (bounded by max_prefilled_waiting)
    prefilling_ahead: bool  # one admitted ahead is still prefilling


class WorkingSetLimit(Protocol):
    """The working-set control's view of the HBM pool (kvcache/working_set.py WorkingSet), found on the device
    space as `working_set`."""

    enabled: bool  # whether the limit holds back and refuses sequences (else only the estimates are reported)
    limit: int     # head blocks the running sequences' working sets may take together

    def estimates(self, seqs: list[Sequence]) -> list[int]: ...
    def record(self, total: int, held: int, new_holds: int) -> None: ...
    def record_prefill_ahead(self, parked: int, new_ahead: int) -> None: ...  # only with prefill ahead


class HostCache(Protocol):
    """The prefix cache's host tier without KV offload (kvcache/host_cache.py): full blocks by hash in host
    memory, restored by copy into newly allocated blocks."""

    def lookup(self, hashes: list[bytes]) -> int: ...
    def restore(self, blocks: list[int], hashes: list[bytes]) -> None: ...
    def store(self, blocks: list[int], hashes: list[bytes]) -> None: ...


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens this step)
    preempted: list[Sequence] = field(default_factory=list)  # every sequence that left the running batch
    held_back: list[Sequence] = field(default_factory=list)  # ... of them, paused by the working-set limit
    segments: list[LayerSegment] = field(default_factory=list)  # layer-segmented prefills' work this step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.segments


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up and found at first admissions (vLLM's meaning: re-admissions after a
    preemption are not counted), per tier: the allocator's cache, then the host tier for the rest."""
    queries: int = 0
    hits: int = 0
    host_queries: int = 0
    host_hits: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int,
                 device_space: DeviceSpace | None = None, host_cache: HostCache | None = None, *,
                 max_model_len: int | None = None, min_chunk: int = 1, segments: SegmentPlanner | None = None,
                 long_prefill_token_threshold: int = 0, max_prefilled_waiting: int = 0) -> None:
        self.config = config
        self.allocator = allocator
        self.device_space = device_space
        self.host_cache = host_cache
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.min_chunk = min_chunk
        # Prefill-decode interference (config help): a long prompt's chunk beside decodes. At least two
        # min_chunks, so the chunk rule in _chunk never rounds a limited chunk down to nothing.
        self.long_prefill_token_threshold = long_prefill_token_threshold and max(long_prefill_token_threshold,
                                                                                 2 * min_chunk)
        self._prefill_limit = 0  # this step's limit (0 when no decode runs), and long prompts it may still take
        self._long_left = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.new_token_ratio = config.init_new_token_ratio
        self._ratio_decay = (config.init_new_token_ratio - config.min_new_token_ratio) / \
            config.new_token_ratio_decay_steps
        self.prefix_stats = PrefixCacheStats()
        self.segments = segments
        self.layers_done: dict[int, int] = {}  # seq_id -> layers done of its layer-segmented prefill
        self.working_set: WorkingSetLimit | None = getattr(device_space, "working_set", None)
        self._ws_total = 0  # the running sequences' working sets, this step
        # Prefill ahead (module docstring): running sequences prefilling without a decode share, sequences parked
        # this step (not resumed in the step that parked them), admissions ahead this step.
        self.max_prefilled_waiting = max_prefilled_waiting
        self.ahead: set[int] = set()
        self._parked_now: set[int] = set()
        self._new_ahead = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._limit_long_prefills()
        self._hold_back(out)
        # Running sequences first, oldest first; the newest are preempted when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.seq_id in self.layers_done:  # its next layers; every block it needs is held
                i += 1
                seg = self.segments.segment(seq, seq.num_tokens - seq.num_computed_tokens,
                                            self.layers_done[seq.seq_id], budget, self._only_decodes(out))
                if seg is not None:
                    out.segments.append(seg)
                    budget -= seg.cost
                continue
            if self._steady_decode(seq):  # most rows of a decode batch: nothing to allocate, map or check
                out.scheduled.append((seq, 1))
                budget -= 1
                i += 1
                continue
            n = self._chunk(seq, seq.num_computed_tokens, budget)
            if n == 0:  # a prefill chunk that the budget left cannot hold: next step
                i += 1
                continue
            while True:
                tokens_ok = self.allocator.can_allocate(self._new_blocks(seq, n))
                if tokens_ok and (self.device_space is None or self.device_space.can_schedule(seq, n)):
                    self._count_long(seq)
                    self._grow(seq, n)
                    out.scheduled.append((seq, n))
                    budget -= n
                    i += 1
                    break
                if not tokens_ok and self._drop_paused():
                    continue
                victim = self.running.pop()
                self._preempt(victim, keep=tokens_ok)
                out.preempted.append(victim)
                if victim is seq:
                    break
        # Admit waiting sequences while budget, batch slots and blocks allow (not after a preemption:
        # admitting would only evict again). FCFS, except that shorter prompts pass a long one that waits only
        # for a long-prompt slot (max_long_partial_prefills, as in vLLM).
        ahead_mode = self._ahead_mode()
        stopped = len(out.preempted) > len(out.held_back) if ahead_mode else bool(out.preempted)
        j = 0
        queue = None  # prefill ahead: the share queue, scanned again only after an admission changed it
        while j < len(self.waiting) and budget > 0 and not stopped \
                and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[j]
            ahead = False
            if ahead_mode:
                queue = queue or self._share_queue()
                need, ahead = self._decode_share(seq, queue)
                if need is None:
                    if ahead:  # parked: waits for a decode share, newer sequences may still prefill
                        j += 1
                        continue
                    break
            else:
                need = self._working_set_need(seq)
                if need is None:  # its working set does not fit beside the running ones
                    break
            if self.segments is not None and self.segments.wants(seq):
                seg = self._admit_segmented(seq, budget, self._only_decodes(out))
                if seg is None:
                    break
                out.segments.append(seg)
                budget -= seg.cost
            else:
                n = self._admit(seq, budget)
                if n == 0:
                    if self._long_left == 0 and self._is_long(seq):
                        j += 1
                        continue
                    break
                self._count_long(seq)
                out.scheduled.append((seq, n))
                budget -= n
            del self.waiting[j]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            queue = None
            if ahead:
                self.ahead.add(seq.seq_id)
                self._new_ahead += 1
            else:
                self._ws_total += need
        self._adapt_ratio(len(out.preempted) > len(out.held_back))
        self._record_working_set(out)
        return out

    def _chunk(self, seq: Sequence, computed: int, budget: int) -> int:
        """Tokens to compute for `seq` this step (0: none). With min_chunk > 1 a prefill chunk never has
        fewer tokens, nor leaves fewer behind; only the single token left of a decode runs alone."""
        remaining = seq.num_tokens - computed
        if remaining > budget and not self.config.enable_chunked_prefill:
            return 0
        if self._prefill_limit and remaining > self._prefill_limit:
            if self._long_left == 0:
                return 0
            budget = min(budget, self._prefill_limit)
        n = min(remaining, budget)
        if remaining > 1 and self.min_chunk > 1:
            if 0 < remaining - n < self.min_chunk:
                n = remaining - self.min_chunk
            if n < self.min_chunk:  # (a budget this small for the whole step: run it anyway, never starve)
                return 0 if budget < self.config.max_num_batched_tokens else min(remaining, budget)
        return n

    def _limit_long_prefills(self) -> None:
        """Sets this step's long-prompt limit: long_prefill_token_threshold tokens for at most
        max_long_partial_prefills prompts when a running sequence decodes; none otherwise."""
        decoding = self.long_prefill_token_threshold and any(s.num_tokens - s.num_computed_tokens == 1
                                                             for s in self.running)
        self._prefill_limit = self.long_prefill_token_threshold if decoding else 0
        self._long_left = self.config.max_long_partial_prefills

    def _is_long(self, seq: Sequence) -> bool:
        return bool(self._prefill_limit) and seq.num_tokens - seq.num_computed_tokens > self._prefill_limit

    def _count_long(self, seq: Sequence) -> None:
        """A scheduled prompt that is long under this step's limit takes one of its long-prompt slots."""
        if self._is_long(seq):
            self._long_left -= 1

    def _steady_decode(self, seq: Sequence) -> bool:
        """A decode whose token fits its last block and whose device-space window is mapped already (all but one
        of every block_size steps of a decoding sequence): what the general path would decide (one token,
        no block, nothing to map) without its calls, which at a large batch are a visible part of a step."""
        c = seq.num_computed_tokens
        return seq.num_tokens - c == 1 and c < len(seq.block_table) * self.block_size and (
            self.device_space is None or self.device_space.steady_decode(seq))

    def _new_blocks(self, seq: Sequence, n: int) -> int:
        return max(blocks_needed(seq.num_computed_tokens + n, self.block_size) - len(seq.block_table), 0)

    def _grow(self, seq: Sequence, n: int) -> None:
        need = self._new_blocks(seq, n)
        if need > 0:
            blocks = self.allocator.allocate(need)
            seq.block_table.extend(blocks)
            if self.device_space is not None:
                self.device_space.on_allocate(blocks)
        if self.device_space is not None:
            self.device_space.schedule(seq, n)

    # ---- working-set control (module docstring) ------------------------------------------------------------

    def _hold_back(self, out: SchedulerOutput) -> None:
        """Pauses the newest running sequences while the running working sets exceed the limit (never the last
        one); they wait at the front of the queue with everything they computed."""
        ws = self.working_set
        if ws is None:
            return
        self._parked_now.clear()
        self._new_ahead = 0
        if self._ahead_mode():
            self._hold_back_ahead(out)
            return
        self.ahead.clear()
        if not ws.enabled:  # nothing is held back; the estimates only feed the gauge (_record_working_set)
            self._ws_total = 0
            return
        est = ws.estimates(self.running)
        total = sum(est)
        while len(self.running) > 1 and total > ws.limit:
            if self.running[-1].seq_id in self.layers_done:  # a layer-segmented prefill is never paused
                break
            seq = self.running.pop()
            total -= est.pop()
            self.device_space.pause(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
            out.preempted.append(seq)
            out.held_back.append(seq)
        self._ws_total = total

    def _working_set_need(self, seq: Sequence) -> int | None:
        """A waiting sequence's working-set estimate, None if the limit keeps it waiting (a sequence always fits
        an empty batch)."""
        ws = self.working_set
        if ws is None or not ws.enabled:
            return 0
        need = ws.estimates([seq])[0]
        if self.running and self._ws_total + need > ws.limit:
            return None
        return need

    # ---- prefill ahead (module docstring) -------------------------------------------------------------------

    def _ahead_mode(self) -> bool:
        ws = self.working_set
        return self.max_prefilled_waiting > 0 and ws is not None and ws.enabled

    def _hold_back_ahead(self, out: SchedulerOutput) -> None:
        """Over the limit the newest sequences with a decode share give it back (never the oldest): a decoding one
        is parked, one still prefilling becomes ahead. Then each ahead sequence whose prefill is done, oldest
        first, takes a share if it fits and no older sequence waits for one, else it is parked."""
        ws = self.working_set
        sharing = sorted((s for s in self.running if s.seq_id not in self.ahead), key=_arrival)
        est = ws.estimates(sharing)
        total = sum(est)
        while len(sharing) > 1 and total > ws.limit:
            seq = sharing.pop()
            total -= est.pop()
            if self._prefilled(seq):
                self._park(seq, out)
            else:
                self.ahead.add(seq.seq_id)
        done = sorted((s for s in self.running if s.seq_id in self.ahead and self._prefilled(s)), key=_arrival)
        for seq, need in zip(done, ws.estimates(done)):
            # a fresh scan per sequence: the one before it either got a share or was parked
            if not self._decode_blocked(seq, self._share_queue()) and (not sharing or total + need <= ws.limit):
                self.ahead.discard(seq.seq_id)
                sharing.append(seq)
                total += need
            else:
                self._park(seq, out)
        self._ws_total = total

    def _prefilled(self, seq: Sequence) -> bool:
        """Its prompt (and any recomputed outputs) is computed and its next token sampled: only decode is left."""
        return seq.num_computed_tokens > 0 and seq.num_tokens - seq.num_computed_tokens == 1 \
            and seq.seq_id not in self.layers_done

    def _is_parked(self, seq: Sequence) -> bool:
        """A waiting sequence paused with only decode left (it holds its blocks)."""
        return bool(seq.block_table) and self._prefilled(seq)

    def _park(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Pauses a running sequence with only decode left (its K/V stays in the host store) and queues it in
        arrival order among the waiting ones, so parked sequences resume oldest first."""
        self.running.remove(seq)
        self.ahead.discard(seq.seq_id)
        self.device_space.pause(seq)
        seq.status = SequenceStatus.WAITING
        key = _arrival(seq)
        at = next((i for i, w in enumerate(self.waiting) if _arrival(w) > key), len(self.waiting))
        self.waiting.insert(at, seq)
        self._parked_now.add(seq.seq_id)
        out.preempted.append(seq)
        out.held_back.append(seq)

    def _share_queue(self) -> _ShareQueue:
        """One pass over the running and waiting sequences for the decode-share rules (each admission candidate
        reads it; the callers scan again after a change)."""
        ahead = [s for s in self.running if s.seq_id in self.ahead]
        parked = [_arrival(w) for w in self.waiting if self._is_parked(w)]
        oldest = min([_arrival(s) for s in ahead] + parked, default=None)
        return _ShareQueue(oldest, len(self.ahead) + len(parked), any(not self._prefilled(s) for s in ahead))

    @staticmethod
    def _decode_blocked(seq: Sequence, queue: _ShareQueue) -> bool:
        """An older sequence waits for a decode share (parked, or prefilling ahead)."""
        return queue.oldest is not None and queue.oldest < _arrival(seq)

    def _decode_share(self, seq: Sequence, queue: _ShareQueue) -> tuple[int | None, bool]:
        """Admission of a waiting sequence: (its estimate, False) with a decode share; (its estimate, True) ahead,
        for its prefill only; (None, True) parked, it waits (newer sequences may still prefill); (None, False) it
        waits and so does every sequence behind it (the bound on prefilled waiting sequences is reached, or one
        prefills ahead already).

        One prefill ahead at a time: several would share the step's prefill budget and each finish later
        (processor sharing raised mean TTFT 8.2 -> 15.4 s and TPOT 66 -> 110 ms on an H100 with 16 allowed at
        once, docs/working_set.md), while one keeps prefill work first come first served and still fills the
        steps the limit leaves to decodes."""
        need = self.working_set.estimates([seq])[0]
        sharing = len(self.running) > len(self.ahead)
        if seq.seq_id not in self._parked_now and not self._decode_blocked(seq, queue) and \
                (not sharing or self._ws_total + need <= self.working_set.limit):
            return need, False
        if self._is_parked(seq):
            return None, True
        if queue.waiting >= self.max_prefilled_waiting or queue.prefilling_ahead:
            return None, False
        return need, True

    def _record_working_set(self, out: SchedulerOutput) -> None:
        """Statistics: the running working sets, the requests kept waiting when the limit stopped the batch
        (held back this step, or admission stopped by it), the hold-backs."""
        ws = self.working_set
        if ws is None:
            return
        if self._ahead_mode():
            self._record_ahead(out)
            return
        if not ws.enabled:  # the gauge only, when due
            if ws.due():
                ws.record(sum(ws.estimates(self.running)), 0, 0)
            return
        limited = bool(out.held_back) or (bool(self.waiting) and self._ws_limited_admission())
        # Without preemptions beyond the hold-backs the running set is what _hold_back and the admissions summed.
        total = self._ws_total if len(out.preempted) == len(out.held_back) else sum(ws.estimates(self.running))
        ws.record(total, len(self.waiting) if limited else 0, len(out.held_back))

    def _record_ahead(self, out: SchedulerOutput) -> None:
        """Statistics with prefill ahead: the decode shares' working sets, the requests without a share because of
        the limit (ahead, parked, and the waiting ones behind them), pauses, parked requests, admissions ahead."""
        ws = self.working_set
        sharing = [s for s in self.running if s.seq_id not in self.ahead]
        parked = sum(1 for w in self.waiting if self._is_parked(w))
        limited = bool(out.held_back or self.ahead or parked)
        ws.record(sum(ws.estimates(sharing)), len(self.waiting) + len(self.ahead) if limited else 0,
                  len(out.held_back))
        ws.record_prefill_ahead(parked, self._new_ahead)

    def _ws_limited_admission(self) -> bool:
        """Whether the head of the queue is refused by the working-set limit (and by nothing that comes first:
        a full batch)."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        return self._working_set_need(self.waiting[0]) is None

    # ---- admission ----------------------------------------------------------------------------------------

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Admits the head of the waiting queue if it fits (prefix-cache hits taken, blocks allocated, device
        space mapped); returns the tokens it computes this step, 0 (and nothing changed) if it must wait."""
        if seq.block_table:  # paused under KV offload: everything computed is still there
            return self._resume(seq, budget)
        bs, alloc = self.block_size, self.allocator
        hashes = self._prompt_hashes(seq)
        hit = alloc.lookup(hashes)
        host_hit = self.host_cache.lookup(hashes[len(hit):]) if self.host_cache is not None and hit != hashes else 0
        computed = (len(hit) + host_hit) * bs
        n = self._chunk(seq, computed, budget)
        if n == 0:
            return 0
        need = blocks_needed(computed + n, bs) - len(hit)
        parked = sum(1 for b in hit if alloc.ref_count(b) == 0)  # hits that leave the free blocks when shared
        if not alloc.can_allocate(need + parked):
            return 0
        if not self._fits_with_growth(seq, held=len(hit), taken=parked):
            return 0
        seq.num_computed_tokens = computed  # what the device space's checks read
        if self.device_space is not None and not (self.device_space.can_admit(seq, self.running)
                                                  and self.device_space.can_schedule(seq, n)):
            seq.num_computed_tokens = 0
            return 0
        alloc.share(hit)
        seq.block_table = list(hit)
        if host_hit:
            restored = alloc.allocate(host_hit)
            tier = hashes[len(hit):len(hit) + host_hit]
            self.host_cache.restore(restored, tier)
            for b, h in zip(restored, tier):
                alloc.cache_block(b, h)
            seq.block_table += restored
        seq.num_cached_blocks = len(seq.block_table)
        self._count_first_admission(seq, computed, len(hit), host_hit)
        self._grow(seq, n)
        return n

    def _count_first_admission(self, seq: Sequence, computed: int, hit: int, host_hit: int) -> None:
        if seq.num_cached_tokens is None:  # first admission: the request's prefix-cache statistics
            bs = self.block_size
            seq.num_cached_tokens = computed
            st = self.prefix_stats
            st.queries += seq.num_tokens
            st.hits += hit * bs
            if self.host_cache is not None:
                st.host_queries += seq.num_tokens - hit * bs
                st.host_hits += host_hit * bs

    # ---- layer-segmented prefill --------------------------------------------------------------------------

    @staticmethod
    def _only_decodes(out: SchedulerOutput) -> bool:
        """Nothing but one-token rows scheduled so far this step: a layer-segmented prefill then runs at least one
        layer even if it costs more than the budget left (a layer cannot be split; it never starves behind a
        long-running decode batch)."""
        return not out.segments and all(n == 1 for _, n in out.scheduled)

    def _admit_segmented(self, seq: Sequence, budget: int, alone: bool) -> LayerSegment | None:
        """Admits the head of the waiting queue into layer-segmented prefill if it fits (None: it waits): the
        prefix-cache hits taken (a paused one keeps its blocks and computed prefix), every token block of its
        context allocated at once (each layer writes them all), its first decode's window mapped on the device."""
        if self.layers_done:  # one at a time
            return None
        alloc, bs = self.allocator, self.block_size
        hit, parked, computed = None, 0, seq.num_computed_tokens
        if not seq.block_table:
            hit = alloc.lookup(self._prompt_hashes(seq))
            parked = sum(1 for b in hit if alloc.ref_count(b) == 0)
            computed = len(hit) * bs
        held = len(seq.block_table) if hit is None else len(hit)
        seg = self.segments.segment(seq, seq.num_tokens - computed, 0, budget, alone)
        need = blocks_needed(seq.num_tokens, bs) - held
        if seg is None or not alloc.can_allocate(need + parked) or not self._fits_with_growth(seq, held, parked):
            return None
        before, seq.num_computed_tokens = seq.num_computed_tokens, computed
        if not self.device_space.can_admit_segmented(seq, self.running):
            seq.num_computed_tokens = before
            return None
        if hit is not None:
            alloc.share(hit)
            seq.block_table = list(hit)
            seq.num_cached_blocks = len(hit)
            self._count_first_admission(seq, computed, len(hit), 0)
        blocks = alloc.allocate(need)
        seq.block_table.extend(blocks)
        self.device_space.on_allocate(blocks)
        self.device_space.schedule_segmented(seq)
        self.layers_done[seq.seq_id] = 0
        return seg

    def finish_segment(self, seg: LayerSegment) -> bool:
        """After the step that ran it: its layers are done; True when that completes the prefill (the engine
        then counts the prompt's tokens as computed)."""
        sid = seg.seq.seq_id
        if seg.end < self.segments.num_layers:
            self.layers_done[sid] = seg.end
            return False
        del self.layers_done[sid]
        return True

    def _resume(self, seq: Sequence, budget: int) -> int:
        n = self._chunk(seq, seq.num_computed_tokens, budget)
        if n == 0 or not self.allocator.can_allocate(self._new_blocks(seq, n)):
            return 0
        if not self._fits_with_growth(seq, held=len(seq.block_table), taken=0):
            return 0
        if self.device_space is not None and not (self.device_space.can_admit(seq, self.running)
                                                  and self.device_space.can_schedule(seq, n)):
            return 0
        self._grow(seq, n)
        return n

    def _prompt_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of the blocks a cache hit may cover: full blocks leaving at least min_chunk tokens."""
        if not self.allocator.enable_caching:
            return []
        bs = self.block_size
        limit = max(seq.num_tokens - self.min_chunk, 0) // bs
        return extend_block_hashes(seq.block_hashes, seq.token_ids, bs, limit, seq.cache_salt)[:limit]

    def _expected_outputs(self, seq: Sequence) -> int:
        """new_token_ratio of the outputs a sequence may still generate (at most RESERVE_CLIP_TOKENS)."""
        left = RESERVE_CLIP_TOKENS
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens)
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - seq.num_tokens)
        return math.ceil(self.new_token_ratio * max(left, 0))

    def _future_blocks(self, seq: Sequence, held: int) -> int:
        """Blocks a sequence holding `held` is still expected to take: all its tokens and expected outputs."""
        return max(blocks_needed(seq.num_tokens + self._expected_outputs(seq), self.block_size) - held, 0)

    def _fits_with_growth(self, seq: Sequence, held: int, taken: int) -> bool:
        """The admission rule (module docstring): the free blocks, less `taken` (cached hits the admission
        takes off the free list), cover the running sequences' expected blocks and the candidate's. Always
        true when nothing runs (a lone request may use every block) or the rule is off (ratio 0)."""
        if not self.running or self.config.init_new_token_ratio == 0.0:
            return True
        reserved = sum(self._future_blocks(s, len(s.block_table)) for s in self.running)
        return self.allocator.num_free - taken - reserved >= self._future_blocks(seq, held)

    def _adapt_ratio(self, preempted: bool) -> None:
        cfg = self.config
        if preempted:
            self.new_token_ratio += (1.0 - self.new_token_ratio) / 2
        elif self.running:
            self.new_token_ratio = max(cfg.min_new_token_ratio, self.new_token_ratio - self._ratio_decay)

    # ---- prefix caching -----------------------------------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """After a step: the blocks its computed tokens filled join the prefix cache (and, new to it, the
        host tier)."""
        alloc = self.allocator
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if not alloc.enable_caching or full <= seq.num_cached_blocks:
            return
        hashes = extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, full, seq.cache_salt)
        fresh_blocks, fresh_hashes = [], []
        for j in range(seq.num_cached_blocks, full):
            if alloc.cache_block(seq.block_table[j], hashes[j]):
                fresh_blocks.append(seq.block_table[j])
                fresh_hashes.append(hashes[j])
        seq.num_cached_blocks = full
        if self.host_cache is not None and fresh_blocks:
            self.host_cache.store(fresh_blocks, fresh_hashes)

    # ---- preemption and release ---------------------------------------------------------------------------

    def _preempt(self, seq: Sequence, keep: bool) -> None:
        """keep (only the device space is short): pause, the computed K/V stays in the host store. Otherwise
        recompute: the blocks go back (full ones stay cached), its tokens so far are its new prompt. Either
        way it is requeued at the front."""
        self.layers_done.pop(seq.seq_id, None)  # a layer-segmented prefill starts again at layer 0
        self.ahead.discard(seq.seq_id)  # it asks for a decode share again when readmitted
        if keep and self.device_space is not None:
            self.device_space.pause(seq)
        else:
            self._release(seq)
            seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _drop_paused(self) -> bool:
        """Token blocks ran short: the newest paused sequence gives its blocks back (its full blocks stay
        cached). False when none is paused."""
        for seq in reversed(self.waiting):
            if seq.block_table:
                self._release(seq)
                seq.num_computed_tokens = 0
                return True
        return False

    def _release(self, seq: Sequence) -> None:
        if self.device_space is not None:
            self.device_space.free(seq)
        self.allocator.free(seq.release_blocks())

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence wherever it is and returns its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        self.layers_done.pop(seq.seq_id, None)
        self.ahead.discard(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
