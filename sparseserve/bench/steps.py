"""A profiler for benchmarks (sparseserve/profiler.py): what each step scheduled, and CUDA-event times of the
library's named phases ("graph": a decode graph's replay; "selection", "h2d", "attention": eager sparse steps).
Pass it at construction: `LLMEngine.from_kwargs(log, ...)`, `LLM(model, profiler=log)`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from sparseserve.profiler import Profiler


@dataclass(frozen=True)
class Scheduled:
    """One step's schedule, read before it runs: decode rows (one generated token each), rows in all, prompt
    tokens and layer segments."""

    decodes: int
    rows: int
    prompt_tokens: int
    segments: int

    def pure_decode(self, batch: int | None = None) -> bool:
        """Every row decodes (of `batch` rows, if given), no prompt work."""
        return 0 < self.rows == self.decodes and not self.segments and batch in (None, self.rows)


class StepLog(Profiler):
    """`last`: the newest step's Scheduled. With `timing` on (CUDA only) each phase leaves (name, start, end)
    events in `events`; the caller clears them."""

    def __init__(self, timing: bool = False) -> None:
        self.last: Scheduled | None = None
        self.timing = timing
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def on_schedule(self, out: Any) -> None:
        decodes = [n == 1 and s.num_computed_tokens >= s.num_prompt_tokens for s, n in out.scheduled]
        prompt = sum(n for (_, n), d in zip(out.scheduled, decodes) if not d)
        self.last = Scheduled(sum(decodes), len(decodes), prompt, len(out.segments))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not (self.timing and torch.cuda.is_available()):
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.events.append((name, start, end))

    def times_ms(self, name: str, events: list | None = None) -> list[float]:
        """Each recorded `name` phase's milliseconds (waits for the device)."""
        events = self.events if events is None else events
        if events:
            torch.cuda.synchronize()
        return [a.elapsed_time(b) for n, a, b in events if n == name]

    def totals_ms(self) -> dict[str, float]:
        """Milliseconds summed per phase."""
        out: dict[str, float] = {}
        for name in {n for n, _, _ in self.events}:
            out[name] = sum(self.times_ms(name))
        return out
