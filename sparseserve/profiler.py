"""Optional hooks for benchmarks and probes, passed once at construction: `LLM(..., profiler=p)`
or `LLMEngine(config, profiler=p)`. The engine, the runner, the attention backend and the decode
graphs call them; None (the default) costs nothing. Subclass and override what you need."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch


class Profiler:
    def phase(self, name: str) -> ContextManager[Any]:
        """A timed region: "selection", "h2d", "attention" (eager sparse layers), "graph" (replay)."""
        return contextlib.nullcontext()

    def on_schedule(self, out: Any) -> None:
        """Each step's SchedulerOutput, before the step runs."""

    def on_logits(self, seqs: list, logits: torch.Tensor) -> torch.Tensor | None:
        """The step's logits [len(seqs), V] before sampling; return int64 [len(seqs)] tokens to
        append instead of the sampled ones (-1: keep the sampled one), or None. Rank 0 only."""
        return None
