"""CUDA graphs of the decode step: one per batch-size bucket, over static inputs (docs/engine.md).

The inputs live in engine/staging.py StaticInputs; a step that replays is built straight into
them (`begin`). Padding rows (slot -1, length 0) are skipped by every kernel, so a bucket serves
any smaller batch. The trap: buckets share one buffer, so a graph replays the inputs of the last
step built only if that step was its bucket's. Without CUDA graphs (CPU) a replay runs the
captured step eagerly over the same inputs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator

import torch

from sparseserve.attention.backend import AttentionBackend, InputField
from sparseserve.kvcache.blocks import blocks_needed
from sparseserve.engine.staging import StaticInputs
from sparseserve.profiler import Profiler

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's garbage collector off (after one full collection) for a CUDA graph capture. The trap: a
    collection inside a capture runs finalizers, and one that calls CUDA (an earlier engine's host store
    unregistering its pinned memory) invalidates the capture and leaks that registration."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class DecodeGraphs:
    def __init__(
        self,
        model,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        max_batch: int,
        max_model_len: int,
        block_size: int,
        profiler: Profiler | None = None,
    ) -> None:
        dev = kv_caches[0].device
        self.buckets = batch_buckets(max_batch)
        fields = [InputField("input_ids", torch.long), InputField("positions", torch.long)]
        fields += backend.graph_inputs(self.buckets[-1], blocks_needed(max_model_len, block_size))
        self.inputs = StaticInputs(fields, self.buckets, dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph | _EagerStep] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.profiler = profiler  # each replay is its phase "graph"
        with collector_paused() if dev.type == "cuda" else contextlib.nullcontext():
            self._capture(model, backend, kv_caches, dev)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _capture(self, model, backend: AttentionBackend, kv_caches: list[torch.Tensor], dev: torch.device) -> None:
        pool = None
        for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory pool
            views = self.inputs.views(b)
            meta = backend.capture_metadata(b, views)

            def step(b=b, meta=meta, views=views):
                hidden = model(views["input_ids"], views["positions"], kv_caches, meta)
                return model.compute_logits(hidden)

            self.inputs.reset(b)  # buckets share the buffer: the warm-up reads padding rows only
            if dev.type != "cuda":
                self.graphs[b] = _EagerStep(step, self.logits, b)
                continue
            step()  # compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = step()
            pool = graph.pool()
            self.graphs[b] = graph

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that holds num_seqs rows (None: none does)."""
        return next((s for s in self.buckets if s >= num_seqs), None)

    def begin(self, num_seqs: int) -> StaticInputs | None:
        """The upload of a pure-decode step of num_seqs rows, built into its bucket's static inputs
        (None: too many rows for any graph)."""
        bucket = self.bucket(num_seqs)
        return None if bucket is None else self.inputs.begin(bucket)

    def run(self, num_seqs: int) -> torch.Tensor:
        """Logits [B, vocab] of a pure-decode step built through `begin(num_seqs)` and committed."""
        bucket = self.bucket(num_seqs)
        with self.profiler.phase("graph") if self.profiler is not None else contextlib.nullcontext():
            self.graphs[bucket].replay()
        return self.logits[bucket][:num_seqs]


class _EagerStep:
    """A captured step's stand-in without CUDA graphs: `replay` runs it and keeps its logits where
    a graph's output would be."""

    def __init__(self, step, logits: dict[int, torch.Tensor], bucket: int) -> None:
        self.step, self.logits, self.bucket = step, logits, bucket

    def replay(self) -> None:
        self.logits[self.bucket] = self.step()
