"""5xx hygiene, request validation and the API's conventions, against a real server on the embedded model:
every error is OpenAI JSON that names its `param`, invalid Unicode is a 400, and no error resets a kept-alive
connection."""

from __future__ import annotations

import http.client
import json
import math
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest
from fastapi.testclient import TestClient

from sparseserve.engine.async_engine import AsyncLLMEngine
from sparseserve.engine.engine import LLMEngine
from sparseserve.entrypoints.api_server import ServerConfig, build_app
from tests.server_utils import serve_in_thread

ENGINE_KW = dict(device="cpu", seed=0, max_model_len=256, num_gpu_blocks_override=256, max_num_seqs=16)
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLMEngine(LLMEngine.from_kwargs(**ENGINE_KW))
    app = build_app(engine, ServerConfig(served_model_names=("tiny",), api_key=KEY, max_request_body_bytes=65536))
    with serve_in_thread(app) as url:
        yield url, engine


def post(url: str, path: str, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # json escapes surrogates
    return httpx.post(
        f"{url}{path}",
        content=content,
        timeout=60,
        headers={**AUTH, "content-type": "application/json", **(headers or {})},
    )


def assert_openai_error(r: httpx.Response | http.client.HTTPResponse, status: int, body: bytes | None = None) -> dict:
    assert r.status == status if isinstance(r, http.client.HTTPResponse) else r.status_code == status
    err = json.loads(body if body is not None else r.content)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": "fine \udfff text", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": ["\udc00"], "max_tokens": 2}, "prompt.0"),
        ("/v1/completions", {"prompt": "ok", "stop": ["\ud83d"], "max_tokens": 2}, "stop.0"),
        ("/v1/completions", {"prompt": "ok", "model": "\ud800", "max_tokens": 2}, "model"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "system", "content": "ok"},
                    {"role": "user", "content": [{"type": "text", "text": "a\udbffb"}]},
                ],
                "max_tokens": 2,
            },
            "messages.1.content.0.text",
        ),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_param(server, path, body, param):
    url, _ = server
    r = post(url, path, body)
    err = assert_openai_error(r, 400)
    assert (
        err["param"] == param and err["message"] == f"{param} is not valid Unicode (it holds a lone UTF-16 surrogate)."
    )
    assert post(url, path, {**body, "prompt": "ok", "messages": CHAT, "stop": None, "model": None}).status_code == 200


def test_raw_invalid_utf8_is_a_400(server):
    url, _ = server
    r = post(url, "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}')
    assert_openai_error(r, 400)


def _request(
    conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None, headers: dict | None = None
) -> tuple[http.client.HTTPResponse, bytes]:
    conn.request(method, path, body=body, headers={**AUTH, "content-type": "application/json", **(headers or {})})
    r = conn.getresponse()
    return r, r.read()


def test_one_kept_alive_connection_survives_every_error(server, monkeypatch):
    """One socket: 400s, 401, 404, 405, a 500 from an unexpected exception and a 503, each an OpenAI error,
    then a good request on the same socket. Only the 413 (its body is left unread) closes, and says so."""
    url, engine = server
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    good = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    _, _ = _request(conn, "POST", "/v1/completions", good)
    sock = conn.sock

    def boom(*args, **kwargs):
        raise RuntimeError("tokenizer exploded")

    tokenizer = engine.engine.tokenizer
    cases = [
        ("POST", "/v1/completions", b"{nope", {}, 400),
        ("POST", "/v1/completions", good, {"Authorization": "Bearer wrong"}, 401),
        ("GET", "/v1/nothing", None, {}, 404),
        ("GET", "/v1/completions", None, {}, 405),
        ("POST", "/v1/completions", b'{"prompt": 5}', {}, 400),
        ("POST", "/v1/completions", json.dumps({"prompt": "\ud800"}).encode(), {}, 400),
        ("POST", "/v1/completions", good, {}, 500),
        ("POST", "/v1/completions", json.dumps({"prompt": "hi", "temperature": math.nan}).encode(), {}, 400),
    ]
    for method, path, body, headers, status in cases:
        if status == 500:
            monkeypatch.setattr(tokenizer, "encode", boom)
        r, data = _request(conn, method, path, body, headers)
        monkeypatch.undo()
        err = assert_openai_error(r, status, data)
        assert r.getheader("connection") != "close", (status, err)
        if status == 405:
            assert r.getheader("allow") == "POST"
        if status == 500:
            assert err["type"] == "internal_error" and "RuntimeError" in err["message"]
        r, data = _request(conn, "POST", "/v1/completions", good)
        assert r.status == 200 and json.loads(data)["usage"]["completion_tokens"] == 2
        assert conn.sock is sock, f"the connection was replaced after the {status}"
    r, data = _request(conn, "POST", "/v1/completions", b'{"prompt": "' + b"x" * 70000 + b'"}')
    assert_openai_error(r, 413, data)
    assert r.getheader("connection") == "close"
    conn.close()


def test_bearer_scheme_is_case_insensitive_and_required(server):
    url, _ = server
    body = {"prompt": "hi", "max_tokens": 1}
    for auth in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY}"):
        assert post(url, "/v1/completions", body, {"Authorization": auth}).status_code == 200, auth
    for auth in (KEY, f"Basic {KEY}", f"Bearer{KEY}", "Bearer", f"Bearer {KEY}x", ""):
        r = post(url, "/v1/completions", body, {"Authorization": auth})
        assert assert_openai_error(r, 401)["code"] == "invalid_api_key", auth


