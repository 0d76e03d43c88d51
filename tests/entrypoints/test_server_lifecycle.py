"""Shutdown, the engine watchdog and aborts: a drained server ends every request in flight with an error event or
a 503 (never a cut stream), frees its blocks and exits with 0; /health notices a stuck engine loop."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from sparseserve import SamplingParams
from sparseserve.engine.async_engine import AsyncLLMEngine
from sparseserve.engine.engine import LLMEngine
from sparseserve.entrypoints.api_server import ServerConfig, build_app
from sparseserve.entrypoints.http_server import running_server
from sparseserve.metrics import parse_metrics
from tests.server_utils import server_log, start_server_process

ENGINE_KW = dict(device="cpu", seed=0, max_model_len=512, num_gpu_blocks_override=256, max_num_seqs=16)


def slow_steps(engine: AsyncLLMEngine, seconds: float) -> None:
    """Each engine step takes at least `seconds`: requests then surely outlast a short shutdown timeout."""
    real = engine.engine.step

    def step():
        time.sleep(seconds)
        return real()

    engine.engine.step = step


async def sse(client: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event) -> list[dict | str]:
    events: list[dict | str] = []
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                started.set()
    return events


async def until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_shutdown_past_the_deadline_ends_every_request_cleanly():
    engine = AsyncLLMEngine(LLMEngine.from_kwargs(**ENGINE_KW))
    slow_steps(engine, 0.02)
    app = build_app(engine, ServerConfig(served_model_names=("tiny",)))
    long = {"prompt": "Tell a long story.", "max_tokens": 400, "ignore_eos": True}
    short = {"prompt": "Hi.", "max_tokens": 4, "ignore_eos": True}
    with running_server(app, engine, shutdown_timeout=1.0) as (url, server):

        async def scenario():
            async with httpx.AsyncClient(timeout=60) as client:
                started = [asyncio.Event() for _ in range(3)]
                streams = [
                    asyncio.ensure_future(sse(client, url, long, started[0])),
                    asyncio.ensure_future(sse(client, url, long, started[1])),
                ]
                plain = [asyncio.ensure_future(client.post(f"{url}/v1/completions", json=long)) for _ in range(2)]
                await asyncio.gather(*(e.wait() for e in started[:2]))
                await until(lambda: engine.num_requests == 4)
                quick = asyncio.ensure_future(sse(client, url, short, started[2]))
                await started[2].wait()
                server.request_shutdown()
                await until(lambda: not engine.accepting)
                refused = await client.post(f"{url}/v1/completions", json=short)
                health = await client.get(f"{url}/health")
                return await asyncio.gather(*streams), await asyncio.gather(*plain), await quick, refused, health

        streams, plain, quick, refused, health = asyncio.run(scenario())
    for events in streams:  # cut at the deadline: an error event, then [DONE]
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503, events[-3:]
        assert "shutdown timeout" in events[-2]["error"]["message"]
        assert all("choices" in e for e in events[:-2])
    for r in plain:
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert quick[-1] == "[DONE]" and quick[-2]["choices"][0]["finish_reason"] == "length"  # finished in time
    assert refused.status_code == 503 and refused.headers["connection"] == "close"
    assert refused.json()["error"]["message"] == "The server is shutting down."
    assert health.status_code == 503
    assert engine.stats.num_blocks_used == 0 and not engine.engine.has_unfinished_requests()


@pytest.mark.slow
def test_sigterm_past_the_deadline_in_a_real_process():
    """SIGTERM with a stream and a non-streamed request that cannot finish within --shutdown-timeout: the stream
    ends with an error event and [DONE], the other request gets a 503 JSON, a new request a 503, the blocks are
    freed, the log holds no traceback and the process exits with 0."""
    proc, url = start_server_process(
        "--max-model-len", "8192", "--num-gpu-blocks-override", "600", "--shutdown-timeout", "1"
    )
    try:
        body = {"prompt": "Tell a long story.", "max_tokens": 8000, "ignore_eos": True}
        results: dict[str, object] = {}

        def non_streamed():
            results["plain"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        thread = threading.Thread(target=non_streamed)
        thread.start()
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            deadline = time.monotonic() + 60  # both requests running
            while parse_metrics(httpx.get(f"{url}/metrics").text)["sparseserve:num_requests_running"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            results["refused"] = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            rest = [line for line in lines if line.startswith("data: ")]
        thread.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        log = server_log(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == 503
    assert results["plain"].status_code == 503 and results["plain"].json()["error"]["code"] == 503
    assert results["refused"].status_code == 503
    assert "Traceback" not in log and "Exception" not in log, log
    assert "2 request(s) aborted, 0 KV blocks in use" in log, log


@pytest.mark.slow
def test_sigterm_lets_in_flight_stream_finish():
    """Within the timeout, a request in flight completes normally; then the process exits with 0."""
    proc, url = start_server_process("--max-model-len", "512", "--num-gpu-blocks-override", "64")
    try:
        body = {"prompt": "Tell a long story.", "max_tokens": 150, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
        log = server_log(proc)
        assert "effective config" in log and "Traceback" not in log
    finally:
        if proc.poll() is None:
            proc.kill()


def test_health_reports_a_stuck_engine_loop():
    engine = AsyncLLMEngine(LLMEngine.from_kwargs(**ENGINE_KW))
    app = build_app(engine, ServerConfig(served_model_names=("tiny",), engine_watchdog_timeout=0.3))
    release = threading.Event()
    real = engine.engine.step

    def stuck_step():
        release.wait(60)
        return real()

    with running_server(app, engine) as (url, _):
        assert httpx.get(f"{url}/health").status_code == 200
        time.sleep(0.5)  # idle for longer than the watchdog: still healthy, there is no work
        assert httpx.get(f"{url}/health").status_code == 200
        engine.engine.step = stuck_step
        done: dict[str, httpx.Response] = {}
        t = threading.Thread(
            target=lambda: done.setdefault(
                "r", httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            )
        )
        t.start()
        deadline = time.monotonic() + 30
        while (h := httpx.get(f"{url}/health")).status_code == 200:
            assert time.monotonic() < deadline, "the watchdog never fired"
            time.sleep(0.05)
        assert h.status_code == 503 and "has not completed a step" in h.json()["error"]["message"]
        engine.engine.step = real
        release.set()
        t.join(timeout=60)
        assert done["r"].status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200


class FailedRunner:
    """A runner after a tensor-parallel rank died, as TPDriver behaves then: `failure` says why (with the worker's
    traceback), and every step raises it."""

    def __init__(self, runner, failure: str) -> None:
        self.runner, self.failure = runner, failure

    def execute(self, *args, **kwargs):
        raise RuntimeError(f"{self.failure}; the tensor-parallel engine has stopped")

    def __getattr__(self, name):
        return getattr(self.runner, name)


def test_health_reports_an_engine_that_failed_for_good():
    engine = AsyncLLMEngine(LLMEngine.from_kwargs(**ENGINE_KW))
    app = build_app(engine, ServerConfig(served_model_names=("tiny",)))
    with running_server(app, engine) as (url, _):
        assert httpx.get(f"{url}/health").status_code == 200
        why = "tensor-parallel rank 1 (pid 7) was killed by signal 9:\nTraceback (most recent call last): ..."
        engine.engine.model_runner = FailedRunner(engine.engine.model_runner, why)
        h = httpx.get(f"{url}/health")  # idle: no request has to fail first
        assert h.status_code == 503
        error = h.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == 503
        assert "rank 1 (pid 7) was killed by signal 9" in error["message"] and "Traceback" not in error["message"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 503  # it stays failed


def test_abort_takes_effect_within_one_step():
    """An abort issued at any moment is applied before the next step: at most one more step (the one running
    when it arrived) includes the request."""
    engine = AsyncLLMEngine(LLMEngine.from_kwargs(**ENGINE_KW))
    llm = engine.engine
    real = llm.step
    lock = threading.Lock()
    steps_with: list[int] = []  # for each completed step, whether the request was in it
    count = [0]

    def counting_step():
        with lock:
            present = "r0" in llm.requests
        out = real()
        time.sleep(0.005)
        with lock:
            steps_with.append(present)
            count[0] += 1
        return out

    llm.step = counting_step

    async def scenario():
        engine.start()
        stream = await engine.add_request("r0", "A long story", SamplingParams(max_tokens=400, ignore_eos=True))
        for _ in range(3):
            await stream.__anext__()
        with lock:
            at_abort = count[0]
        stream.abort()
        await until(lambda: "r0" not in llm.requests)
        await asyncio.sleep(0.05)
        await engine.shutdown()
        return at_abort

    at_abort = asyncio.run(scenario())
    assert sum(steps_with[at_abort:]) <= 1, steps_with
    assert engine.stats.num_blocks_used == 0


@pytest.mark.parametrize(
    "flag",
    [
        "--shutdown-timeout",
        "--engine-watchdog-timeout",
        "--timeout-header-read",
        "--timeout-body-read",
        "--limit-concurrency",
        "--timeout-keep-alive",
        "--disable-fastapi-docs",
        "--metrics-require-api-key",
    ],
)
def test_server_flags_are_documented(flag):
    import argparse

    from sparseserve.entrypoints.api_server import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    action = next(a for a in parser._actions if flag in a.option_strings)
    assert action.help and "default" in action.help
