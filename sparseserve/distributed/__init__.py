"""Tensor parallelism over torch.distributed: the process group (group.py), how heads split (utils.py), starting
the ranks (launch.py) and rank 0's step messages (channel.py). docs/tensor_parallel.md has the design."""
from sparseserve.distributed.group import TPGroup, get_tp_group

__all__ = ["TPGroup", "get_tp_group"]
