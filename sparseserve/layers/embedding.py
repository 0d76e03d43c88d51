"""The vocabulary split over the tensor-parallel ranks: embedding rows and LM-head rows.

Rank r holds vocabulary rows [r * P, r * P + P), P = ceil(vocab / tp) (rows past the vocabulary:
zero padding). The embedding looks up the ids in its range, zeroes the others and all-reduces;
the LM head gathers its rows' logits to rank 0, which samples. Tied embeddings share the
parameter. At one rank both are F.embedding / F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparseserve.distributed.group import TPGroup, get_tp_group
from sparseserve.layers.linear import load_part


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or get_tp_group()
        self.num_embeddings = num_embeddings
        rows = -(-num_embeddings // self.tp.world_size)
        self.vocab_start = self.tp.rank * rows
        self.num_valid = max(min(num_embeddings - self.vocab_start, rows), 0)  # real tokens
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int | None = None) -> None:
        n = self.num_valid
        load_part(param.data[:n], loaded, (self.num_embeddings, param.shape[1]), 0, self.vocab_start)
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_valid)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] on rank 0; [N, 0] on the other ranks (only rank 0 samples)."""
        logits = F.linear(hidden, self.weight)
        if self.tp.world_size == 1:
            return logits.float()
        full = self.tp.gather(logits, dim=-1)
        if full is None:
            return logits.new_empty((hidden.shape[0], 0), dtype=torch.float32)
        return full[:, : self.num_embeddings].float()
