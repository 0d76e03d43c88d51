"""AsyncLLMEngine: the synchronous LLMEngine driven by its own thread, consumed from asyncio
(docs/engine.md, "The engine thread"). Only that thread touches the engine: adds and aborts are
queued and applied between steps; outputs reach each request's RequestStream on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sparseserve.outputs import RequestOutput
from sparseserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestAborted(RuntimeError):
    """The request was aborted (shutdown, engine failure) before it finished."""


def _num_tokens(out: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in out.outputs)


class RequestStream:
    """Async iterator over a request's RequestOutput deltas (outputs.py), up to the finished one.

    Back-pressure: past `max_unread_tokens` unread tokens (all choices) the request is aborted (its
    blocks freed) and the stream raises RequestAborted after the deltas already queued."""

    def __init__(self, request_id: str, engine: "AsyncLLMEngine", max_unread_tokens: int | None = None) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._error: BaseException | None = None  # raised after the deltas queued before it
        self._max_unread = max_unread_tokens
        self._unread = 0  # tokens queued, not yet taken
        self._overflowed = False

    def put(self, item: RequestOutput | BaseException) -> None:
        if self._overflowed:  # an output dispatched before the abort took effect
            return
        self._queue.put_nowait(item)
        if isinstance(item, BaseException):
            return
        self._unread += _num_tokens(item)
        if self._max_unread is not None and self._unread > self._max_unread and not item.finished:
            self._overflowed = True
            self._engine.abort(self.request_id)  # the engine thread drops it and frees its blocks
            self._queue.put_nowait(
                RequestAborted(
                    f"the client did not read its stream: more than {self._max_unread} tokens of output waited "
                    f"unread (--max-unread-stream-tokens), so the request was aborted"
                )
            )

    def _take(self, item: RequestOutput) -> RequestOutput:
        self._unread -= _num_tokens(item)
        return item

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._error is not None:
            self.finished, error, self._error = True, self._error, None
            raise error
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        item = self._take(item)
        # A slow consumer gets the deltas that queued up meanwhile as one.
        while not self._queue.empty() and not item.finished:
            nxt = self._queue.get_nowait()
            if isinstance(nxt, BaseException):
                self._error = nxt
                break
            item.add(self._take(nxt))
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Abort unless finished; safe to call more than once (e.g. from a `finally`)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


@dataclass
class _Tracking:
    """Per-request timing for the latency metrics (event-loop side only)."""

    stream: RequestStream
    arrival: float
    last_token_time: float | None = None
    num_tokens: int = 0


@dataclass
class _Pending:
    adds: list[tuple[str, Any, SamplingParams, asyncio.Future]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


class AsyncLLMEngine:
    """`max_unread_tokens`: the back-pressure bound of every RequestStream (None: unbounded)."""

    def __init__(self, engine: Any, metrics: Any | None = None, max_unread_tokens: int | None = None) -> None:
        if max_unread_tokens is not None and max_unread_tokens < 1:
            raise ValueError(f"--max-unread-stream-tokens must be >= 1, got {max_unread_tokens}")
        self.engine = engine
        self.metrics = metrics
        self.max_unread_tokens = max_unread_tokens
        self.stats: Any = None  # latest EngineStats, published by the engine thread
        self._cond = threading.Condition()
        self._pending = _Pending()
        self._stopping = False
        self._draining = False  # a graceful shutdown began: no new requests
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._requests: dict[str, _Tracking] = {}  # touched on the event loop only
        self._idle = asyncio.Event()  # set while _requests is empty (used by drain)
        self._live: set[str] = set()  # ids inside the engine; touched by the engine thread only
        # Watchdog: the engine thread's last sign of progress (a step done or work picked up) and
        # whether it waits for work; /health reads them from the event loop.
        self._heartbeat = time.monotonic()
        self._waiting_for_work = True

    @classmethod
    def from_kwargs(cls, **engine_kwargs: Any) -> "AsyncLLMEngine":
        from sparseserve.engine.engine import LLMEngine

        return cls(LLMEngine.from_kwargs(**engine_kwargs))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def accepting(self) -> bool:
        """Running and not draining: new requests are admitted."""
        return self.is_running and not self._draining

    @property
    def failure(self) -> str | None:
        """Why the engine can serve no more (a tensor-parallel rank is gone: every step fails), None
        while it can. Any thread may read it: the runner sets it once (TPDriver.failure)."""
        return getattr(getattr(self.engine, "model_runner", None), "failure", None)

    def seconds_without_progress(self) -> float:
        """How long the engine thread has been in one step (or between steps) while it has work; 0
        while it waits for work. Beyond the watchdog timeout the loop is stuck (/health: 503)."""
        if self._waiting_for_work:
            return 0.0
        return max(0.0, time.monotonic() - self._heartbeat)

    @property
    def num_requests(self) -> int:
        """Requests in flight (accepted or being added, not yet finished)."""
        return len(self._requests)

    def start(self) -> None:
        """Start the engine thread; must be called from the event loop that consumes outputs."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine already started")
        self._loop = asyncio.get_running_loop()
        self.stats = self.engine.get_stats()
        self._thread = threading.Thread(target=self._run, name="sparseserve-engine", daemon=True)
        self._thread.start()

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Queue a request; returns once the engine accepted it (ValueError if it rejected it)."""
        if not self.accepting:
            raise RequestAborted("server is shutting down" if self._draining else "engine is not running")
        assert self._loop is not None
        stream = RequestStream(request_id, self, self.max_unread_tokens)
        self._requests[request_id] = _Tracking(stream, time.monotonic())
        self._idle.clear()
        accepted = self._loop.create_future()
        with self._cond:
            self._pending.adds.append((request_id, prompt, params, accepted))
            self._cond.notify()
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._forget(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Thread-safe; takes effect before the next step. Unknown ids are ignored."""
        with self._cond:
            self._pending.aborts.append(request_id)
            self._cond.notify()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._forget, request_id)

    async def drain(self, timeout: float, force: asyncio.Event | None = None) -> None:
        """Graceful stop: refuse new requests, give those in flight up to `timeout` seconds (or
        until `force` is set), abort the rest (their streams raise RequestAborted), stop."""
        self._draining = True
        if self._requests:
            logger.info("draining %d request(s) for up to %.1f s", len(self._requests), timeout)
            waits = [asyncio.ensure_future(self._idle.wait())]
            if force is not None:
                waits.append(asyncio.ensure_future(force.wait()))
            try:
                await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        await self.shutdown(
            "the server is shutting down and the request did not finish within the shutdown timeout"
            if self._requests
            else "server is shutting down"
        )

    async def shutdown(self, reason: str = "server is shutting down", join_timeout: float = 30.0) -> None:
        """Stops the thread after its step; aborts every request in flight. Safe to call twice."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            unseen, self._pending.adds = self._pending.adds, []  # the thread may be stuck in a step
        for *_, accepted in unseen:
            _resolve(accepted, RequestAborted(reason))
        aborted = list(self._requests)
        for rid in aborted:  # their handlers answer now, whatever the engine thread is doing
            self._requests.pop(rid).stream.put(RequestAborted(reason))
        self._idle.set()
        if self._thread is not None and self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, join_timeout)
            if self._thread.is_alive():  # a step that does not end; the thread is a daemon
                logger.error("the engine step did not end within %.0f s of the shutdown", join_timeout)
                return
            stats = self.stats
            logger.info(
                "engine stopped: %d request(s) aborted, %d KV blocks in use",
                len(aborted),
                stats.num_blocks_used if stats is not None else -1,
            )

    # ---- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve_forever()
        except BaseException as e:  # a bug here must not leave awaiting requests hanging forever
            logger.exception("engine thread died")
            with self._cond:
                self._stopping = True
                pending, self._pending = self._pending, _Pending()
            assert self._loop is not None
            for *_, accepted in pending.adds:
                self._loop.call_soon_threadsafe(_resolve, accepted, RequestAborted(f"engine failed: {e}"))
            self._loop.call_soon_threadsafe(self._fail_all, e)

    def _serve_forever(self) -> None:
        engine, loop = self.engine, self._loop
        assert loop is not None
        while True:
            with self._cond:
                while not (
                    self._stopping or self._pending.adds or self._pending.aborts or engine.has_unfinished_requests()
                ):
                    self._waiting_for_work = True
                    self._cond.wait()
                self._heartbeat = time.monotonic()
                self._waiting_for_work = False
                pending, self._pending = self._pending, _Pending()
                stopping = self._stopping
            # Adds first: an abort queued together with its own add must find the request.
            for rid, prompt, params, accepted in pending.adds:
                error: BaseException | None = None
                try:
                    engine.add_request(rid, prompt, params)
                    self._live.add(rid)
                except Exception as e:  # ValueError: user error; anything else reported too
                    error = e
                loop.call_soon_threadsafe(_resolve, accepted, error)
            aborts = pending.aborts
            if stopping:
                aborts = aborts + list(self._live)
            if aborts:
                self._safe_abort(aborts)
            if stopping:
                self.stats = engine.get_stats()
                return
            outputs: list[RequestOutput] = []
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as e:  # a failed step must not take the server down
                    logger.exception("engine step failed; aborting the requests in flight")
                    failed = list(self._live)
                    loop.call_soon_threadsafe(self._fail_all, e, failed)
                    self._safe_abort(failed)
            self._live.difference_update(o.request_id for o in outputs if o.finished)
            self.stats = engine.get_stats()
            if outputs:
                loop.call_soon_threadsafe(self._dispatch, outputs, time.monotonic())

    def _safe_abort(self, request_ids: list[str]) -> None:
        # Only ids still inside the engine: aborting finished or rejected ones is a no-op anyway.
        live = [rid for rid in request_ids if rid in self._live]
        if not live:
            return
        self._live.difference_update(live)
        try:
            self.engine.abort_request(live)
        except Exception:
            logger.exception("abort_request failed for %s", live)

    # ---- event loop ----------------------------------------------------------------------

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        if not self._requests:
            self._idle.set()

    def _fail_all(self, error: BaseException, request_ids: list[str] | None = None) -> None:
        for rid in list(self._requests) if request_ids is None else request_ids:
            tracking = self._requests.get(rid)
            if tracking is not None:
                self._forget(rid)
                tracking.stream.put(RequestAborted(f"engine failed: {error}"))

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            tr = self._requests.get(out.request_id)
            if tr is None:  # aborted meanwhile
                continue
            if self.metrics is not None:
                self._observe(tr, out, now)
            tr.stream.put(out)
            if out.finished:
                self._forget(out.request_id)

    def _observe(self, tr: _Tracking, out: RequestOutput, now: float) -> None:
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            if tr.last_token_time is None:
                self.metrics.observe_first_token(now - tr.arrival)
            else:
                self.metrics.observe_inter_token(now - tr.last_token_time)
            tr.last_token_time = now
            tr.num_tokens += new_tokens
        if out.finished:
            reason = out.outputs[0].finish_reason if out.outputs else None
            self.metrics.observe_finished(now - tr.arrival, reason)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the waiter was cancelled; its abort is already queued
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
