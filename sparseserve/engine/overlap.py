"""Async scheduling: step N+1 is scheduled and launched while step N runs (docs/engine.md).

A sequence N samples for carries a PLACEHOLDER until N lands; the runner fills it on the device
from N's tokens (`TokenFeed`). N's outputs are copied to pinned memory right after its sampling
(`HostCopies`) and read in the call that launches N+1 (`InflightStep.wait`). The trap: a
sequence that stopped at N already runs in N+1; that token is dropped."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from sparseserve.engine.request import Sequence, SequenceStatus
from sparseserve.engine.scheduler import SchedulerOutput
from sparseserve.layers.sampler import SamplerOutput

# Stands in token_ids for a token still on the device (never a valid id: the runner replaces it
# before the model reads it, and refuses a step that would feed it to the model).
PLACEHOLDER = -1
FINISHED = SequenceStatus.FINISHED


@dataclass
class TokenFeed:
    """The previous step's sampled tokens on the device, and each placeholder's row in them; their
    host copy lands when `event` fires (before the next step's forward: the host may wait on it)."""

    token_ids: torch.Tensor | None
    rows: dict[int, int]  # seq_id -> row of token_ids
    host_ids: torch.Tensor | None = None
    event: torch.cuda.Event | None = None

    def host_values(self, rows: list[int]) -> list[int]:
        """The sampled tokens of `rows` on the host, waiting for the previous step's copy only."""
        if self.host_ids is not None:
            if self.event is not None:
                self.event.synchronize()
            return self.host_ids[rows].tolist()
        return self.token_ids[torch.tensor(rows, device=self.token_ids.device)].tolist()

    EMPTY: ClassVar[TokenFeed]


TokenFeed.EMPTY = TokenFeed(None, {})


class HostCopies:
    """A ring of pinned buffers (by output, shape, dtype) and an event per slot, reused each step.
    The trap: a slot is rewritten two copies later, so the engine must consume a step's copies
    before it launches the step after next (docs/engine.md, "Async scheduling")."""

    MAX_BUFFERS = 64  # per slot: shapes come and go with the batch (and the logprobs asked for)

    def __init__(self, num_slots: int = 3, pin_memory: bool = True) -> None:
        # per slot: (output field, shape, dtype) -> buffer (ids and ranks share shape and dtype)
        self.buffers: list[dict[tuple[int, torch.Size, torch.dtype], torch.Tensor]] = [{} for _ in range(num_slots)]
        self.events: list[torch.cuda.Event | None] = [None] * num_slots
        self.slot = 0
        self.pin_memory = pin_memory

    def copy(self, out: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event | None]:
        """Starts the copies of `out` into the next slot's buffers, on the current stream; returns
        the host tensors and the event recorded after them (None: outputs not on a CUDA device)."""
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

        host = SamplerOutput(
            to_host(0, out.token_ids),
            to_host(1, out.logprobs),
            to_host(2, out.logprob_token_ids),
            to_host(3, out.sampled_ranks),
        )
        if out.token_ids.is_cuda:
            if event is None:
                event = self.events[slot] = torch.cuda.Event()
            event.record()
        return host, event


@dataclass
class InflightStep:
    sched: SchedulerOutput
    sampled: list[Sequence]
    out: SamplerOutput | None  # device tensors (None: nothing sampled)
    host: SamplerOutput | None = None  # their host copies, complete once `event` has fired
    event: torch.cuda.Event | None = None
    placeholder: list[bool] = field(default_factory=list)  # per sampled row: holds a placeholder

    @classmethod
    def launch(
        cls, sched: SchedulerOutput, sampled: list[Sequence], out: SamplerOutput | None, copies: HostCopies
    ) -> InflightStep:
        """Starts the copies of the step's outputs into `copies` (the engine's), on the stream right
        after its sampling."""
        step = cls(sched, sampled, out, placeholder=[False] * len(sampled))
        if out is None:
            return step
        if not out.token_ids.is_cuda:
            step.host = out
            return step
        step.host, step.event = copies.copy(out)
        return step

    def add_placeholders(self, max_model_len: int) -> None:
        """After the step's bookkeeping: each sampled sequence that may go on gets a placeholder."""
        for i, seq in enumerate(self.sampled):
            if seq.status is FINISHED:  # (not the properties: per sequence and step)
                continue
            n, max_tokens = len(seq.token_ids), seq.params.max_tokens
            if n + 1 >= max_model_len or (max_tokens is not None and n - len(seq.prompt_token_ids) + 1 >= max_tokens):
                continue  # certain to end with this step's token: nothing to schedule for it next
            seq.token_ids.append(PLACEHOLDER)
            self.placeholder[i] = True

    def feed(self) -> TokenFeed:
        rows = {
            s.seq_id: i
            for i, (s, ph) in enumerate(zip(self.sampled, self.placeholder))
            if ph and s.status is not FINISHED
        }
        if self.out is None:
            return TokenFeed(None, rows)
        host = self.host.token_ids if self.host is not None else None
        return TokenFeed(self.out.token_ids, rows, host, self.event)

    def wait(self) -> SamplerOutput:
        """The host copies of the outputs (the one host sync of the step)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host
