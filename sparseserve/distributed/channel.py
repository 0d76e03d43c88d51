"""Rank 0's messages to the other ranks: one picklable object per engine step, broadcast over
the gloo group, received in order.

The trap: gloo's broadcast returns on rank 0 only once every rank received, so rank 0 sends
right before running the step and holds the channel (`hold()`) for the whole step. While idle,
`heartbeat()` sends an empty message every `heartbeat_s` so a worker's wait never reaches
MESSAGE_TIMEOUT_S unless rank 0 hangs. `close()` sends the last message; no heartbeat follows.
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
        """Rank 0's watchdog: an empty message when idle for heartbeat_s and no step runs."""
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
