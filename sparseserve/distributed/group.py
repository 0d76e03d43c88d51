"""The tensor-parallel group of this process and its collectives.

Each process of a tensor-parallel engine holds one `TPGroup`: rank, world size and two groups:
  device_group  the model's collectives (NCCL on CUDA, gloo on CPU): all-reduces, the logits'
                gather to rank 0;
  cpu_group     gloo: rank 0's step messages (distributed/channel.py), agreement on sizes.
At tensor_parallel_size 1 there is no process group: `get_tp_group()` is a single-rank group
whose collectives return their input.

The traps: `destroy_tp_group()` must end the groups before it returns. Layers keep their
TPGroup (the model may be a cycle only the GC frees), and groups ending at interpreter teardown
break the other ranks (docs/tensor_parallel.md, "When something fails"). And NCCL's graceful
destroy (finalize) waits for peers that may have left already: NCCL groups are aborted.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)
# Seconds a collective of the model or of construction may wait for the other ranks (weights
# load at different speeds).
COLLECTIVE_TIMEOUT_S = float(os.environ.get("SPARSESERVE_TP_TIMEOUT", 1800))
# Seconds a worker waits for rank 0's next message (rank 0 sends heartbeats while idle): how long
# a worker outlives a rank 0 that hangs without closing its connections.
MESSAGE_TIMEOUT_S = float(os.environ.get("SPARSESERVE_TP_MESSAGE_TIMEOUT", 120))
# Seconds ending this process's groups may take before it goes on without them (an NCCL abort is
# local; this bounds one that blocks anyway). Below WorkerProcesses.shutdown's wait for a worker.
END_TIMEOUT_S = 20.0
# A step message of up to this many pickled bytes, less 8 (a steady decode step's of 32 sequences
# is ~3 KB), takes one broadcast; a longer one, two.
MESSAGE_BYTES = 16384
_END_LOCK = threading.Lock()  # one end or abort at a time (the watchdog's abort may race a shutdown)
_END_STUCK = False  # an end or abort of this process blocked past its timeout (exit_if_end_stuck)


class _Groups:
    """One TPGroup's torch.distributed groups, in one place so `destroy_tp_group` drops them."""

    def __init__(self, device_group: Any, cpu_group: Any, nccl: bool) -> None:
        self.device_group, self.cpu_group = device_group, cpu_group
        self.nccl = nccl  # the device group's backend: ended by an abort
        self.message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)  # TPGroup.broadcast_object's buffer

    def release(self) -> None:
        self.device_group = self.cpu_group = None


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # rank among the processes of this host (its GPU index)
    local_world_size: int = 1  # ranks on this host (they share its host memory)
    groups: _Groups | None = None

    @property
    def device_group(self) -> Any:
        return self._group("device_group")

    @property
    def cpu_group(self) -> Any:
        return self._group("cpu_group")

    def _group(self, name: str) -> Any:
        if self.groups is None:
            return None
        group = getattr(self.groups, name)
        if group is None:
            raise RuntimeError("the tensor-parallel process group was destroyed (its engine was shut down)")
        return group

    @property
    def is_driver(self) -> bool:
        """Rank 0: the scheduler, the sampler and the engine's API live there."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's x concatenated along dim, on rank 0; None on the others. An all-gather
        (capturable in a CUDA graph on every rank, unlike point-to-point gathers)."""
        if self.world_size == 1:
            return x
        x = x.movedim(dim, 0).contiguous()
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x, group=self.device_group)
        return out.movedim(0, dim) if self.is_driver else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape and dtype), in place, over the device group
        (on CUDA: queued on the stream, no host sync)."""
        if self.world_size > 1:
            dist.broadcast(x, src=0, group=self.device_group)
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's picklable obj on every rank (over the gloo group; waits at most its timeout).
        One broadcast of a fixed buffer (the length in its first 8 bytes, then the pickle) when the
        pickle fits, as a steady decode step's message does; a longer one sends the rest in a second
        (`dist.broadcast_object_list` always takes two)."""
        group, buf = self.cpu_group, self.groups.message
        head, room = buf[:8].view(torch.int64), buf.numel() - 8
        if self.is_driver:
            data = np.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=np.uint8)
            head[0] = data.size
            buf.numpy()[8 : 8 + min(data.size, room)] = data[:room]
            dist.broadcast(buf, src=0, group=group)
            if data.size > room:
                dist.broadcast(torch.from_numpy(data[room:]), src=0, group=group)
            return obj
        dist.broadcast(buf, src=0, group=group)
        size = int(head[0])
        data = buf[8 : 8 + size].clone() if size <= room else torch.empty(size, dtype=torch.uint8)
        if size > room:
            data[:room] = buf[8:]
            dist.broadcast(data[room:], src=0, group=group)
        return pickle.loads(memoryview(data.numpy()))

    def min_int(self, value: int) -> int:
        """The ranks' smallest value (sizes all must agree on: KV blocks, host store rows)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


_TP = TPGroup()
# torch 2.13 renamed all_gather_into_tensor (the older name still works there, with a warning)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def get_tp_group() -> TPGroup:
    return _TP


def init_tp_group(
    *, rank: int, world_size: int, local_rank: int, local_world_size: int, device_type: str, store: Any = None
) -> TPGroup:
    """Joins the process group (`store`: a rendezvous store; None: env://) and sets this
    process's TP group. One tensor-parallel engine per process."""
    global _TP
    if _TP.world_size > 1 or dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a tensor-parallel group: shut its engine down first "
            "(one tensor-parallel engine per process)"
        )
    kwargs: dict[str, Any] = {"init_method": "env://"} if store is None else {"store": store}
    backend = "gloo"
    if device_type == "cuda":
        backend = "nccl"
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast: docs/tensor_parallel.md
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), **kwargs
    )
    cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=MESSAGE_TIMEOUT_S))
    groups = _Groups(dist.group.WORLD, cpu_group, nccl=dist.get_backend() == "nccl")
    _TP = TPGroup(rank, world_size, local_rank, local_world_size, groups)
    return _TP


