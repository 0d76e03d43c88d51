"""Small host -> device copies that never wait for the device: a ring of pinned staging slabs
(`PinnedStaging`) behind `to_device` / `to_device_many` (a step's addressing, sampling
parameters)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch


class PinnedStaging:
    """Page-locked staging of a device's small per-step host -> device copies: a ring of slabs,
    reused once their copies are done; several tensors share one host write, device allocation
    and copy, and come back as views. Not pageable memory (its copy waits for the stream's queued
    work) nor `pin_memory()` per tensor (docs/offload.md, "Lagged reads")."""

    def __init__(self, device: torch.device, num_slabs: int = 16, slab_bytes: int = 1 << 20) -> None:
        self.device = device
        self.slab_bytes = slab_bytes
        self.buf = torch.empty(num_slabs * slab_bytes, dtype=torch.uint8, pin_memory=True)
        self.host = self.buf.numpy()
        self.events: list[list[torch.cuda.Event]] = [[] for _ in range(num_slabs)]
        self.streams: dict[int, torch.cuda.Stream] = {}  # streams that copied out of this slab
        self.slab, self.offset = 0, 0
        self._lock = threading.Lock()

    def upload(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        spans = [-(-t.numel() * t.element_size() // 16) * 16 for t in tensors]  # 16-byte aligned
        total = sum(spans)
        if total > self.slab_bytes:  # rare (huge batches of long contexts): the allocator's way
            return [t.pin_memory().to(self.device, non_blocking=True) for t in tensors]
        with self._lock:
            if self.offset + total > self.slab_bytes:
                self._next_slab()
            base = self.slab * self.slab_bytes + self.offset
            self.offset += total
            pos = base
            for t, span in zip(tensors, spans):
                raw = t.contiguous().view(-1).view(torch.uint8).numpy()
                self.host[pos : pos + raw.size] = raw
                pos += span
            dev = torch.empty(total, dtype=torch.uint8, device=self.device)
            dev.copy_(self.buf[base : base + total], non_blocking=True)
            stream = torch.cuda.current_stream(self.device)
            self.streams[stream.stream_id] = stream
        out, pos = [], 0
        for t, span in zip(tensors, spans):
            out.append(dev[pos : pos + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
            pos += span
        return out

    def _next_slab(self) -> None:
        """The current slab's copies are marked by an event on each stream that issued one; the
        next slab is reused once its own are done (a ring of slabs: long done)."""
        self.events[self.slab] = [torch.cuda.Event() for _ in self.streams]
        for event, stream in zip(self.events[self.slab], self.streams.values()):
            event.record(stream)
        self.streams = {}
        self.slab = (self.slab + 1) % len(self.events)
        self.offset = 0
        for event in self.events[self.slab]:
            event.synchronize()


_STAGING: dict[int, PinnedStaging] = {}


def to_device_many(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Small host tensors (a step's addressing) on `device` without waiting for the device, in
    one copy (PinnedStaging); on CPU the tensors themselves."""
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    index = device.index if device.index is not None else torch.cuda.current_device()
    staging = _STAGING.get(index)
    if staging is None:
        staging = _STAGING[index] = PinnedStaging(torch.device("cuda", index))
    return staging.upload(tensors)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One small host tensor on `device` without waiting for the device (to_device_many)."""
    return to_device_many((t,), device)[0]
