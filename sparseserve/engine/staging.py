"""A step's upload of the host tensors engine/step_inputs.py builds (docs/engine.md): `StepUpload`
for an eager step, one staging copy per `add`; `StaticInputs` for a step that replays a CUDA
graph, one copy straight into the graphs' static buffers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sparseserve.attention.backend import InputField
from sparseserve.kvcache.transfer import to_device_many


class StepUpload:
    """A step's small host tensors on the device. `add` returns device views that hold the data
    for work issued after `commit` (here: at once). The trap: commit before issuing work that
    reads them; a second commit is free."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def add(self, tensors: Sequence[torch.Tensor], names: Sequence[str | None] | None = None) -> list[torch.Tensor]:
        """Device views of `tensors`; names: the static input each fills (ignored here)."""
        return to_device_many(tensors, self.device)

    def commit(self) -> None:
        """Views from `add` hold their data for work issued from now on."""


class StaticInputs(StepUpload):
    """The decode graphs' static inputs: each bucket's fields at fixed offsets of one device buffer
    (shared by the buckets), mirrored by a ring of pinned host slabs. A step writes its rows and
    padding into a slab; `commit` copies the bucket's layout and a scratch tail for the step's
    other tensors in one copy. A slab is rewritten only once its copy is done (an event each)."""

    def __init__(
        self,
        fields: Sequence[InputField],
        buckets: Sequence[int],
        device: torch.device,
        scratch_bytes: int = 1 << 16,
        num_slabs: int = 3,
    ) -> None:
        super().__init__(device)
        self.fields = {f.name: f for f in fields}
        self.layouts: dict[int, dict[str, tuple[int, int]]] = {}  # bucket -> name -> (off, bytes)
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
        self._host: dict[tuple[int, int], dict[str, np.ndarray]] = {}  # (slab, bucket) -> views
        self._dev_views: dict[tuple, torch.Tensor] = {}  # by rows/width or scratch place
        # Fields a slab holds padded beyond (rows, width) (`_add_field`), valid for the bucket the
        # slab was last begun with (the layouts overlap: another bucket's step clears it).
        self._padded: list[dict[str, tuple[int, int]]] = [{} for _ in range(num_slabs)]
        self._slab_bucket: list[int | None] = [None] * num_slabs
        # (bucket, name, shape, dtype) -> (rows, width, device view): shapes `_fit` accepted
        self._fits: dict[tuple, tuple[int, int, torch.Tensor]] = {}
        self.slab = 0
        self.bucket: int | None = None  # the bucket of the step being built (None: no step open)
        self._scratch = 0

    def views(self, bucket: int) -> dict[str, torch.Tensor]:
        """Device views of the bucket's fields, all rows (the metadata a graph is captured with)."""
        return {name: self._view(self.dev, name, bucket) for name in self.fields}

    def reset(self, bucket: int) -> None:
        """Every row of the bucket's fields set to padding on the device (before a graph's warm-up
        run; holds until another bucket is reset or filled)."""
        for name, t in self.views(bucket).items():
            t.fill_(self.fields[name].pad)

    def begin(self, bucket: int) -> StaticInputs:
        """Opens a step that replays the graph of `bucket` (one never committed is dropped: nothing
        was copied out of its slab)."""
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
        t = buf[off : off + nbytes].view(f.dtype)
        return t.view(bucket, f.width) if f.width else t

    def _cached(self, key: tuple, make) -> torch.Tensor:
        """The device view under key, made once (slicing and viewing is host time a step too)."""
        view = self._dev_views.get(key)
        if view is None:
            if len(self._dev_views) > 4096:  # shapes follow the batch: keep the cache bounded
                self._dev_views.clear()
            view = self._dev_views[key] = make()
        return view

    def _add_field(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Writes t's rows into the slab's field, padding after them; returns their device view.
        Runs per step and field: the check and view are cached by shape, and padding the slab holds
        from its last write is not written again."""
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
        """(rows, width, device view of them) of a tensor for a field of the open step's bucket;
        refuses one that does not fit."""
        f, rows = self.fields[name], t.shape[0]
        width = t.shape[1] if t.dim() == 2 else 0
        if t.dtype != f.dtype or rows > self.bucket or t.dim() != (2 if f.width else 1) or width > f.width:
            raise ValueError(
                f"static input {name!r}: {tuple(t.shape)} {t.dtype} does not fit "
                f"{self.bucket} rows of {f.width or 1} {f.dtype}"
            )
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
        self._np[self.slab][pos : pos + nbytes] = _host_bytes(t)
        self._scratch += _align(nbytes)
        return self._cached(
            (pos, t.dtype, tuple(t.shape)), lambda: self.dev[pos : pos + nbytes].view(t.dtype).view(t.shape)
        )


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A host tensor's bytes, flat: through numpy where it has the dtype (faster than torch)."""
    try:
        return t.numpy().ravel().view(np.uint8)  # (ravel copies only a strided tensor)
    except TypeError:  # bfloat16 and the like: no numpy dtype
        return t.contiguous().view(-1).view(torch.uint8).numpy()


def _align(nbytes: int) -> int:
    return -(-nbytes // 16) * 16
