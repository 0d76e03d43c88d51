"""CUDA graphs of the decode step: one graph per batch-size bucket over static input buffers.

A decode step of a large model is hundreds of small kernels; replaying a captured graph removes
their launch gaps. Padding rows (batch < bucket) carry slot -1 and seq_len 0, which the attention
kernels skip, so a graph can serve any batch up to its bucket size.

With kv_offload the step also reads token-block tables and slots (AttentionMetadata.token_*): static
buffers too, so the graph replays with new device and token block tables alike.
"""
from __future__ import annotations

import logging

import torch

from sparseserve.attention.backend import AttentionMetadata
from sparseserve.kvcache.blocks import blocks_needed

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model, kv_caches: torch.Tensor | list[torch.Tensor], max_batch: int, max_model_len: int,
                 block_size: int, offload: bool = False) -> None:
        """kv_caches: one tensor [L, NB, ...] or one per layer (kv_offload: dense and sparse layers differ)."""
        dev = kv_caches[0].device
        self.buckets = batch_buckets(max_batch)
        n = self.buckets[-1]
        self.max_blocks = blocks_needed(max_model_len, block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        # Per-sequence state slots (sparse decode); padding rows (seq_len 0) never touch their slot's state.
        self.state_slots = torch.arange(n, dtype=torch.int32, device=dev)
        self.token_slot_mapping = self.token_block_tables = None
        if offload:
            self.token_slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
            self.token_block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory pool
            meta = AttentionMetadata(self.slot_mapping[:b], self.query_start_loc[: b + 1], self.seq_lens[:b],
                                     self.block_tables[:b], num_decodes=b, max_query_len=1,
                                     max_seq_len=max_model_len, state_slots=self.state_slots[:b],
                                     token_slot_mapping=None if not offload else self.token_slot_mapping[:b],
                                     token_block_tables=None if not offload else self.token_block_tables[:b])

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
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[b:bucket].fill_(-1)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[b:bucket].zero_()
        self.block_tables[:b, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        if meta.state_slots is not None:
            self.state_slots[:b].copy_(meta.state_slots, non_blocking=True)
        if self.token_slot_mapping is not None:
            self.token_slot_mapping[:b].copy_(meta.token_slot_mapping, non_blocking=True)
            self.token_slot_mapping[b:bucket].fill_(-1)
            self.token_block_tables[:b, : meta.token_block_tables.shape[1]].copy_(meta.token_block_tables,
                                                                                  non_blocking=True)
        self.graphs[bucket].replay()
        return self.logits[bucket][:b]
