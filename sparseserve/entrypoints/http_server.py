"""uvicorn with what an exposed server needs: read deadlines for slow clients, a cap on connections, and a
graceful drain on SIGINT/SIGTERM.

- `GuardedH11Protocol` is uvicorn's h11 protocol plus deadlines: a request's headers must be complete within
  `header_timeout` seconds of their first byte (or of the connection opening), its body within `body_timeout`
  seconds of the headers; a connection that misses one gets 408 and is closed. Requests on connections beyond
  `max_connections` get 503 and their connection is closed. uvicorn has neither deadline: a client that sends a
  partial request holds its connection forever (slowloris). Idle keep-alive connections are uvicorn's
  `timeout_keep_alive`. One client address holds at most `max_pending_per_client` connections without a whole
  request (new, partial, or idle between requests): a further one closes its oldest such connection, so one
  client cannot take every slot; connections whose request runs are never closed so. A request with both
  Content-Length and Transfer-Encoding gets 400 (RFC 9112 6.3: a request smuggling vector).
- `DrainingServer` handles the signals itself: on the first one the app stops admitting requests (503, and
  /health 503) and the engine drains: requests in flight get `shutdown_timeout` seconds to finish, those still
  running are then aborted (an SSE error event and `[DONE]`, or a 503 JSON) and their responses written, and only
  then does uvicorn close the connections, so no task is cancelled mid-response. A second signal aborts at once.
  The process exits with status 0 (uvicorn would re-raise the signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

# After the drain, how long the aborted requests' handlers get to write their last bytes (a client that does
# not read its stream must not hold the shutdown); uvicorn then cancels what is left.
RESPONSE_GRACE_S = 5.0


@dataclass(frozen=True)
class ClientLimits:
    header_timeout: float | None = 15.0
    body_timeout: float | None = 60.0
    max_connections: int | None = 2048
    keep_alive_timeout: float = 5.0
    max_pending_per_client: int | None = 256
    send_buffer_bytes: int | None = None  # SO_SNDBUF of each connection (None: the kernel's autotuning)


def error_bytes(status: int, message: str, type: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-style error body that closes the connection, for the
    moments where no ASGI response can be sent (the request never arrived whole)."""
    body = json.dumps({"error": {"message": message, "type": type, "param": None, "code": status}}).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def error_app(status: int, message: str, type: str) -> Any:
    """An ASGI app that answers every request with one error and closes the connection."""
    body = json.dumps({"error": {"message": message, "type": type, "param": None, "code": status}}).encode()

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


class GuardedH11Protocol(H11Protocol):
    """See the module docstring. `limits`, `pending` and `closing` are set on the subclass that `guarded_protocol`
    makes: `pending` maps a client address to its connections without a whole request, oldest first; `closing`
    holds the connections closed here whose loss asyncio has not reported yet (they hold no slot)."""

    limits = ClientLimits()
    pending: dict[str, dict[GuardedH11Protocol, None]] = {}
    closing: set[GuardedH11Protocol] = set()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._h11_next_event = self.conn.next_event
        self.conn.next_event = self._next_event  # type: ignore[method-assign]
        self._refusal = "Invalid HTTP request received."

    def _next_event(self) -> Any:
        event = self._h11_next_event()
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}  # h11 lowercases them
            if b"content-length" in names and b"transfer-encoding" in names:
                self._refusal = "A request may not carry both Content-Length and Transfer-Encoding."
                raise h11.RemoteProtocolError(self._refusal)
        return event

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # asyncio disables Nagle only on sockets created with proto=IPPROTO_TCP; on one passed in with proto 0
        # every response's body waits for the client's delayed ACK of its headers (40 ms), and so does each
        # streamed token after the first.
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.limits.send_buffer_bytes is not None:  # bounds what a non-reading client leaves queued
            with contextlib.suppress(OSError):
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer_bytes)
            transport.set_write_buffer_limits(high=self.limits.send_buffer_bytes)  # asyncio's: 64 KiB
        self._phase: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._host = self.client[0] if self.client else ""
        self._watch()
        limit = self.limits.max_connections
        if limit is not None and len(self.connections) - len(self.closing) > limit:
            self.app = error_app(
                503,
                f"The server has {limit} connections open (--limit-concurrency); retry later.",
                "service_unavailable",
            )

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        self.closing.discard(self)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP: uvicorn answers in plain text; this answers in JSON like every other error."""
        self.transport.write(error_bytes(400, self._refusal, "invalid_request_error"))
        self.transport.close()

    # -- deadlines ---------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Which deadline applies now: 'headers' while a request's head is incomplete (a fresh connection, or
        bytes of a next request on a kept-alive one), 'body' while its body is, else none."""
        phase = None
        if not self.transport.is_closing():
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                phase = "body"
            elif state is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
                phase = "headers"
        self._set_phase(phase)

    def _set_phase(self, phase: str | None) -> None:
        """Enters `phase` (its deadline starts now) and keeps the client's pending list."""
        if phase == self._phase:
            return  # the running deadline still applies: it counts from the phase's start, not the last byte
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        was_pending, self._phase = self._phase is not None, phase
        timeout = {"headers": self.limits.header_timeout, "body": self.limits.body_timeout}.get(phase or "")
        if timeout is not None:
            self._timer = self.loop.call_later(timeout, self._expire, phase, timeout)
        if phase is None:
            self._unlist()
        elif not was_pending:
            self._list()

    def _list(self) -> None:
        """Counts this connection as pending for its client; closes the client's oldest if over the limit."""
        mine = self.pending.setdefault(self._host, {})
        mine[self] = None
        limit = self.limits.max_pending_per_client
        if limit is not None and len(mine) > limit:
            next(iter(mine))._evict()

    def _unlist(self) -> None:
        mine = self.pending.get(self._host)
        if mine is not None:
            mine.pop(self, None)
            if not mine:
                del self.pending[self._host]

    def _evict(self) -> None:
        logger.info("closing the oldest pending connection of %s (--max-pending-connections-per-client)", self._host)
        self._close_with(
            self._phase or "headers",
            503,
            "Too many connections without a whole request from this address; this one, its oldest, is closed.",
            "service_unavailable",
        )

    def _close_with(self, phase: str, status: int, message: str, type: str) -> None:
        """Ends a connection whose request (its `phase`) did not arrive: an error response unless one started,
        the app told the client left, the connection closed."""
        self._set_phase(None)
        self.closing.add(self)
        cycle = self.cycle if phase == "body" else None
        if cycle is None or not cycle.response_started:
            self.transport.write(error_bytes(status, message, type))
        if cycle is not None:  # the app waits for the body: its receive() now says the client left
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def _expire(self, phase: str, timeout: float) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        logger.info("closing the connection of %s: request %s not received within %g s", client, phase, timeout)
        self._close_with(
            phase, 408, f"The request {phase} did not arrive within {timeout:g} s.", "invalid_request_error"
        )


