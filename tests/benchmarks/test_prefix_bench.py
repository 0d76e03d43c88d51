"""Smoke test of the prefix-caching benchmark (benchmarks/prefix.py) on CPU with a tiny model and tiny sizes: every
workload and configuration runs, the rows hold what the GPU run reports, and the numbers are consistent (no
cache: every prompt token computed at least once; the repeated trace prefixes hit with caching on)."""

from __future__ import annotations

import json

import pytest

from benchmarks import prefix
from sparseserve.workloads.datasets import data_dir

TRACE = data_dir() / "traces" / "mooncake_conversation.jsonl"


@pytest.mark.skipif(not TRACE.exists(), reason=f"Mooncake trace not found at {TRACE} (../shared/data)")
def test_prefix_bench_smoke(tiny_model_dir, tmp_path):
    out = tmp_path / "prefix.json"
    report = prefix.main(
        [
            "--model",
            str(tiny_model_dir),
            "--device",
            "cpu",
            "--num-gpu-blocks",
            "16",
            "--num-requests",
            "5",
            "--time-scale",
            "0",
            "--max-input-len",
            "300",
            "--max-output-len",
            "4",
            "--long-requests",
            "3",
            "--long-input",
            "160",
            "--long-output",
            "40",
            "--hitrate-requests",
            "8",
            "--hitrate-time-scale",
            "0",
            "--hitrate-max-input-len",
            "300",
            "--hitrate-max-output-len",
            "2",
            "--host-cache-gb",
            "0.01",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["long"] == report["long"]
    for workload in ("conversation", "long"):
        rows = {r["config"]: r for r in report[workload]}
        assert list(rows) == ["baseline", "admission", "cached"]
        for r in rows.values():
            assert r["requests"] > 0 and r["mean_ttft_s"] > 0 and r["output_tok_s"] > 0
        assert rows["baseline"]["computed_per_prompt"] >= 1.0 and rows["baseline"]["hit_rate"] == 0
    # 3 x (160 + 40) tokens in 16 blocks of 32: the baseline admits all three and preempts
    assert report["long"][0]["preemptions"] > 0
    # the trace's first requests share their first 512-token block
    assert {r["config"]: r for r in report["conversation"]}["cached"]["hit_rate"] > 0
    none, device, host = report["hitrate"]
    assert none["hit_rate"] == 0 and device["hit_rate"] > 0 and "ttft_gain" in host
    assert device["computed_per_prompt"] < 1
