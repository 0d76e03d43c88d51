import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim (the packed gate_up projection)."""
    if x.is_cuda:
        from sparseserve.kernels.small_ops import silu_and_mul as fused
        return fused(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