def destroy_tp_group(timeout_s: float | None = None) -> None:
    """Leaves the process group and ends it now: threads joined and connections closed before
    this returns (every TPGroup of this process then refuses collectives). On NCCL it aborts and
    waits at most timeout_s (default END_TIMEOUT_S), then warns and goes on."""
    global _TP
    groups, _TP = _TP.groups, TPGroup()
    nccl = groups.nccl if groups is not None else dist.is_initialized() and dist.get_backend() == "nccl"
    if nccl:
        _bounded(lambda: _end_nccl(groups), "leaving the NCCL process group", timeout_s)
        return
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - after an abort the groups may be half gone
            logger.warning("leaving the tensor-parallel process group: %s", e)
    if groups is not None:
        groups.release()  # last references: destructors run here, not at exit


def _end_nccl(groups: _Groups | None) -> None:
    """The gloo group ends as on CPU; the NCCL world is aborted (no finalize: it waits for peers)."""
    with _END_LOCK:
        if dist.is_initialized():
            if groups is not None and groups.cpu_group is not None:
                try:
                    dist.destroy_process_group(groups.cpu_group)
                except Exception as e:  # noqa: BLE001 - the abort below ends it anyway
                    logger.warning("leaving the tensor-parallel gloo group: %s", e)
            # Safe: rank 0 synced its last step before the stop message: no collective anyone reads is in flight.
            _abort_world()
        if groups is not None:
            groups.release()  # the communicators' destructors, here (and bounded), not at exit


def abort_tp_group(timeout_s: float | None = None) -> None:
    """From another thread, on a dead rank: aborts the communicators so a collective or device
    sync waiting on it returns (NCCL kernels never time out); gloo fails by itself."""

    def abort() -> None:
        with _END_LOCK:
            if dist.is_initialized():
                _abort_world()

    _bounded(abort, "aborting the tensor-parallel process group", timeout_s)


def _abort_world() -> None:
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    (abort or dist.destroy_process_group)()  # torch without it: the bound below still holds


def _bounded(fn: Callable[[], None], what: str, timeout_s: float | None) -> None:
    """fn in a daemon thread, waited for at most timeout_s (None: END_TIMEOUT_S). Past that this
    warns and returns; the thread keeps its groups alive (no destructor at interpreter exit) and
    the process exits without waiting for it (a daemon)."""
    timeout_s = END_TIMEOUT_S if timeout_s is None else timeout_s

    def run() -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - best effort: the groups are left either way
            logger.warning("%s: %s", what, e)

    try:
        thread = threading.Thread(target=run, name="sparseserve-tp-end", daemon=True)
        thread.start()
    except RuntimeError:  # no new threads while the interpreter shuts down
        run()
        return
    thread.join(timeout_s)
    if thread.is_alive():
        global _END_STUCK
        _END_STUCK = True
        frame = sys._current_frames().get(thread.ident)
        where = "".join(traceback.format_stack(frame)[-3:]) if frame is not None else "(unknown)\n"
        logger.warning(
            "%s did not end within %.0f s; this process goes on without waiting for it (a new "
            "tensor-parallel engine cannot start in it; exit with `exit_if_end_stuck`). It waits in:\n%s",
            what,
            timeout_s,
            where.rstrip(),
        )


def exit_if_end_stuck(status: int = 0) -> None:
    """Exits now (os._exit, after flushing) if ending a group blocked: at a normal exit the stuck
    communicators' C++ destructors would abort the process (SIGABRT) instead of exiting with status."""
    if not _END_STUCK:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