# Each validation failure of the API, with the `param` it must name. NaN and Infinity are JSON extensions that
# Python's json (and so the server) accepts.
VALIDATION_CASES = [
    ({"prompt": "hi", "temperature": math.nan}, 400, "temperature"),
    ({"prompt": "hi", "temperature": math.inf}, 400, "temperature"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": math.nan}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ({"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "n": 17}, 400, "n"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [7] * 200, "max_tokens": 100}, 400, "max_tokens"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": [True]}, 400, "stop_token_ids.0"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": [True, False]}, 400, "prompt"),
    ({"prompt": [[1, True]]}, 400, "prompt"),
    ({"prompt": [5, 99999]}, 400, "prompt"),
    ({"prompt": [-3]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a", ""]}, 400, "prompt"),
    ({"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ({"prompt": "hi", "seed": -(2**63) - 1}, 400, "seed"),
    ({"prompt": "hi", "seed": 1e30}, 400, "seed"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ({"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("body, status, param", VALIDATION_CASES)
def test_validation_errors_name_their_param(server, body, status, param):
    url, _ = server
    err = assert_openai_error(post(url, "/v1/completions", body), status)
    assert err["param"] == param, err


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"messages": CHAT, "temperature": math.nan}, 400, "temperature"),
        ({"messages": CHAT, "max_completion_tokens": 0}, 400, "max_tokens"),
        ({"messages": CHAT, "top_logprobs": 30, "logprobs": True}, 400, "top_logprobs"),
        ({"messages": CHAT, "stop_token_ids": [4096]}, 400, "stop_token_ids"),
        ({"messages": [{"role": "user", "content": "x " * 300}], "max_tokens": 1}, 400, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
        ({"messages": []}, 400, "messages"),
    ],
)
def test_chat_validation_errors_name_their_param(server, body, status, param):
    url, _ = server
    err = assert_openai_error(post(url, "/v1/chat/completions", body), status)
    assert err["param"] == param, err


def test_tiny_temperature_is_greedy_and_negative_seed_works(server):
    url, _ = server
    base = {"prompt": "The founders", "max_tokens": 6, "ignore_eos": True}
    greedy = post(url, "/v1/completions", {**base, "temperature": 0}).json()["choices"][0]["text"]
    tiny = post(url, "/v1/completions", {**base, "temperature": 1e-45, "seed": -7}).json()["choices"][0]["text"]
    assert tiny == greedy


def test_openapi_lists_errors_and_event_stream(server):
    url, _ = server
    doc = httpx.get(f"{url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "503"} <= set(responses) and "422" not in responses, path
        assert {"application/json", "text/event-stream"} <= set(responses["200"]["content"])
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
        assert doc["paths"][path]["post"]["security"] == [{"HTTPBearer": []}]
    assert "503" in doc["paths"]["/health"]["get"]["responses"]
    assert doc["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "Required when the server runs with --api-key.",
    }
    assert '"422"' not in json.dumps(doc) and "HTTPValidationError" not in json.dumps(doc)


def test_docs_can_be_disabled_and_metrics_protected(server):
    _, engine = server  # the app is only built, never started: no second engine thread
    app = build_app(
        engine,
        ServerConfig(
            served_model_names=("tiny",), api_key=KEY, metrics_require_api_key=True, disable_fastapi_docs=True
        ),
    )
    client = TestClient(app)
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert_openai_error(client.get(path), 404)
    assert_openai_error(client.get("/metrics"), 401)
    assert_openai_error(client.get("/metrics", headers={"Authorization": "Bearer nope"}), 401)
    assert client.get("/metrics", headers=AUTH).status_code == 200
    open_app = build_app(engine, ServerConfig(served_model_names=("tiny",), api_key=KEY))
    assert TestClient(open_app).get("/metrics").status_code == 200
    assert TestClient(open_app).get("/openapi.json").status_code == 200
    for path in ("/docs", "/redoc"):  # never served: FastAPI's pages load their scripts from a public CDN
        assert_openai_error(TestClient(open_app).get(path), 404)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "n": True}, "n"),
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"prompt": "hi", "seed": False}, "seed"),
        ({"prompt": "hi", "logprobs": True}, "logprobs"),
        ({"prompt": "hi", "top_k": True}, "top_k"),
        ({"prompt": "hi", "temperature": True}, "temperature"),
    ],
)
def test_booleans_are_not_numbers(server, body, param):
    url, _ = server
    err = assert_openai_error(post(url, "/v1/completions", body), 400)
    assert err["param"] == param and "boolean" in err["message"], err


