"""The server's prefix-cache surface: usage.prompt_tokens_details.cached_tokens like OpenAI's, only with vLLM's
--enable-prompt-tokens-details (the count tells a client whether anyone sent the same prefix before); vLLM's
cache_salt request field; --cache-salt-source api-key / header:NAME keeping tenants' blocks apart."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import httpx
import openai
import pytest

from sparseserve.engine.async_engine import AsyncLLMEngine
from sparseserve.engine.engine import LLMEngine
from sparseserve.entrypoints.api_server import ServerConfig, build_app
from sparseserve.metrics import parse_metrics
from tests.server_utils import serve_in_thread, server_process

MODEL = "tiny"
ENGINE_KW = dict(device="cpu", seed=0, max_model_len=512, num_gpu_blocks_override=64)
PROMPT = list(range(100, 300))  # 200 tokens: 6 full blocks of 32


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_kwargs(**ENGINE_KW)


@pytest.fixture
def serve(engine):
    """A server on the module's engine with the given ServerConfig options (one at a time; caches reset)."""

    def start(**options):
        engine.reset_prefix_cache()
        return serve_in_thread(build_app(AsyncLLMEngine(engine), ServerConfig(served_model_names=(MODEL,), **options)))

    return start


def test_cached_tokens_in_usage_and_cache_salt(serve):
    with serve(enable_prompt_tokens_details=True) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")

        def cached(**extra) -> int:
            c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body=extra)
            return c.usage.prompt_tokens_details.cached_tokens

        assert cached() == 0
        assert cached() == 192
        assert cached(cache_salt="tenant-a") == 0  # another tenant shares nothing
        assert cached(cache_salt="tenant-a") == 192
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=2,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 192
        messages = [{"role": "user", "content": "Tell me about prefix caching. " * 10}]
        r1 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
        r2 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        assert r2.usage.prompt_tokens_details.cached_tokens == (r2.usage.prompt_tokens - 1) // 32 * 32 > 0
        r = httpx.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": ""}
        )
        assert r.status_code == 400 and "cache_salt" in r.text


def hits(url: str) -> tuple[float, float]:
    m = parse_metrics(httpx.get(f"{url}/metrics").text)
    return m["sparseserve:prefix_cache_queries_total"], m["sparseserve:prefix_cache_hits_total"]


def test_cached_tokens_are_not_reported_by_default(serve):
    with serve() as url:
        body = {"prompt": PROMPT, "max_tokens": 2}
        for _ in range(2):
            usage = httpx.post(f"{url}/v1/completions", json=body).json()["usage"]
            assert usage.get("prompt_tokens_details") is None, usage
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            timeout=30,
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["usage"]["prompt_tokens"] == 200 and events[-1]["usage"].get("prompt_tokens_details") is None
        chat = {"messages": [{"role": "user", "content": "hi " * 50}], "max_tokens": 2}
        for _ in range(2):
            usage = httpx.post(f"{url}/v1/chat/completions", json=chat).json()["usage"]
            assert usage.get("prompt_tokens_details") is None, usage
        _, hit = hits(url)
        assert hit >= 2 * 192  # the cache did serve the repeats: only the report is withheld


def _post(url: str, headers: list[tuple[str, str]], body: dict) -> tuple[int, dict]:
    """One request with headers given as a list (a name may repeat)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    data = json.dumps(body).encode()
    conn.putrequest("POST", "/v1/completions")
    for name, value in headers + [("content-type", "application/json"), ("content-length", str(len(data)))]:
        conn.putheader(name, value)
    conn.endheaders(data)
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def test_a_header_names_the_tenant(serve):
    with serve(cache_salt_source="header:X-Tenant", enable_prompt_tokens_details=True) as url:

        def cached(tenant: str, **extra) -> int:
            status, body = _post(url, [("X-Tenant", tenant)], {"prompt": PROMPT, "max_tokens": 1, **extra})
            assert status == 200, body
            return body["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert [cached("a"), cached("a"), cached("b"), cached("b")] == [0, 192, 0, 192]
        # a tenant's own cache_salt partitions its space further, and never reaches another tenant's
        assert [cached("a", cache_salt="x"), cached("a", cache_salt="x"), cached("b", cache_salt="x")] == [0, 192, 0]
        status, body = _post(url, [], {"prompt": PROMPT, "max_tokens": 1})
        assert status == 400 and "X-Tenant" in body["error"]["message"]
        status, body = _post(url, [("X-Tenant", "a"), ("X-Tenant", "b")], {"prompt": PROMPT, "max_tokens": 1})
        assert status == 400 and "2 X-Tenant headers" in body["error"]["message"]


def test_cache_salt_source_is_checked():
    for bad in ("header:", "key", "api-key"):  # api-key without --api-key
        with pytest.raises(ValueError, match="cache-salt-source"):
            ServerConfig(served_model_names=(MODEL,), cache_salt_source=bad)
    assert ServerConfig(served_model_names=(MODEL,), api_key="k").api_key == ("k",)


@pytest.mark.slow
def test_api_keys_never_share_blocks_in_a_real_server():
    """`sparseserve serve --api-key k1 k2 --cache-salt-source api-key`: the second key's identical prompt computes
    every token (the prefix-cache counters of /metrics), each key reuses its own blocks, and usage carries no
    cached_tokens (no --enable-prompt-tokens-details)."""
    flags = (
        "--api-key",
        "k1",
        "k2",
        "--cache-salt-source",
        "api-key",
        "--max-model-len",
        "512",
        "--num-gpu-blocks-override",
        "64",
    )
    with server_process(*flags) as (proc, url):

        def send(key: str) -> tuple[float, float]:
            before = hits(url)
            r = httpx.post(
                f"{url}/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 1},
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            )
            assert r.status_code == 200 and r.json()["usage"].get("prompt_tokens_details") is None, r.text
            after = hits(url)
            return after[0] - before[0], after[1] - before[1]

        assert send("k1") == (200, 0)
        assert send("k1") == (200, 192)  # the same tenant shares
        assert send("k2") == (200, 0)  # another key computes every token
        assert send("k2") == (200, 192)
        assert (
            httpx.post(
                f"{url}/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 1},
                headers={"Authorization": "Bearer k3"},
            ).status_code
            == 401
        )
