import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim (the packed gate_up projection)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