def guarded_protocol(limits: ClientLimits) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "pending": {}, "closing": set()})


class DrainingServer(uvicorn.Server):
    """See the module docstring. `engine` is the AsyncLLMEngine behind the app."""

    def __init__(self, config: uvicorn.Config, engine: Any, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._force: asyncio.Event | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._force = asyncio.Event()
        await super().startup(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, without re-raising the signal after the shutdown: a drained server exits with 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.request_shutdown()

    def request_shutdown(self) -> None:
        """Thread- and signal-safe: the first call drains, the second aborts what is in flight, a third exits."""
        try:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._on_shutdown_request)
                return
        except RuntimeError:  # the loop is closed: the server has stopped already
            pass
        self.should_exit = True  # not started yet

    def _on_shutdown_request(self) -> None:
        assert self._force is not None
        if self._drain_task is None:
            logger.info(
                "shutting down: new requests get 503; %d request(s) in flight get up to %g s",
                self.engine.num_requests,
                self.shutdown_timeout,
            )
            self._drain_task = asyncio.ensure_future(self._drain())
        elif not self._force.is_set():
            logger.info("shutting down now: aborting the requests in flight")
            self._force.set()
        else:
            self.force_exit = self.should_exit = True

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await self.engine.drain(self.shutdown_timeout, self._force)
            # The aborted requests' handlers now write their error events and 503s; each request holds one
            # uvicorn task until its response is complete.
            deadline = loop.time() + RESPONSE_GRACE_S
            while self.server_state.tasks and loop.time() < deadline:
                await asyncio.sleep(0.02)
        except Exception:
            logger.exception("graceful shutdown failed")
        finally:
            self.should_exit = True


def uvicorn_config(app: Any, host: str, port: int, limits: ClientLimits, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(limits),
        timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]
        timeout_graceful_shutdown=int(RESPONSE_GRACE_S),
    )


@contextlib.contextmanager
def running_server(
    app: Any, engine: Any, host: str = "127.0.0.1", limits: ClientLimits = ClientLimits(), shutdown_timeout: float = 5.0
) -> Iterator[tuple[str, DrainingServer]]:
    """Runs `app` in a background thread on a free port; yields its base URL and the server. For tests and
    harnesses that need a real socket (streaming, disconnects, slow clients, the openai client)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind((host, 0))  # bound before the thread starts, so the port cannot be taken meanwhile
    server = DrainingServer(uvicorn_config(app, host, 0, limits, "warning"), engine, shutdown_timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("server thread died during startup")
            threading.Event().wait(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}", server
    finally:
        server.request_shutdown()
        thread.join(timeout=60)
        sock.close()
