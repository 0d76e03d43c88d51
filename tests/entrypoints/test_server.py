"""OpenAI-compatible server on the embedded model, in-process on 127.0.0.1 (uvicorn in a thread)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from sparseserve import LLM, SamplingParams
from sparseserve.engine.async_engine import AsyncLLMEngine, RequestAborted
from sparseserve.engine.engine import LLMEngine
from sparseserve.entrypoints.api_server import ServerConfig, build_app
from sparseserve.metrics import parse_metrics
from tests.server_utils import serve_in_thread, server_process

ENGINE_KW = dict(device="cpu", seed=0, max_model_len=256, num_gpu_blocks_override=512, max_num_seqs=64)
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLMEngine(LLMEngine.from_kwargs(**ENGINE_KW))
    app = build_app(engine, ServerConfig(served_model_names=(MODEL,), api_key=KEY, max_request_body_bytes=65536))
    with serve_in_thread(app) as url:
        yield url, engine


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics").text)


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Engine stats are published after each step, so poll until the pool drains."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["sparseserve:kv_cache_blocks_used"] == 0 and m["sparseserve:num_requests_running"] == 0:
            return m
        assert time.monotonic() < deadline, f"blocks still in use: {m['sparseserve:kv_cache_blocks_used']}"
        time.sleep(0.05)


def test_openai_client_drives_both_endpoints(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    assert [m.id for m in client.models.list()] == [MODEL]

    c = client.completions.create(model=MODEL, prompt="The best way to", max_tokens=8, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 8 and c.choices[0].text
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The best way to",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == c.usage.prompt_tokens

    messages = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 6
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True)
    parts = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert "".join(parts) == r.choices[0].message.content

    lp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.tokens) == 3 and all(len(t) <= 2 for t in lp.choices[0].logprobs.top_logprobs)
    lp = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    assert all(len(t.top_logprobs) == 2 for t in lp.choices[0].logprobs.content)


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[dict[int, str], dict]:
    texts: dict[int, str] = {}
    usage: dict = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        msg = json.loads(line[6:])
        for ch in msg["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
        usage = msg.get("usage") or usage
    return texts, usage


@pytest.mark.slow
def test_64_concurrent_streams_match_offline_generate(server):
    url, _ = server
    prompts = [f"Request {i}: the startup founders said" for i in range(64)]
    params = [
        SamplingParams(max_tokens=4 + i % 13, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
        for i in range(64)
    ]

    async def run_all():
        async with httpx.AsyncClient(headers=AUTH, timeout=120) as client:
            bodies = [
                {
                    "model": MODEL,
                    "prompt": p,
                    "max_tokens": sp.max_tokens,
                    "temperature": sp.temperature,
                    "seed": sp.seed,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                for p, sp in zip(prompts, params)
            ]
            return await asyncio.gather(*(_stream(client, url, b) for b in bodies))

    before = metrics(url)
    results = asyncio.run(run_all())
    offline = LLM(**ENGINE_KW).generate(prompts, params, use_tqdm=False)
    for (texts, usage), ref, sp in zip(results, offline, params):
        assert texts[0] == ref.outputs[0].text
        assert usage["completion_tokens"] == sp.max_tokens
    after = wait_idle(url)
    assert after["sparseserve:request_success_total"] - before.get("sparseserve:request_success_total", 0) == 64
    assert (
        after["sparseserve:time_to_first_token_seconds_count"]
        - before.get("sparseserve:time_to_first_token_seconds_count", 0)
        == 64
    )


def test_client_disconnect_mid_stream_frees_blocks(server):
    url, _ = server
    before = metrics(url)
    body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(headers=AUTH, timeout=30) as client:
        with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            assert metrics(url)["sparseserve:kv_cache_blocks_used"] > 0
    after = wait_idle(url)  # the abort freed the request's blocks long before its 200 tokens
    generated = after["sparseserve:generation_tokens_total"] - before["sparseserve:generation_tokens_total"]
    assert generated < 200
    assert after["sparseserve:request_success_total"] == before["sparseserve:request_success_total"]


@pytest.mark.parametrize(
    "body,headers,status,needle",
    [
        (b"{not json", AUTH, 400, "Malformed JSON"),
        ({"model": MODEL, "max_tokens": 4}, AUTH, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, AUTH, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": [1]}, AUTH, 400, "temperature"),
        ({"model": "gpt-4", "prompt": "hi"}, AUTH, 404, "does not exist"),
        ({"model": MODEL, "prompt": [7] * 300}, AUTH, 400, "max_model_len"),
        ({"model": MODEL, "prompt": [7] * 200, "max_tokens": 100}, AUTH, 400, "200 in the prompt, 100 to generate"),
        ({"model": MODEL, "prompt": ""}, AUTH, 400, "empty"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, AUTH, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, AUTH, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "n": 65}, AUTH, 400, "n must be"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, AUTH, 400, "top_p"),
        ({"model": MODEL, "prompt": "hi"}, {"Authorization": "Bearer wrong"}, 401, "API key"),
        ({"model": MODEL, "prompt": "hi"}, {}, 401, "API key"),
        ({"model": MODEL, "prompt": "x" * 70000}, AUTH, 413, "exceeds"),
    ],
)
def test_invalid_requests_get_openai_errors(server, body, headers, status, needle):
    url, _ = server
    kw = (
        {"content": body, "headers": {**headers, "content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body, "headers": headers}
    )
    r = httpx.post(f"{url}/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and needle in err["message"]
    ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{url}/health").status_code == 200


def test_chat_errors_and_unknown_route(server):
    url, engine = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    tokenizer = engine.engine.tokenizer
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        r = httpx.post(
            f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, headers=AUTH
        )
    finally:
        tokenizer.chat_template = template
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    r = httpx.get(f"{url}/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_n_stop_and_usage(server):
    url, _ = server
    base = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{url}/v1/completions", json=base, headers=AUTH).json()["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    r = httpx.post(f"{url}/v1/completions", json={**base, "stop": stop}, headers=AUTH).json()
    assert r["choices"][0]["text"] == cut and r["choices"][0]["finish_reason"] == "stop"
    texts, _ = asyncio.run(_stream_once(url, {**base, "stop": stop, "stream": True}))
    assert texts[0] == cut  # streamed deltas never leak the start of the stop string

    texts, usage = asyncio.run(
        _stream_once(
            url,
            {**base, "n": 3, "temperature": 1.0, "seed": 1, "stream": True, "stream_options": {"include_usage": True}},
        )
    )
    assert sorted(texts) == [0, 1, 2] and usage["completion_tokens"] == 36


async def _stream_once(url: str, body: dict) -> tuple[dict[int, str], dict]:
    async with httpx.AsyncClient(headers=AUTH, timeout=60) as client:
        return await _stream(client, url, body)


def test_metrics_exposition(server):
    url, _ = server
    # one request of its own: the latency histograms have buckets once they observed one (alone or first in the run)
    ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, headers=AUTH)
    assert ok.status_code == 200
    text = httpx.get(f"{url}/metrics").text
    for name in (
        "sparseserve:num_requests_running",
        "sparseserve:num_requests_waiting",
        "sparseserve:kv_cache_blocks_used",
        "sparseserve:kv_cache_blocks_total",
        "sparseserve:time_to_first_token_seconds_bucket",
        "sparseserve:inter_token_latency_seconds_bucket",
        "sparseserve:e2e_request_latency_seconds_bucket",
        "sparseserve:prompt_tokens_total",
        "sparseserve:generation_tokens_total",
        "sparseserve:num_preemptions_total",
    ):
        assert name in text
    assert metrics(url)["sparseserve:kv_cache_blocks_total"] == 512


def test_shutdown_aborts_in_flight_requests():
    engine = AsyncLLMEngine(LLMEngine.from_kwargs(**ENGINE_KW))

    async def scenario():
        engine.start()
        stream = await engine.add_request("r0", "A very long story", SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        await engine.shutdown()
        with pytest.raises(RequestAborted):
            async for _ in stream:
                pass

    asyncio.run(scenario())
    assert engine.stats.num_blocks_used == 0 and not engine.engine.has_unfinished_requests()


def test_non_streamed_request_aborted_when_client_leaves(server):
    url, _ = server
    before = metrics(url)
    body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(5, read=0.15))
    after = wait_idle(url)
    assert after["sparseserve:generation_tokens_total"] - before["sparseserve:generation_tokens_total"] < 240


def test_serve_cli_flags_have_help_and_loopback_default():
    import argparse

    from sparseserve.entrypoints.api_server import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    flags = {s for a in parser._actions for s in a.option_strings}
    for flag in (
        "--host",
        "--port",
        "--max-model-len",
        "--gpu-memory-utilization",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--dtype",
        "--enforce-eager",
        "--served-model-name",
        "--api-key",
        "--seed",
    ):
        assert flag in flags
    assert all(a.help for a in parser._actions)
    args = parser.parse_args([])
    assert args.host == "127.0.0.1" and args.model is None


def test_failing_engine_step_fails_only_its_requests(server, monkeypatch):
    url, engine = server
    real_step = engine.engine.step

    def broken_step():
        monkeypatch.setattr(engine.engine, "step", real_step)  # fail once
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.engine, "step", broken_step)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, headers=AUTH, timeout=30)
    assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
    wait_idle(url)
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, headers=AUTH, timeout=30)
    assert ok.status_code == 200


@pytest.mark.slow
def test_a_chat_with_the_embedded_model_ends():
    """The README's first server example: `sparseserve serve` and a chat with no max_tokens. The embedded model
    knows no roles and rarely emits EOS outside its task format, so its generation_config.json's max_new_tokens
    is the default output length (as in vLLM), not the rest of its 65,536-token context."""
    with server_process("--num-gpu-blocks-override", "2048") as (_, url):  # max_model_len 65536
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=30, max_retries=0)
        r = client.chat.completions.create(model="sparseserve-default", messages=[{"role": "user", "content": "Hello"}])
        assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
        assert r.usage.completion_tokens <= 32
        r = client.chat.completions.create(
            model="sparseserve-default",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=40,
            extra_body={"ignore_eos": True},
        )
        assert r.usage.completion_tokens == 40  # the default only: a request's own max_tokens wins


def test_the_embedded_model_agrees_on_its_length():
    engine = LLMEngine.from_kwargs(device="cpu", num_gpu_blocks_override=2048)
    assert engine.tokenizer.model_max_length == engine.max_model_len == 65536
    from sparseserve.entrypoints.api_server import generation_max_new_tokens

    assert generation_max_new_tokens(None) == 32
