"""Async scheduling (vLLM's `async_scheduling`, SGLang's overlap scheduler): a step in flight on the device while
the host schedules and prepares the next one.

The engine launches step N and returns; the next `step()` schedules N+1 as if every sequence N samples had its
token already (a PLACEHOLDER stands at the end of its token_ids, so the scheduler sees an ordinary decode),
launches N+1 (the runner reads each placeholder's token on the device from N's sampled tokens, `TokenFeed`),
and only then waits for N's tokens (copied to pinned host memory right after N's sampling, ordered before
N+1) and processes them: the placeholder is replaced, stop checks run, deltas go out. A sequence that stopped
at N already runs in N+1: that token is dropped. A sequence certain to end at N by length (max_tokens,
max_model_len) gets no placeholder, so the scheduler has nothing to schedule for it in N+1.

Why the rest stays correct: every device-side effect of the host's work (block reuse after a free, new block
tables, cached blocks shared) is ordered on the one stream after the steps already in flight; the prefix cache
hashes only computed tokens, which are real by the time a step's bookkeeping runs (after the previous step
landed); a sequence preempted while its token is in flight is re-admitted two steps later at the earliest (a
step that preempts admits nothing), when the token has landed. Under KV offload the same holds for the hierarchical
cache: a pause saves its partial tail block with a synchronous copy, which waits for the step in flight that wrote
it; restores, pool invalidations and reused device blocks are device work ordered after that step; and the fence
before a step's kernels waits for the FlashD2H copies of the step in flight (a host wait on steps that prefill).
A layer-segmented prefill's segment (engine/layer_prefill.py) reads only the prompt's tokens, never a
placeholder, and its progress is booked when its step is launched, as in synchronous scheduling; its writes to
the host store are fenced like any FlashD2H copy."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from sparseserve.engine.request import Sequence, SequenceStatus
from sparseserve.engine.scheduler import SchedulerOutput
from sparseserve.layers.sampler import SamplerOutput

# Stands in token_ids for a token still on the device (never a valid id: the runner replaces it before the model
# reads it, and refuses a step that would feed it to the model).
PLACEHOLDER = -1
FINISHED = SequenceStatus.FINISHED


@dataclass
class TokenFeed:
    """The previous step's sampled tokens on the device, and the row of each sequence whose placeholder they fill."""
    token_ids: torch.Tensor | None
    rows: dict[int, int]  # seq_id -> row of token_ids

    EMPTY: ClassVar[TokenFeed]


TokenFeed.EMPTY = TokenFeed(None, {})


class HostCopies:
    """Pinned host buffers for a step's sampled outputs, copied from the device right after its sampling, reused
    from step to step: a fresh pinned tensor goes through the caching host allocator (tens of microseconds each,
    every step) and a fresh CUDA event is created at its first record. A ring of slots, each with its buffers by
    (output, shape, dtype) and its event.

    Why a slot may be rewritten: the engine consumes a step's host copies (`InflightStep.wait`, then the values
    into Python lists) in the call that launches the next step, after that launch; so when a copy starts, at most
    one earlier copy is still unconsumed, and with three slots a slot's previous values were consumed two copies
    ago. Its event, synchronized before the rewrite, says that its previous copy landed (long ago: consuming
    waited for it)."""

    MAX_BUFFERS = 64  # per slot: shapes come and go with the batch (and the logprobs asked for)

    def __init__(self, num_slots: int = 3, pin_memory: bool = True) -> None:
        # per slot: (output field, shape, dtype) -> buffer (token ids and sampled ranks share a shape and dtype)
        self.buffers: list[dict[tuple[int, torch.Size, torch.dtype], torch.Tensor]] = [{} for _ in range(num_slots)]
        self.events: list[torch.cuda.Event | None] = [None] * num_slots
        self.slot = 0
        self.pin_memory = pin_memory

    def copy(self, out: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event | None]:
        """Starts the copies of `out` into the next slot's buffers, on the current stream; returns the host
        tensors and the event recorded after the copies (None for outputs not on a CUDA device)."""
        slot = self.slot
        self.slot = (slot + 1) % len(self.buffers)
        event = self.events[slot]
        if event is not None:
            event.synchronize()
        buffers = self.buffers[slot]
        if len(buffers) > self.MAX_BUFFERS:
            buffers.clear()

        def to_host(field: int, t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            key = (field, t.shape, t.dtype)
            h = buffers.get(key)
            if h is None:
                h = buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin_memory)
            return h.copy_(t, non_blocking=True)

        host = SamplerOutput(to_host(0, out.token_ids), to_host(1, out.logprobs), to_host(2, out.logprob_token_ids),
                             to_host(3, out.sampled_ranks))
        if out.token_ids.is_cuda:
            if event is None:
                event = self.events[slot] = torch.cuda.Event()
            event.record()
        return host, event


@dataclass
class InflightStep:
    sched: SchedulerOutput
    sampled: list[Sequence]
    out: SamplerOutput | None                # device tensors (None: nothing sampled)
    host: SamplerOutput | None = None        # their host copies, complete once `event` has fired
    event: torch.cuda.Event | None = None
    placeholder: list[bool] = field(default_factory=list)  # per sampled row: a placeholder stands for its token

    @classmethod
    def launch(cls, sched: SchedulerOutput, sampled: list[Sequence], out: SamplerOutput | None,
               copies: HostCopies) -> InflightStep:
        """Starts the copies of the step's outputs to host memory (into `copies`, the engine's), on the stream
        right after its sampling."""
        step = cls(sched, sampled, out, placeholder=[False] * len(sampled))
        if out is None:
            return step
        if not out.token_ids.is_cuda:
            step.host = out
            return step
        step.host, step.event = copies.copy(out)
        return step

    def add_placeholders(self, max_model_len: int) -> None:
        """After the step's bookkeeping: each sampled sequence that may go on gets a placeholder token."""
        for i, seq in enumerate(self.sampled):
            if seq.status is FINISHED:  # (Sequence.finished; lengths from the lists: per sequence and step)
                continue
            n, max_tokens = len(seq.token_ids), seq.params.max_tokens
            if n + 1 >= max_model_len or (max_tokens is not None and n - len(seq.prompt_token_ids) + 1 >= max_tokens):
                continue  # certain to end with this step's token: nothing to schedule for it next
            seq.token_ids.append(PLACEHOLDER)
            self.placeholder[i] = True

    def feed(self) -> TokenFeed:
        rows = {s.seq_id: i for i, (s, ph) in enumerate(zip(self.sampled, self.placeholder))
                if ph and s.status is not FINISHED}
        return TokenFeed(self.out.token_ids if self.out is not None else None, rows)

    def wait(self) -> SamplerOutput:
        """The host copies of the outputs (the one host sync of the step)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host
