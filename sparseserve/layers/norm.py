from __future__ import annotations

import torch
from torch import nn

from sparseserve.kernels.small_ops import add_rmsnorm


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 as transformers does; optionally fused with the residual add."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return add_rmsnorm(x, residual, self.weight, self.eps)
