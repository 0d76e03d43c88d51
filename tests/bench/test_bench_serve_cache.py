"""`sparseserve bench serve` trace replay against the in-process server: the trace's shared prefixes reach the
prefix cache (equal hash ids -> equal token ids), and the report's hit rate is the /metrics counters' delta."""

from __future__ import annotations

import argparse

import httpx
import pytest

from sparseserve.bench import serve as bench_serve
from sparseserve.workloads.datasets import data_dir
from sparseserve.engine.async_engine import AsyncLLMEngine
from sparseserve.engine.engine import LLMEngine
from sparseserve.entrypoints.api_server import ServerConfig, build_app
from sparseserve.metrics import parse_metrics
from sparseserve.models.loader import DEFAULT_MODEL_DIR
from tests.server_utils import serve_in_thread

TRACE = data_dir() / "traces" / "mooncake_conversation.jsonl"
pytestmark = pytest.mark.skipif(
    not TRACE.exists() or not (data_dir() / "haystack").is_dir(),
    reason=f"benchmark data not found at {data_dir()} (../shared/data)",
)


def test_trace_replay_reports_the_prefix_cache_hit_rate(tmp_path):
    engine = AsyncLLMEngine(LLMEngine.from_kwargs(device="cpu", max_model_len=1100, num_gpu_blocks_override=256))
    with serve_in_thread(build_app(engine, ServerConfig(served_model_names=("tiny",)))) as url:
        before = parse_metrics(httpx.get(f"{url}/metrics").text)
        parser = argparse.ArgumentParser()
        bench_serve.add_cli_args(parser)
        # the first requests all start with hash id 0: 1,024-token prompts share their first 512 tokens (+ BOS)
        args = parser.parse_args(
            [
                "--base-url",
                url,
                "--trace",
                str(TRACE),
                "--num-prompts",
                "4",
                "--trace-time-scale",
                "0",
                "--max-input-len",
                "1024",
                "--max-output-len",
                "2",
                "--tokenizer",
                str(DEFAULT_MODEL_DIR),
                "--max-concurrency",
                "1",
            ]
        )
        report = bench_serve.main(args)
        after = parse_metrics(httpx.get(f"{url}/metrics").text)
    cache = report["runs"][0]["prefix_cache"]
    queries = after["sparseserve:prefix_cache_queries_total"] - before["sparseserve:prefix_cache_queries_total"]
    hits = after["sparseserve:prefix_cache_hits_total"] - before["sparseserve:prefix_cache_hits_total"]
    assert cache["queries"] == queries == 4 * 1024 and cache["hits"] == hits
    # one at a time: requests 2-4 each find BOS + block 0 (513 tokens: 16 full blocks of 32)
    assert hits == 3 * 512 and cache["hit_rate"] == pytest.approx(hits / queries)
