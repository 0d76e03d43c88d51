"""The server's prefix-cache surface: usage.prompt_tokens_details.cached_tokens like OpenAI's, and vLLM's
cache_salt request field keeping tenants apart (in-process server on the embedded model)."""
from __future__ import annotations

import httpx
import openai
import pytest

from sparseserve.engine.async_engine import AsyncLLMEngine
from sparseserve.engine.engine import LLMEngine
from sparseserve.entrypoints.api_server import ServerConfig, build_app
from tests.server_utils import serve_in_thread

MODEL = "tiny"


@pytest.fixture(scope="module")
def url():
    engine = AsyncLLMEngine(LLMEngine.from_kwargs(device="cpu", seed=0, max_model_len=512, num_gpu_blocks_override=64))
    with serve_in_thread(build_app(engine, ServerConfig(served_model_names=(MODEL,)))) as base:
        yield base


def test_cached_tokens_in_usage_and_cache_salt(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    prompt = list(range(100, 300))  # 200 tokens: 6 full blocks of 32

    def cached(**extra) -> int:
        c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
        return c.usage.prompt_tokens_details.cached_tokens

    assert cached() == 0
    assert cached() == 192
    assert cached(cache_salt="tenant-a") == 0  # another tenant shares nothing
    assert cached(cache_salt="tenant-a") == 192
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 192
    messages = [{"role": "user", "content": "Tell me about prefix caching. " * 10}]
    r1 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    r2 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.usage.prompt_tokens_details.cached_tokens == (r2.usage.prompt_tokens - 1) // 32 * 32 > 0
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400 and "cache_salt" in r.text
