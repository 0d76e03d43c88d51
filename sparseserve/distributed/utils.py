"""How a model's heads split over tensor-parallel ranks.

Rank r's share of the attention output (o_proj's input) is query heads
[r * Hq / tp, (r + 1) * Hq / tp). With Hkv >= tp, KV heads split evenly and each rank attends
with its KV heads' groups, exactly its share. With Hkv < tp, each KV head is replicated on
tp / Hkv consecutive ranks, each attending with the whole group and keeping its share, so a
group's sparse selection sees all its query heads (docs/tensor_parallel.md).
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

    num_heads: int  # query heads the rank attends with: its KV heads' whole groups
    num_kv_heads: int
    q_start: int
    kv_start: int
    # the rank's share of the attention output: attended heads [out_offset, out_offset + out_heads)
    out_offset: int
    out_heads: int


def shard_heads(num_heads: int, num_kv_heads: int, tp_size: int, rank: int = 0) -> HeadShard:
    """Rank `rank`'s heads; ValueError when the heads do not split over tp_size ranks."""
    out = divide(num_heads, tp_size, "the number of attention heads")
    if num_kv_heads >= tp_size:
        kv = divide(num_kv_heads, tp_size, "the number of KV heads")
        return HeadShard(out, kv, rank * out, rank * kv, 0, out)
    if tp_size % num_kv_heads:
        raise ValueError(
            f"the number of KV heads ({num_kv_heads}) must divide tensor_parallel_size ({tp_size}) "
            f"when it is smaller (each KV head is then replicated on tp / KV heads ranks)"
        )
    group = num_heads // num_kv_heads
    kv_start = rank // (tp_size // num_kv_heads)
    return HeadShard(group, 1, kv_start * group, kv_start, rank * out - kv_start * group, out)
