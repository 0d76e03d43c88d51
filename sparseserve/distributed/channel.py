"""Rank 0's messages to the other ranks of a tensor-parallel engine: one picklable object per engine step,
broadcast over the gloo group (torch.distributed; no transport of our own), received in order.

gloo's broadcast returns on rank 0 only once every rank has received, so rank 0 sends a step's message right
before running the step, when the workers wait for it, and holds the channel (`hold()`) for the whole step.
While the engine is idle, rank 0's watchdog calls `heartbeat()`, which sends an empty message every
`heartbeat_s` seconds if the channel is free: a worker's wait for a message then never reaches the gloo group's
timeout (MESSAGE_TIMEOUT_S) unless rank 0 hangs, and a worker stops instead of waiting forever. `close()` sends
the last message: no heartbeat follows it, so nothing of rank 0's is on the group while the ranks leave it.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from sparseserve.distributed.group import MESSAGE_TIMEOUT_S, TPGroup


class StepChannel:
    def __init__(self, tp: TPGroup, heartbeat_s: float = min(5.0, MESSAGE_TIMEOUT_S / 4)) -> None:
        self.tp = tp
        self.heartbeat_s = heartbeat_s
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._closed = False

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Rank 0: the channel for one step (its message and its run); heartbeats wait."""
        with self._lock:
            yield

    def send(self, message: Any) -> None:
        """Rank 0, inside `hold()`."""
        self.tp.broadcast_object(message)
        self._last_send = time.monotonic()

    def close(self, message: Any) -> None:
        """Rank 0: the last message (waits for a step or a heartbeat in flight); heartbeats stop."""
        with self._lock:
            self._closed = True
            self.send(message)

    def heartbeat(self) -> None:
        """Rank 0's watchdog: an empty message when nothing was sent for heartbeat_s and no step runs."""
        if time.monotonic() - self._last_send < self.heartbeat_s or not self._lock.acquire(blocking=False):
            return
        try:
            if not self._closed:
                self.send(None)
        finally:
            self._lock.release()

    def recv(self) -> Any:
        """A worker: rank 0's next message (heartbeats skipped)."""
        while True:
            message = self.tp.broadcast_object()
            if message is not None:
                return message
