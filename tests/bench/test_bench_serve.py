"""`sparseserve bench serve` against the in-process server; prompt building from the haystack."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from sparseserve.bench import serve as bench_serve
from sparseserve.workloads.datasets import PromptBuilder, data_dir, haystack_text, load_trace
from sparseserve.engine.async_engine import AsyncLLMEngine
from sparseserve.engine.engine import LLMEngine
from sparseserve.entrypoints.api_server import ServerConfig, build_app
from sparseserve.metrics import parse_metrics
from sparseserve.models.loader import DEFAULT_MODEL_DIR
from tests.server_utils import serve_in_thread

pytestmark = pytest.mark.skipif(
    not (data_dir() / "haystack").is_dir(), reason=f"benchmark data not found at {data_dir()} (../shared/data)"
)
TRACE = data_dir() / "traces" / "mooncake_conversation.jsonl"
COUNTERS = (
    "sparseserve:request_success_total",
    "sparseserve:prompt_tokens_total",
    "sparseserve:generation_tokens_total",
    "sparseserve:prefix_cache_hits_total",
)


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLMEngine(LLMEngine.from_kwargs(device="cpu", max_model_len=1024, num_gpu_blocks_override=512))
    with serve_in_thread(build_app(engine, ServerConfig(served_model_names=("tiny",), api_key="k"))) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def counters(url: str) -> dict[str, float]:
    m = parse_metrics(httpx.get(f"{url}/metrics").text)
    return {k: m.get(k, 0.0) for k in COUNTERS}


def run_bench(url: str, tmp_path, *extra: str) -> dict:
    parser = argparse.ArgumentParser()
    bench_serve.add_cli_args(parser)
    args = parser.parse_args(["--base-url", url, "--api-key", "k", "--output-json", str(tmp_path / "out.json"), *extra])
    return bench_serve.main(args)


def test_haystack_prompts_have_exact_lengths_and_shared_prefixes(tokenizer):
    for n in (1, 17, 512, 2000):
        text = haystack_text(tokenizer, n, seed=n)
        assert len(tokenizer.encode(text, add_special_tokens=False)) == n
    assert haystack_text(tokenizer, 100, seed=3) == haystack_text(tokenizer, 100, seed=3)
    builder = PromptBuilder(tokenizer)
    a = builder.trace_prompt([7, 8, 9], 1400, seed=0)
    b = builder.trace_prompt([7, 8, 11], 1300, seed=0)
    assert len(tokenizer.encode(a)) == 1400  # as the server counts it, BOS included
    block = builder.trace_prompt([7, 8], 1024, seed=0)
    assert a.startswith(block[:-20]) and b.startswith(block[:-20])  # same hash ids -> same text blocks


@pytest.mark.slow
def test_poisson_rates_agree_with_server_metrics(server, tmp_path):
    before = counters(server)
    report = run_bench(
        server,
        tmp_path,
        "--tokenizer",
        str(DEFAULT_MODEL_DIR),
        "--request-rate",
        "20",
        "inf",
        "--num-prompts",
        "6",
        "--input-len",
        "48",
        "--output-len",
        "5",
        "--slo",
        "ttft:60000",
    )
    after = counters(server)
    runs = report["runs"]
    assert [r["completed"] for r in runs] == [6, 6] and all(r["failed"] == 0 for r in runs)
    assert all(r["total_input_tokens"] == 6 * 48 and r["total_output_tokens"] == 6 * 5 for r in runs)
    assert after["sparseserve:request_success_total"] - before["sparseserve:request_success_total"] == 12
    # the two runs send the same prompts: prompt tokens are computed, or served by the prefix cache
    computed = after["sparseserve:prompt_tokens_total"] - before["sparseserve:prompt_tokens_total"]
    cached = after["sparseserve:prefix_cache_hits_total"] - before["sparseserve:prefix_cache_hits_total"]
    assert computed + cached == 12 * 48 and cached > 0
    assert after["sparseserve:generation_tokens_total"] - before["sparseserve:generation_tokens_total"] == 12 * 5
    for r in runs:
        assert r["goodput"] == pytest.approx(r["request_throughput"])
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
        assert r["tpot_ms"]["mean"] > 0 and r["itl_ms"]["mean"] > 0
    assert json.loads((tmp_path / "out.json").read_text())["runs"][0]["request_rate"] == 20
    assert (tmp_path / "out.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake trace not found")
def test_trace_replay_without_tokenizer(server, tmp_path):
    """No tokenizer: prompt lengths are calibrated from the server's usage, so only roughly right."""
    trace = load_trace(TRACE, 4, time_scale=0.001, max_input_len=600, max_output_len=4)
    before = counters(server)
    report = run_bench(
        server,
        tmp_path,
        "--trace",
        str(TRACE),
        "--num-prompts",
        "4",
        "--trace-time-scale",
        "0.001",
        "--max-input-len",
        "600",
        "--max-output-len",
        "4",
        "--endpoint",
        "/v1/chat/completions",
    )
    run = report["runs"][0]
    assert run["completed"] == 4 and run["total_output_tokens"] == sum(t.output_length for t in trace)
    after = counters(server)
    # the calibration probe is one more request, with one output token
    assert after["sparseserve:request_success_total"] - before["sparseserve:request_success_total"] == 4 + 1
    assert (
        after["sparseserve:generation_tokens_total"] - before["sparseserve:generation_tokens_total"]
        == run["total_output_tokens"] + 1
    )
    expected = sum(t.input_length for t in trace)
    assert 0.7 * expected < run["total_input_tokens"] < 1.3 * expected + 4 * 30  # + chat template tokens
