"""CUDA graphs of the decode step: one graph per batch-size bucket over static input buffers.

A decode step of a large model is hundreds of small kernels; replaying a captured graph removes their launch
gaps. The graphs own the token inputs; the attention backend owns the static buffers of its metadata
(attention/backend.py `init_capture_graph`, `capture_metadata`, `prepare_for_replay`). Padding rows (batch <
bucket) carry slot -1 and length 0, which the kernels skip, so a graph serves any batch up to its bucket.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from sparseserve.attention.backend import AttentionBackend, AttentionMetadata
from sparseserve.kvcache.blocks import blocks_needed

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model, backend: AttentionBackend, kv_caches: list[torch.Tensor], max_batch: int,
                 max_model_len: int, block_size: int) -> None:
        dev = kv_caches[0].device
        self.backend = backend
        self.buckets = batch_buckets(max_batch)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        backend.init_capture_graph(n, blocks_needed(max_model_len, block_size))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.timer = None  # optional phase timer (benchmarks): each replay is phase "graph"
        pool = None
        for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory pool
            meta = backend.capture_metadata(b)

            def step(b=b, meta=meta):
                hidden = model(self.input_ids[:b], self.positions[:b], kv_caches, meta)
                return model.compute_logits(hidden)

            step()  # compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = step()
            pool = graph.pool()
            self.graphs[b] = graph
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def can_run(self, num_seqs: int, num_decodes: int) -> bool:
        return num_decodes == num_seqs and num_seqs <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a pure-decode batch."""
        b = meta.num_seqs
        bucket = next(s for s in self.buckets if s >= b)
        with self.timer.phase("graph") if self.timer is not None else contextlib.nullcontext():
            self.input_ids[:b].copy_(input_ids, non_blocking=True)
            self.positions[:b].copy_(positions, non_blocking=True)
            self.backend.prepare_for_replay(meta, bucket)
            self.graphs[bucket].replay()
        return self.logits[bucket][:b]
