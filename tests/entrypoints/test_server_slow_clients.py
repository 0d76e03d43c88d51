"""Slow and half-open clients: read deadlines release their connections, a connection cap answers 503, one
client address holds at most its share of the connections without a whole request."""

from __future__ import annotations

import http.client
import json
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from sparseserve.engine.async_engine import AsyncLLMEngine
from sparseserve.engine.engine import LLMEngine
from sparseserve.entrypoints.api_server import ServerConfig, build_app
from sparseserve.entrypoints.http_server import ClientLimits, running_server

ENGINE_KW = dict(device="cpu", seed=0, max_model_len=128, num_gpu_blocks_override=64, max_num_seqs=4)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_kwargs(**ENGINE_KW)


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection; fails if it keeps it open past `timeout`."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"connection still open after {timeout} s; received {data[:200]!r}") from None
    return data


def test_half_open_connections_are_released_after_the_timeouts(engine):
    limits = ClientLimits(header_timeout=0.5, body_timeout=0.5, max_connections=None)
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, ServerConfig(served_model_names=("tiny",)))
    with running_server(app, async_engine, limits=limits) as (url, server):
        u = urlparse(url)
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\ncontent-type: application/json\r\n"
        partial = {
            "silent": b"",
            "partial request line": b"POST /v1/compl",
            "partial headers": head.encode(),
            "partial body": (head + "content-length: 100\r\n\r\n").encode() + b'{"prompt": "hel',
        }
        socks = {}
        for name, data in partial.items():
            for i in range(10):  # many of each, like a slowloris
                s = socket.create_connection((u.hostname, u.port))
                s.sendall(data)
                socks[f"{name} {i}"] = s
        for name, s in socks.items():
            data = read_until_closed(s, timeout=20)  # the deadlines are 0.5 s; generous for a loaded CI machine
            s.close()
            status, _, body = data.partition(b"\r\n\r\n")
            assert status.startswith(b"HTTP/1.1 408"), (name, data[:200])
            err = json.loads(body)["error"]
            assert err["code"] == 408 and ("body" if "body" in name else "headers") in err["message"], name
        deadline = time.monotonic() + 20
        while server.server_state.connections:
            assert time.monotonic() < deadline, f"{len(server.server_state.connections)} connections still held"
            time.sleep(0.05)
        # A kept-alive connection whose next request stalls halfway is released too, and a well-behaved
        # client is served throughout.
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=20)
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps({"prompt": "hi", "max_tokens": 2}),
            headers={"content-type": "application/json"},
        )
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2
        conn.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert read_until_closed(conn.sock, timeout=20).startswith(b"HTTP/1.1 408")
        conn.close()
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_connections_beyond_the_limit_get_503(engine):
    limits = ClientLimits(max_connections=3)
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, ServerConfig(served_model_names=("tiny",)))
    with running_server(app, async_engine, limits=limits) as (url, server):
        u = urlparse(url)
        held = []
        for _ in range(3):  # kept-alive connections count until they close
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=20)
            c.request("GET", "/health")
            assert c.getresponse().status == 200
            held.append(c)
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=20)
        c.request("GET", "/v1/models")
        r = c.getresponse()
        assert r.status == 503 and r.getheader("connection") == "close"
        assert "--limit-concurrency" in json.loads(r.read())["error"]["message"]
        c.close()
        for c in held:
            c.close()
        deadline = time.monotonic() + 20
        while len(server.server_state.connections) > 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.get(f"{url}/v1/models").status_code == 200


def test_malformed_http_gets_a_json_400(engine):
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, ServerConfig(served_model_names=("tiny",)))
    with running_server(app, async_engine) as (url, _):
        u = urlparse(url)
        s = socket.create_connection((u.hostname, u.port))
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        data = read_until_closed(s, timeout=20)
        s.close()
        status, _, body = data.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["code"] == 400


def open_slow(host: str, port: int, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    """n connections that send half a request's headers and then nothing (a slowloris)."""
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, port), source_address=(source, 0))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    return socks


def health(url: str, source: str) -> int:
    """/health on a fresh connection from `source` (any 127.x address is this machine)."""
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=20) as client:
        return client.get(f"{url}/health").status_code


@pytest.mark.parametrize(
    "limits, slow",
    [
        (ClientLimits(max_connections=48, max_pending_per_client=16), 200),
        pytest.param(ClientLimits(), 2200, marks=pytest.mark.slow),  # the defaults: 2048, 256 pending per client
    ],
)
def test_one_client_cannot_take_every_connection_slot(engine, limits, slow):
    """Slow connections from one address: past max_pending_per_client each new one closes that client's oldest
    (a 503 for its partial request), so /health answers 200 on a fresh connection from another address and from
    the same one, and the slow client holds at most its share."""
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, ServerConfig(served_model_names=("tiny",)))
    with running_server(app, async_engine, limits=limits) as (url, server):
        u = urlparse(url)
        socks = open_slow(u.hostname, u.port, slow)
        try:
            assert health(url, "127.0.0.2") == 200 and health(url, "127.0.0.1") == 200
            data = read_until_closed(socks[0], timeout=20)  # the oldest was closed, with an answer
            assert data.startswith(b"HTTP/1.1 503") and b"oldest" in data, data[:300]
            assert len(server.server_state.connections) <= limits.max_pending_per_client + 2
            socks[-1].sendall(b"\r\n")  # the newest is still served
            socks[-1].settimeout(20)
            assert socks[-1].recv(12) == b"HTTP/1.1 200"
        finally:
            for s in socks:
                s.close()


def test_without_a_per_client_limit_one_client_takes_every_slot(engine):
    """The same slow client with max_pending_per_client off: a fresh /health gets 503 (what the limit prevents)."""
    limits = ClientLimits(max_connections=48, max_pending_per_client=None)
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, ServerConfig(served_model_names=("tiny",)))
    with running_server(app, async_engine, limits=limits) as (url, _):
        u = urlparse(url)
        socks = open_slow(u.hostname, u.port, 60)
        try:
            assert health(url, "127.0.0.2") == 503
        finally:
            for s in socks:
                s.close()
