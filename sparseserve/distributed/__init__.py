"""Tensor parallelism over torch.distributed: the process group (group.py), head splits
(utils.py), starting the ranks (launch.py), rank 0's step messages (channel.py).
Design: docs/tensor_parallel.md."""

from sparseserve.distributed.group import TPGroup, get_tp_group

__all__ = ["TPGroup", "get_tp_group"]
