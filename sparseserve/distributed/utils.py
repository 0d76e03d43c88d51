"""How a model's heads split over tensor-parallel ranks.

Query heads split evenly for the output projection: rank r's share of the attention output (o_proj's input) is
heads [r * Hq / tp, (r + 1) * Hq / tp). KV heads split evenly when there are at least as many as ranks, and
each rank attends with the query heads of its KV heads, which are exactly its share (GQA groups do not straddle
ranks). With fewer KV heads than ranks, each KV head is replicated on tp / Hkv consecutive ranks, and each of
those attends with the KV head's whole group of query heads, then keeps its share for o_proj: a group's sparse
block selection is scored over all its query heads, as at one rank, with no collective inside attention (decode
attention reads a KV head's blocks once for its whole group, so the extra query heads cost little).
"""
from __future__ import annotations

from dataclasses import dataclass


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


@dataclass(frozen=True)
class HeadShard:
    """One rank's heads (indices are global heads)."""
    num_heads: int      # query heads the rank attends with: its KV heads' whole groups
    num_kv_heads: int
    q_start: int
    kv_start: int
    out_offset: int     # the rank's share of the attention output: attended heads [out_offset, out_offset + out_heads)
    out_heads: int


def shard_heads(num_heads: int, num_kv_heads: int, tp_size: int, rank: int = 0) -> HeadShard:
    """Rank `rank`'s heads; ValueError when the heads do not split over tp_size ranks."""
    out = divide(num_heads, tp_size, "the number of attention heads")
    if num_kv_heads >= tp_size:
        kv = divide(num_kv_heads, tp_size, "the number of KV heads")
        return HeadShard(out, kv, rank * out, rank * kv, 0, out)
    if tp_size % num_kv_heads:
        raise ValueError(f"the number of KV heads ({num_kv_heads}) must divide tensor_parallel_size ({tp_size}) "
                         f"when it is smaller (each KV head is then replicated on tp / KV heads ranks)")
    group = num_heads // num_kv_heads
    kv_start = rank // (tp_size // num_kv_heads)
    return HeadShard(group, 1, kv_start * group, kv_start, rank * out - kv_start * group, out)
