"""Fuzzing the API with hypothesis: 500 generated bodies per endpoint (wrong types, out-of-range numbers, NaN,
lone surrogates, garbage bytes, streams), each answered without a 5xx, every invalid body with a 400 (as OpenAI
and vLLM: no 422), every error in OpenAI's format, every stream ended by [DONE]; afterwards the server is
healthy and every KV block is free. Outputs are 1-2 tokens of the embedded model, so the whole file takes well
under a minute on two cores."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparseserve.engine.async_engine import AsyncLLMEngine
from sparseserve.engine.engine import LLMEngine
from sparseserve.entrypoints.api_server import ServerConfig, build_app
from sparseserve.metrics import parse_metrics
from tests.server_utils import serve_in_thread

ENGINE_KW = dict(device="cpu", seed=0, max_model_len=128, num_gpu_blocks_override=128, max_num_seqs=16)
EXAMPLES = 500  # per endpoint: 1,000 bodies in all
MAX_BODY = 4096

# Text of any code point, lone surrogates included (JSON escapes them; no encoder accepts them).
TEXT = st.text(st.characters(exclude_categories=()), max_size=24)
SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True) | TEXT
)
JUNK = st.recursive(SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3), max_leaves=6)
TOKEN_IDS = st.lists(st.integers(-5, 5000), max_size=8)
SMALL = st.integers(1, 2)  # max_tokens that keep a valid request cheap
NUMBER = st.floats(-2, 3, allow_nan=False) | st.sampled_from([0.0, 1e-45, 1e-3, float("nan"), float("inf")])


def mostly(valid: st.SearchStrategy, junk: st.SearchStrategy = JUNK) -> st.SearchStrategy:
    """Mostly a value of the right type (in range or not), sometimes anything: so that a fair share of the
    bodies gets through validation and into the engine."""
    return st.integers(0, 9).flatmap(lambda i: junk if i == 0 else valid)


# max_tokens null would let a chat request run to max_model_len: slow, and no different from 2 tokens here.
MAX_TOKENS = mostly(SMALL, JUNK.filter(lambda v: v is not None))


def common_fields() -> dict[str, st.SearchStrategy]:
    return {
        "model": mostly(st.just("tiny") | TEXT),
        "temperature": mostly(NUMBER),
        "top_p": mostly(NUMBER),
        "top_k": mostly(st.integers(-3, 50)),
        "min_p": mostly(NUMBER),
        "n": mostly(st.integers(-1, 3)),
        "stop": mostly(TEXT | st.lists(TEXT, max_size=3)),
        "stop_token_ids": mostly(TOKEN_IDS),
        "seed": mostly(st.integers(-(2**65), 2**65)),
        "stream": mostly(st.booleans()),
        "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "ignore_eos": mostly(st.booleans()),
        "frequency_penalty": mostly(st.just(0.0) | NUMBER),
        "user": mostly(TEXT),
        "unknown_field": JUNK,
    }


def completion_bodies() -> st.SearchStrategy:
    prompt = TEXT | TOKEN_IDS | st.lists(TEXT, max_size=2) | st.lists(TOKEN_IDS, max_size=2)
    return st.fixed_dictionaries(
        {"prompt": mostly(prompt), "max_tokens": MAX_TOKENS},
        optional={
            **common_fields(),
            "logprobs": mostly(st.integers(-1, 22)),
            "echo": mostly(st.booleans()),
            "suffix": mostly(TEXT | st.none()),
        },
    )


def chat_bodies() -> st.SearchStrategy:
    part = st.fixed_dictionaries({"type": mostly(st.just("text")), "text": mostly(TEXT)})
    message = st.fixed_dictionaries(
        {
            "role": mostly(st.sampled_from(["user", "assistant", "system", "developer", "tool", "robot"])),
            "content": mostly(TEXT | st.lists(part, max_size=2) | st.none()),
        }
    )
    return st.fixed_dictionaries(
        {"messages": mostly(st.lists(message, max_size=3)), "max_tokens": MAX_TOKENS},
        optional={
            **common_fields(),
            "max_completion_tokens": mostly(SMALL),
            "logprobs": mostly(st.booleans()),
            "top_logprobs": mostly(st.integers(-1, 22)),
            "add_generation_prompt": mostly(st.booleans()),
        },
    )


def payloads(bodies: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly JSON bodies (NaN and Infinity as Python's json writes them), some raw bytes."""
    as_json = bodies.map(lambda b: json.dumps(b, allow_nan=True).encode())
    return as_json | as_json | as_json | st.binary(max_size=64)


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLMEngine(LLMEngine.from_kwargs(**ENGINE_KW))
    app = build_app(engine, ServerConfig(served_model_names=("tiny",), max_request_body_bytes=MAX_BODY))
    with serve_in_thread(app) as url:
        yield url


def check_response(r: httpx.Response, payload: bytes) -> None:
    """No 5xx; an invalid body is a 400 (never FastAPI's 422), an unknown model a 404, a body over the limit a 413."""
    assert r.status_code in (200, 400, 404, 413), (r.status_code, payload, r.text[:500])
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, (payload, err)
        assert r.status_code != 404 or err["code"] == "model_not_found", (payload, err)
        assert r.status_code != 413 or len(payload) > MAX_BODY, (payload, err)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (payload, r.text[-300:])
        for e in events[:-1]:
            msg = json.loads(e)
            assert "error" not in msg or msg["error"]["code"] < 500, (payload, msg)
    else:
        assert r.json()["choices"], payload


def fuzz(url: str, path: str, bodies: st.SearchStrategy) -> None:
    with httpx.Client(base_url=url, timeout=60, headers={"content-type": "application/json"}) as client:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(payload=payloads(bodies))
        def one(payload: bytes) -> None:
            check_response(client.post(path, content=payload), payload)

        one()


def assert_healthy_and_idle(url: str) -> None:
    assert httpx.get(f"{url}/health").status_code == 200
    deadline = time.monotonic() + 30
    while (m := parse_metrics(httpx.get(f"{url}/metrics").text))["sparseserve:kv_cache_blocks_used"] > 0:
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    assert m["sparseserve:num_requests_running"] == 0 and m["sparseserve:num_requests_waiting"] == 0
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.slow
def test_fuzz_completions(server):
    fuzz(server, "/v1/completions", completion_bodies())
    assert_healthy_and_idle(server)


@pytest.mark.slow
def test_fuzz_chat_completions(server):
    fuzz(server, "/v1/chat/completions", chat_bodies())
    assert_healthy_and_idle(server)