def test_every_out_of_range_n_gets_one_message(server):
    """n beyond max_num_seqs (16 here) and beyond SamplingParams' 64 answer alike."""
    url, _ = server
    for n in (0, 17, 65, 200, 257, 10**6):
        err = assert_openai_error(post(url, "/v1/completions", {"prompt": "hi", "n": n}), 400)
        assert err["param"] == "n" and err["message"] == f"n must be an integer in [1, 16], got {n}", err
    err = assert_openai_error(post(url, "/v1/chat/completions", {"messages": CHAT, "n": 65}), 400)
    assert err["message"] == "n must be an integer in [1, 16], got 65"


def test_two_authorization_headers_are_refused(server):
    url, _ = server
    u = urlparse(url)
    for first, second in (
        (f"Bearer {KEY}", "Bearer wrong"),
        ("Bearer wrong", f"Bearer {KEY}"),
        (f"Bearer {KEY}", f"Bearer {KEY}"),
    ):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.putrequest("POST", "/v1/completions")
        body = b'{"prompt": "hi", "max_tokens": 1}'
        for name, value in (
            ("Authorization", first),
            ("Authorization", second),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
        ):
            conn.putheader(name, value)
        conn.endheaders(body)
        r = conn.getresponse()
        err = assert_openai_error(r, 400, r.read())
        assert "2 Authorization headers" in err["message"], err
        conn.close()


def test_content_length_with_chunked_encoding_is_refused(server):
    url, _ = server
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    body = b'{"prompt": "hi", "max_tokens": 1}'
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\ncontent-type: application/json\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        + hex(len(body))[2:].encode()
        + b"\r\n"
        + body
        + b"\r\n0\r\n\r\n"
    )
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"connection: close" in head.lower(), data[:300]
    assert "Content-Length and Transfer-Encoding" in json.loads(payload)["error"]["message"]
    assert post(url, "/v1/completions", body).status_code == 200  # chunked alone is fine (httpx: content-length)


def test_an_exception_mid_stream_ends_it_with_an_error_event(server, monkeypatch):
    """After the status line went out, a failure is reported in band: an error event, then [DONE], and the
    connection stays usable."""
    from sparseserve.entrypoints import serving

    url, engine = server
    real, calls = serving.CompletionFormat.chunks, [0]

    def flaky(self, deltas):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("formatting failed")
        return real(self, deltas)

    monkeypatch.setattr(serving.CompletionFormat, "chunks", flaky)
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = json.dumps({"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "stream": True}).encode()
    r, data = _request(conn, "POST", "/v1/completions", body)
    sock = conn.sock
    events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
    assert r.status == 200 and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 500 and err["type"] == "internal_error" and len(events) == 4
    monkeypatch.undo()
    r, data = _request(conn, "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
    assert r.status == 200 and conn.sock is sock
    conn.close()
    deadline = time.monotonic() + 20  # the failed stream's request was aborted: its blocks are free
    while engine.stats.num_blocks_used:
        assert time.monotonic() < deadline
        time.sleep(0.05)
