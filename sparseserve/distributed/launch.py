"""Starting the ranks of a tensor-parallel engine: under torchrun (possibly several hosts), or
from rank 0, which starts one worker process per other rank on its host.

Spawned workers come from a forkserver with this package preloaded (it never touches CUDA, so
its children may). They meet rank 0 at a TCPStore on 127.0.0.1; rank 0 checks each worker is
alive while it waits, so a worker failing before joining is an error, not a hang. A worker
writes its exception to the store; rank 0 names it in its own error.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparseserve.distributed.group import COLLECTIVE_TIMEOUT_S

logger = logging.getLogger(__name__)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_env() -> TorchrunEnv | None:
    """The rank's place when started by torchrun (or anything setting its environment)."""
    if not all(v in os.environ for v in TORCHRUN_VARS):
        return None
    world = int(os.environ["WORLD_SIZE"])
    return TorchrunEnv(
        int(os.environ["RANK"]), world, int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    )


def check_devices(tp_size: int, device_type: str, local_world_size: int) -> None:
    """Clear errors before any process starts: torch.distributed, NCCL and enough visible GPUs."""
    if not dist.is_available():
        raise ValueError("tensor_parallel_size > 1 needs torch.distributed, which this PyTorch build lacks")
    if device_type == "cuda":
        if not dist.is_nccl_available():
            raise ValueError(
                "tensor_parallel_size > 1 on CUDA needs NCCL, which this PyTorch build lacks "
                "(install a CUDA build of PyTorch, or run on CPU with device='cpu': gloo)"
            )
        visible = torch.cuda.device_count()
        if local_world_size > visible:
            raise ValueError(
                f"tensor_parallel_size={tp_size} needs {local_world_size} GPUs on this host, but "
                f"{visible} are visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})"
            )
    elif not dist.is_gloo_available():
        raise ValueError("tensor_parallel_size > 1 on CPU needs gloo, which this PyTorch build lacks")


def _ready_key(rank: int) -> str:
    return f"sparseserve/ready/{rank}"


def _error_key(rank: int) -> str:
    return f"sparseserve/error/{rank}"


class WorkerProcesses:
    """Ranks 1..world_size-1 on this host, started by rank 0: each runs `target(rank,
    world_size, port, env, *args)` (env: rank 0's, adopted before touching CUDA or NCCL)."""

    def __init__(self, world_size: int, target: Callable[..., None], args: tuple, preload: list[str]) -> None:
        import torch.multiprocessing as mp

        self.world_size = world_size
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(preload)
        env = dict(os.environ)
        self.procs = [
            ctx.Process(
                target=target,
                args=(r, world_size, self.store.port, env, *args),
                daemon=True,
                name=f"sparseserve-tp-rank{r}",
            )
            for r in range(1, world_size)
        ]
        for p in self.procs:
            p.start()
        self.stopping = False

    def wait_ready(self, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        """Until every worker reached the rendezvous; raises if one exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        waiting = list(range(1, self.world_size))
        while waiting:
            self.check()
            waiting = [r for r in waiting if not self.store.check([_ready_key(r)])]
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks {waiting} did not start within {timeout_s:.0f} s")
            if waiting:
                time.sleep(0.01)

    def failure(self, wait_s: float = 0.0) -> str | None:
        """Why a worker is gone (None while all run): rank, exit status and its error if written.
        wait_s: how long to wait for an exit to show (a failed collective may report a peer's
        closed connections before the peer's process is reaped)."""
        deadline = time.monotonic() + wait_s
        while (msg := self._failure()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return msg

    def _failure(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            code = p.exitcode
            if code is None:
                continue
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            msg = f"tensor-parallel rank {rank} (pid {p.pid}) {how}"
            try:
                if self.store.check([_error_key(rank)]):
                    msg += ":\n" + self.store.get(_error_key(rank)).decode(errors="replace")
            except Exception:  # noqa: BLE001 - the store may be going down with the engine
                pass
            return msg
        return None

    def check(self) -> None:
        if not self.stopping and (msg := self.failure()) is not None:
            raise RuntimeError(msg)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Joins the workers (after they were told to stop), then terminates what is left."""
        self.stopping = True
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.0))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)


def worker_setup(rank: int, port: int, env: dict[str, str], parent_pid: int) -> Any:
    """A spawned worker's first call: rank 0's environment, a watch on rank 0, the ready key.
    Returns the store the worker joins the process group with."""
    os.environ.clear()
    os.environ.update(env)
    # Ctrl-C reaches the whole process group: rank 0 stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(parent_pid)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    store.set(_ready_key(rank), "1")
    return store


def report_worker_error(store: Any, rank: int) -> None:
    """Called in a worker's `except`: rank 0 puts the traceback into its own error."""
    text = traceback.format_exc()
    logger.error("tensor-parallel rank %d failed:\n%s", rank, text)
    try:
        store.set(_error_key(rank), text[-4000:])
    except Exception:  # noqa: BLE001 - rank 0 may already be gone
        pass


def _watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """A worker must not outlive rank 0: its collectives would wait forever (gloo fails by
    itself once rank 0's connections close; this also covers a worker blocked on its GPU)."""

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                logger.error("tensor-parallel rank 0 (pid %d) is gone: this worker stops", parent_pid)
                os._exit(1)
            except PermissionError:
                pass

    threading.Thread(target=watch, name="sparseserve-tp-parent-watch", daemon=True).start()
