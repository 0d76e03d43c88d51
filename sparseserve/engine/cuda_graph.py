"""CUDA graphs of the decode step: one graph per batch-size bucket over static inputs.

A decode step of a large model is hundreds of small kernels; replaying a captured graph removes their launch
gaps. The graphs' inputs (token ids, positions, and the fields the attention backend names in `graph_inputs`:
slots, lengths, block tables, its own addressing) live in one device buffer (kvcache/staging.py
StaticInputs): a step that will replay is built straight into it (`begin` hands the runner and the backend
the step's upload) and reaches the device in one copy, so nothing is left to copy between the step's
building and its replay. The buckets' layouts share that buffer, so a graph replays the inputs of the last step
built only if that step was its own bucket's (a benchmark replaying by hand does so right after such a step).
Padding rows (batch < bucket) carry slot -1 and length 0, which the kernels skip, so a graph serves any batch up
to its bucket. On a device without CUDA graphs (the CPU tests) a "replay" runs
the captured step eagerly over the same static inputs: the computation a replay repeats, padding rows included.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from sparseserve.attention.backend import AttentionBackend
from sparseserve.kvcache.blocks import blocks_needed
from sparseserve.kvcache.staging import InputField, StaticInputs
from sparseserve.profiler import Profiler

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model, backend: AttentionBackend, kv_caches: list[torch.Tensor], max_batch: int,
                 max_model_len: int, block_size: int, profiler: Profiler | None = None) -> None:
        dev = kv_caches[0].device
        self.buckets = batch_buckets(max_batch)
        fields = [InputField("input_ids", torch.long), InputField("positions", torch.long)]
        fields += backend.graph_inputs(self.buckets[-1], blocks_needed(max_model_len, block_size))
        self.inputs = StaticInputs(fields, self.buckets, dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph | _EagerStep] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.profiler = profiler  # each replay is its phase "graph"
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
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that holds num_seqs rows (None: none does)."""
        return next((s for s in self.buckets if s >= num_seqs), None)

    def begin(self, num_seqs: int) -> StaticInputs | None:
        """The upload of a pure-decode step of num_seqs rows, built into the static inputs of its bucket
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
    """A captured step's stand-in without CUDA graphs: `replay` runs it and keeps its logits where a graph's
    output would be."""

    def __init__(self, step, logits: dict[int, torch.Tensor], bucket: int) -> None:
        self.step, self.logits, self.bucket = step, logits, bucket

    def replay(self) -> None:
        self.logits[self.bucket] = self.step()
