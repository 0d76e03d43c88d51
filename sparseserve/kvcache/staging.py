"""A step's small host -> device copies: the pinned staging ring (`PinnedStaging`, `to_device_many`) and the
static inputs of the captured decode graphs (`StaticInputs`), both behind one interface (`StepUpload`).

A step's inputs (token ids, positions, slots, block tables; the attention backend's and the KV offload's
addressing) are built on the host by several components. Each hands its tensors to the step's upload
(`add`, views on the device come back at once) and the data reaches the device with `commit`: an eager step
through one staging copy per `add`; a step that replays a CUDA graph in one copy straight into the graphs'
static buffers, so the host issues one device operation for all of its inputs instead of an upload plus a
copy or a fill per input (on a slow host each costs tens of microseconds, in front of every replay).
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


class PinnedStaging:
    """Page-locked staging of a device's small per-step host -> device copies (a step's addressing, sampling
    parameters): a ring of slabs, reused once the copies out of a slab are done. From pageable memory a copy
    first waits for the work queued on the stream (under async scheduling the step in flight); through
    `pin_memory()` each tensor costs an allocation in the caching host allocator plus pointer queries (tens of
    microseconds a tensor, a step has about fifteen). Here several tensors share one host write, one device
    allocation and one copy, and come back as views of it."""

    def __init__(self, device: torch.device, num_slabs: int = 16, slab_bytes: int = 1 << 20) -> None:
        self.device = device
        self.slab_bytes = slab_bytes
        self.buf = torch.empty(num_slabs * slab_bytes, dtype=torch.uint8, pin_memory=True)
        self.host = self.buf.numpy()
        self.events: list[list[torch.cuda.Event]] = [[] for _ in range(num_slabs)]
        self.streams: dict[int, torch.cuda.Stream] = {}  # streams that copied out of the current slab
        self.slab, self.offset = 0, 0
        self._lock = threading.Lock()

    def upload(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        spans = [-(-t.numel() * t.element_size() // 16) * 16 for t in tensors]  # 16-byte aligned views
        total = sum(spans)
        if total > self.slab_bytes:  # rare (large batches of very long contexts): the allocator's way
            return [t.pin_memory().to(self.device, non_blocking=True) for t in tensors]
        with self._lock:
            if self.offset + total > self.slab_bytes:
                self._next_slab()
            base = self.slab * self.slab_bytes + self.offset
            self.offset += total
            pos = base
            for t, span in zip(tensors, spans):
                raw = t.contiguous().view(-1).view(torch.uint8).numpy()
                self.host[pos: pos + raw.size] = raw
                pos += span
            dev = torch.empty(total, dtype=torch.uint8, device=self.device)
            dev.copy_(self.buf[base: base + total], non_blocking=True)
            stream = torch.cuda.current_stream(self.device)
            self.streams[stream.stream_id] = stream
        out, pos = [], 0
        for t, span in zip(tensors, spans):
            out.append(dev[pos: pos + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
            pos += span
        return out

    def _next_slab(self) -> None:
        """The current slab's copies are marked by an event on each stream that issued one; the next slab is
        reused once its own are done (a ring of slabs: long done)."""
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
    """Small host tensors (a step's addressing) on `device` without waiting for the device, in one copy
    (PinnedStaging); on CPU the tensors themselves."""
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




class StepUpload:
    """A step's small host tensors on the device. `add` returns their device views; they hold the data for
    device work issued after `commit` (here: at once, one staging copy per `add`). Components add their
    tensors while a step is built and commit before issuing work that reads them; a second commit is free."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def add(self, tensors: Sequence[torch.Tensor], names: Sequence[str | None] | None = None) -> list[torch.Tensor]:
        """Device views of `tensors`; names: the static input each one fills (StaticInputs; ignored here)."""
        return to_device_many(tensors, self.device)

    def commit(self) -> None:
        """Views from `add` hold their data for work issued from now on."""


@dataclass(frozen=True)
class InputField:
    """A per-row input of a captured decode step: dtype, width (0: one value a row, else a row of `width`),
    and the value of padding rows (a bucket's rows beyond the batch) and of a row's entries beyond its width."""
    name: str
    dtype: torch.dtype
    width: int = 0
    pad: int = 0


class StaticInputs(StepUpload):
    """The static inputs of the decode graphs: for each batch bucket, every field laid out at fixed offsets of
    one device buffer (buckets share it: one step at a time reads it), mirrored by a ring of pinned host slabs in
    the same layout. A step writes its rows and the padding rows' values into a slab; `commit` brings the bucket's
    whole layout over in one copy, with a scratch tail for the step's other small tensors (those beyond it go
    through `to_device_many`). A slab is rewritten only once its copy is done (an event per slab)."""

    def __init__(self, fields: Sequence[InputField], buckets: Sequence[int], device: torch.device,
                 scratch_bytes: int = 1 << 16, num_slabs: int = 3) -> None:
        super().__init__(device)
        self.fields = {f.name: f for f in fields}
        self.layouts: dict[int, dict[str, tuple[int, int]]] = {}  # bucket -> name -> (offset, bytes)
        self.ends: dict[int, int] = {}
        for b in buckets:
            pos, lay = 0, {}
            for f in fields:
                nbytes = b * max(f.width, 1) * f.dtype.itemsize
                lay[f.name] = (pos, nbytes)
                pos += _align(nbytes)
            self.layouts[b], self.ends[b] = lay, pos
        self.scratch_bytes = scratch_bytes
        size = max(self.ends.values()) + scratch_bytes
        cuda = device.type == "cuda"
        self.dev = torch.zeros(size, dtype=torch.uint8, device=device)
        self.slabs = [torch.zeros(size, dtype=torch.uint8, pin_memory=cuda) for _ in range(num_slabs)]
        self._np = [s.numpy() for s in self.slabs]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(num_slabs)]
        self._host: dict[tuple[int, int], dict[str, np.ndarray]] = {}  # (slab, bucket) -> field -> host view
        self._dev_views: dict[tuple, torch.Tensor] = {}  # device views handed out, by rows/columns or scratch place
        # Fields whose last write into a slab left it padded beyond (rows, width) (`_add_field`), valid for the
        # bucket the slab was last begun with (the buckets' layouts overlap, so another bucket's step clears it).
        self._padded: list[dict[str, tuple[int, int]]] = [{} for _ in range(num_slabs)]
        self._slab_bucket: list[int | None] = [None] * num_slabs
        # (bucket, name, shape, dtype) -> (rows, width, device view): tensors that passed `_add_field`'s check
        self._fits: dict[tuple, tuple[int, int, torch.Tensor]] = {}
        self.slab = 0
        self.bucket: int | None = None  # the bucket of the step being built (None: no step open)
        self._scratch = 0

    def views(self, bucket: int) -> dict[str, torch.Tensor]:
        """Device views of the bucket's fields, all rows (the metadata a graph is captured with)."""
        return {name: self._view(self.dev, name, bucket) for name in self.fields}

    def reset(self, bucket: int) -> None:
        """Every row of the bucket's fields set to padding on the device (before a graph's warm-up run; the
        buckets' layouts overlap, so this holds until another bucket is reset or filled)."""
        for name, t in self.views(bucket).items():
            t.fill_(self.fields[name].pad)

    def begin(self, bucket: int) -> StaticInputs:
        """Opens a step that replays the graph of `bucket` (a step opened and never committed, e.g. one whose
        building failed, is dropped: nothing was copied out of its slab)."""
        if self.bucket is None:
            event = self.events[self.slab]
            if event is not None:
                event.synchronize()
        if self._slab_bucket[self.slab] != bucket:
            self._slab_bucket[self.slab] = bucket
            self._padded[self.slab].clear()
        self.bucket, self._scratch = bucket, 0
        return self

    def add(self, tensors: Sequence[torch.Tensor], names: Sequence[str | None] | None = None) -> list[torch.Tensor]:
        if self.bucket is None:
            raise RuntimeError("static inputs added outside a step (begin ... commit)")
        names = [None] * len(tensors) if names is None else names
        out = []
        for t, name in zip(tensors, names, strict=True):
            out.append(self._add_field(name, t) if name in self.fields else self._add_scratch(t))
        return out

    def commit(self) -> None:
        if self.bucket is None:
            return
        n = self.ends[self.bucket] + self._scratch
        self.dev[:n].copy_(self.slabs[self.slab][:n], non_blocking=True)
        event = self.events[self.slab]
        if event is not None:
            event.record(torch.cuda.current_stream(self.device))
        self.slab = (self.slab + 1) % len(self.slabs)
        self.bucket = None

    def _host_views(self) -> dict[str, np.ndarray]:
        key = (self.slab, self.bucket)
        host = self._host.get(key)
        if host is None:
            buf = self.slabs[self.slab]
            host = self._host[key] = {name: self._view(buf, name, self.bucket).numpy() for name in self.fields}
        return host

    def _view(self, buf: torch.Tensor, name: str, bucket: int) -> torch.Tensor:
        f = self.fields[name]
        off, nbytes = self.layouts[bucket][name]
        t = buf[off: off + nbytes].view(f.dtype)
        return t.view(bucket, f.width) if f.width else t

    def _cached(self, key: tuple, make) -> torch.Tensor:
        """The device view under key, made once (torch's slicing and viewing is host time a step too)."""
        view = self._dev_views.get(key)
        if view is None:
            if len(self._dev_views) > 4096:  # shapes come and go with the batch: keep the cache bounded
                self._dev_views.clear()
            view = self._dev_views[key] = make()
        return view

    def _add_field(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Writes t's rows into the slab's field, padding after them; returns the device view of those rows.
        Per step and field, so the check and the device view are looked up once a shape was seen, and padding
        the slab already holds from its last write is not written again (a steady batch writes none)."""
        key = (self.bucket, name, t.shape, t.dtype)
        fit = self._fits.get(key)
        if fit is None:
            fit = self._fits[key] = self._fit(name, t)
        rows, width, view = fit
        f = self.fields[name]
        host = self._host_views()[name]
        padded = self._padded[self.slab]
        prev = padded.pop(name, None)  # (re-recorded once written: a failed write leaves no claim)
        if f.width:
            host[:rows, :width] = t.numpy()
            if prev is None or width < prev[1]:
                host[:rows, width:] = f.pad
        else:
            host[:rows] = t.numpy()
        if prev is None or rows < prev[0]:
            host[rows:] = f.pad
        padded[name] = (rows, width)
        return view

    def _fit(self, name: str, t: torch.Tensor) -> tuple[int, int, torch.Tensor]:
        """(rows, width, device view of them) of a tensor for a field of the open step's bucket; refuses one that
        does not fit."""
        f, rows = self.fields[name], t.shape[0]
        width = t.shape[1] if t.dim() == 2 else 0
        if t.dtype != f.dtype or rows > self.bucket or t.dim() != (2 if f.width else 1) or width > f.width:
            raise ValueError(f"static input {name!r}: {tuple(t.shape)} {t.dtype} does not fit "
                             f"{self.bucket} rows of {f.width or 1} {f.dtype}")
        if len(self._fits) > 4096:  # shapes come and go with the batch: keep the cache bounded
            self._fits.clear()
        return rows, width, self._cached((self.bucket, name, rows, width), lambda: self._rows(name, rows, width))

    def _rows(self, name: str, rows: int, width: int) -> torch.Tensor:
        full = self._view(self.dev, name, self.bucket)
        return full[:rows, :width] if self.fields[name].width else full[:rows]

    def _add_scratch(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        if self._scratch + nbytes > self.scratch_bytes:
            return to_device_many([t], self.device)[0]
        pos = self.ends[self.bucket] + self._scratch
        self._np[self.slab][pos: pos + nbytes] = _host_bytes(t)
        self._scratch += _align(nbytes)
        return self._cached((pos, t.dtype, tuple(t.shape)),
                            lambda: self.dev[pos: pos + nbytes].view(t.dtype).view(t.shape))


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A host tensor's bytes, flat: through numpy where it has the dtype (a third of the time of torch's views)."""
    try:
        return t.numpy().ravel().view(np.uint8)  # (ravel: contiguous, a copy only for a strided tensor)
    except TypeError:  # bfloat16 and the like: no numpy dtype
        return t.contiguous().view(-1).view(torch.uint8).numpy()


def _align(nbytes: int) -> int:
    return -(-nbytes // 16) * 16
