"""The prefix cache's host tier without KV offload (docs/prefix_cache.md, "Without KV offload"):
full token blocks by hash in pinned host memory, written through once after the step that filled
them (`store`), found after a device-cache hit (`lookup`) and copied back into new device blocks
(`restore`, run by `begin_step` before the step's kernels). A block is its row of every tensor
indexed by token block (KV cache, key metadata). One row-gather kernel per tensor each way, on
the compute stream, never waiting on the host. LRU when full.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from sparseserve.kernels.flash_h2d import flash_h2d_ref, flash_h2d_triton
from sparseserve.kvcache.host import pinned_zeros
from sparseserve.kvcache.prefix_cache import BlockHash
from sparseserve.kvcache.transfer import to_device_many


def layer_stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[L, N, ...] over per-layer tensors [N, ...] that are consecutive slices of one tensor (the
    runner's KV cache), without a copy; a stacked copy would not alias the cache."""
    base = tensors[0]._base
    if (
        base is not None
        and base.shape[0] == len(tensors)
        and all(t.data_ptr() == base[i].data_ptr() and t.shape == base[i].shape for i, t in enumerate(tensors))
    ):
        return base
    raise ValueError("the per-layer KV caches are not slices of one tensor")


def _copy_rows(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] over flat [rows, ...] views; on a GPU one Triton
    gather reading or writing pinned host rows over UVA (no host sync)."""
    if src.is_cuda or dst.is_cuda:
        dev = src.device if src.is_cuda else dst.device
        flash_h2d_triton(src, dst, *to_device_many([src_rows, dst_rows], dev))
    else:
        flash_h2d_ref(src, dst, src_rows, dst_rows)


class HostPrefixCache:
    def __init__(self, device_tensors: list[torch.Tensor], num_slots: int, pin: bool | None = None) -> None:
        """device_tensors: each [layers, token blocks, ...], a token block's data in every layer
        (the KV cache, key metadata); num_slots: blocks the tier holds."""
        if num_slots < 1:
            raise ValueError(f"the host prefix cache needs at least one block, got {num_slots}")
        pin = torch.cuda.is_available() if pin is None else pin
        self.num_slots = num_slots
        self.device = [t.view(t.shape[0] * t.shape[1], *t.shape[2:]) for t in device_tensors]  # alias
        self._blocks = [t.shape[1] for t in device_tensors]
        self._layers = [t.shape[0] for t in device_tensors]
        shapes = [(t.shape[0], num_slots, *t.shape[2:]) for t in device_tensors]
        host = [
            pinned_zeros(s, t.dtype) if pin else torch.zeros(s, dtype=t.dtype) for s, t in zip(shapes, device_tensors)
        ]
        self.host = [h.view(-1, *h.shape[2:]) for h in host]
        self._slot_of: OrderedDict[BlockHash, int] = OrderedDict()  # first = least recently used
        self._free = list(range(num_slots - 1, -1, -1))
        self._restores: list[tuple[int, int]] = []  # (slot, device block), executed by begin_step
        self.num_evictions = 0
        self.num_stored = 0
        self.num_restored = 0

    @staticmethod
    def block_bytes(device_tensors: list[torch.Tensor]) -> int:
        """Host bytes of one block: its row of every layer of every tensor."""
        return sum(t[:, 0].numel() * t.element_size() for t in device_tensors)

    @property
    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.host)

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    def lookup(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of a hash chain the tier holds (no state change)."""
        n = 0
        for h in hashes:
            if h not in self._slot_of:
                break
            n += 1
        return n

    def restore(self, blocks: list[int], hashes: list[BlockHash]) -> None:
        """Queues copies of held blocks into these device blocks (before the next step's
        kernels); they become the most recently used."""
        for b, h in zip(blocks, hashes):
            self._slot_of.move_to_end(h)
            self._restores.append((self._slot_of[h], b))

    def store(self, blocks: list[int], hashes: list[BlockHash]) -> None:
        """Copies device blocks that just joined the prefix cache into host slots (those whose
        hash the tier lacks; the least recently used slots are evicted for them), behind the
        kernels that filled them."""
        src, dst = [], []
        for b, h in zip(blocks, hashes):
            if h in self._slot_of:
                self._slot_of.move_to_end(h)
                continue
            if self._free:
                slot = self._free.pop()
            else:
                _, slot = self._slot_of.popitem(last=False)
                self.num_evictions += 1
            self._slot_of[h] = slot
            src.append(b)
            dst.append(slot)
        if src:
            self.num_stored += len(src)
            self._copy(self.device, self.host, src, dst, self._blocks, [self.num_slots] * len(self.host))

    def begin_step(self) -> None:
        """Before any kernel of a step: the restores its schedule queued."""
        if not self._restores:
            return
        slots, blocks = [s for s, _ in self._restores], [b for _, b in self._restores]
        self._restores = []
        self.num_restored += len(blocks)
        self._copy(self.host, self.device, slots, blocks, [self.num_slots] * len(self.host), self._blocks)

    def _copy(
        self,
        srcs: list[torch.Tensor],
        dsts: list[torch.Tensor],
        src_idx: list[int],
        dst_idx: list[int],
        src_rows: list[int],
        dst_rows: list[int],
    ) -> None:
        """Row src_idx[i] of each layer of each source tensor to row dst_idx[i] of that layer."""
        s, d = torch.tensor(src_idx, dtype=torch.int64), torch.tensor(dst_idx, dtype=torch.int64)
        for src, dst, sr, dr, layers in zip(srcs, dsts, src_rows, dst_rows, self._layers):
            lay = torch.arange(layers, dtype=torch.int64)[:, None]
            _copy_rows(src, dst, (lay * sr + s).reshape(-1), (lay * dr + d).reshape(-1))

    def check(self) -> None:
        """Accounting (tests): every slot free or holding exactly one hash."""
        used = list(self._slot_of.values())
        assert len(set(used)) == len(used), "a host slot holds two blocks"
        assert not set(used) & set(self._free) and len(set(self._free)) == len(self._free)
        assert len(used) + len(self._free) == self.num_slots, "host slot leak"
