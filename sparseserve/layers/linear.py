"""Linear layers split over the tensor-parallel ranks (Megatron-style).

Column-parallel: output features split, no communication. Row-parallel: input features split,
partial sums all-reduced (the bias added once, on rank 0). Packed projections hold a slice of
each part per rank, so a rank's output is its own [q | k | v] or [gate | up] and a decoder layer
needs two all-reduces (o_proj, down_proj). At one rank each layer is one F.linear.

Every parameter has `weight_loader(param, loaded, shard_id)`: `loaded` is the full checkpoint
tensor (or a lazy slice with `.shape` and `.narrow`, models/loader.py), shard_id the part of a
packed parameter (0, 1, 2 for q, k, v); packed parameters give their part count in `num_shards`.
See docs/tensor_parallel.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparseserve.distributed.group import TPGroup, get_tp_group
from sparseserve.distributed.utils import divide, shard_heads


def load_part(dst: torch.Tensor, loaded, full_shape: tuple[int, ...], dim: int | None = None, start: int = 0) -> None:
    """Copies loaded.narrow(dim, start, dst.shape[dim]) (all of it for dim None) into dst,
    after checking the checkpoint tensor's full shape."""
    if tuple(loaded.shape) != tuple(full_shape):
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(full_shape)}")
    if dim is None:
        dim, start = 0, 0
    dst.copy_(loaded.narrow(dim, start, dst.shape[dim]))


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup | None) -> None:
        super().__init__()
        self.tp = tp or get_tp_group()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int | None = None) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_Linear):
    """y[:, rank's slice] = x W[rank's rows]^T: output features split, input replicated."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup | None = None) -> None:
        tp = tp or get_tp_group()
        super().__init__(input_size, divide(output_size, tp.world_size, "a column-parallel output size"), bias, tp)
        self.output_size = output_size

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[0]
        load_part(param.data, loaded, (self.output_size, *param.shape[1:]), 0, self.tp.rank * n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate_up_proj): each
    rank holds its slice of every part, parts in order."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp: TPGroup | None = None):
        tp = tp or get_tp_group()
        self.output_sizes = list(output_sizes)
        self.local_sizes = [divide(s, tp.world_size, "a column-parallel output size") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, tp)
        for p in self.parameters(recurse=False):
            p.num_shards = len(output_sizes)

    def weight_loader(self, param, loaded, shard_id=None):
        offset, size = sum(self.local_sizes[:shard_id]), self.local_sizes[shard_id]
        load_part(
            param.data.narrow(0, offset, size),
            loaded,
            (self.output_sizes[shard_id], *param.shape[1:]),
            0,
            self.tp.rank * size,
        )


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, split by heads (`heads`: distributed/utils.py
    HeadShard; with fewer KV heads than ranks a KV head and its group are replicated)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TPGroup | None = None,
    ) -> None:
        tp = tp or get_tp_group()
        self.heads = h = shard_heads(num_heads, num_kv_heads, tp.world_size, tp.rank)
        self.num_heads, self.num_kv_heads, self.head_dim = h.num_heads, h.num_kv_heads, head_dim
        self.q_start, self.kv_start = h.q_start, h.kv_start
        self.full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.local_sizes = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        _Linear.__init__(self, hidden_size, sum(self.local_sizes), bias, tp)
        self.output_size = sum(self.full_sizes)
        for p in self.parameters(recurse=False):
            p.num_shards = 3

    def weight_loader(self, param, loaded, shard_id=None):
        offset, size = sum(self.local_sizes[:shard_id]), self.local_sizes[shard_id]
        start = (self.q_start if shard_id == 0 else self.kv_start) * self.head_dim
        load_part(param.data.narrow(0, offset, size), loaded, (self.full_sizes[shard_id], *param.shape[1:]), 0, start)


class RowParallelLinear(_Linear):
    """y = sum over ranks of x[:, rank's slice] W[:, rank's slice]^T (+ bias, once): input
    features split, the output all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup | None = None) -> None:
        tp = tp or get_tp_group()
        super().__init__(divide(input_size, tp.world_size, "a row-parallel input size"), output_size, bias, tp)
        self.input_size = input_size

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # the bias: whole on every rank, added by rank 0
            load_part(param.data, loaded, tuple(param.shape))
            return
        n = param.shape[1]
        load_part(param.data, loaded, (param.shape[0], self.input_size), 1, self.tp.rank * n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight, self.bias if self.tp.is_driver else None))
