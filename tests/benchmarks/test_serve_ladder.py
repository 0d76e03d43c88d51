"""The serving ladder report (benchmarks/serve_ladder.py) and bench serve's decode-heavy trace replay."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import serve_ladder
from benchmarks.serve_ladder import (
    ModelShape,
    ideal_cached_tokens,
    ladder_rows,
    load_runs,
    mean_ttft_bound,
    workload_bound,
)
from sparseserve.bench import serve
from sparseserve.workloads.datasets import TraceRequest

SHAPE = ModelShape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)
HW = {"hbm_bytes_per_s": 1e3, "matmul_flops": 1e6}


def test_ideal_cached_tokens_follow_shared_hash_prefixes():
    trace = [
        TraceRequest(0.0, 1536, 4, (1, 2, 3)),
        TraceRequest(0.0, 1536, 4, (1, 2, 9)),
        TraceRequest(0.0, 1536, 4, (1, 2, 3)),
        TraceRequest(0.0, 700, 4, (7, 8)),
    ]
    # the second shares two blocks; the third all three but recomputes its last token; a partial last
    # block (700 = 512 + 188) is never cached for later requests
    assert ideal_cached_tokens(trace) == [0, 1024, 1535, 0]
    assert ideal_cached_tokens(trace + [TraceRequest(0.0, 1024, 4, (7, 8))]) == [0, 1024, 1535, 0, 512]


def test_mean_ttft_bound_serves_shortest_remaining_first():
    assert mean_ttft_bound([0.0, 0.0], [3.0, 1.0]) == 2.5  # 1 s job first: done at 1 and 4
    # a short job arriving while a long one runs goes first: done at 2 (1 s after it came) and 6
    assert mean_ttft_bound([0.0, 1.0], [5.0, 1.0]) == 3.5
    assert mean_ttft_bound([0.0, 10.0], [1.0, 2.0]) == 1.5  # idle between them


def test_workload_bound_by_hand():
    trace = [TraceRequest(0.0, 10, 2, ()), TraceRequest(0.5, 20, 1, ())]
    params = 2 * (8 * 4 * (2 * 2 + 2 * 1) + 3 * 8 * 16) + 8 * 10
    assert SHAPE.matmul_params == params
    flops = sum(2 * params * n + 4 * 2 * 2 * 4 * n * (n / 2) for n in (10, 20))
    kv = 2 * 2 * 1 * 4 * 2  # bytes per token: K and V, layers, KV heads, head_dim, bf16
    # step 0 decodes both (contexts 10 and 20), step 1 only the first (11 tokens); a cap of 8 reads 8 + 8, then 8
    dense = workload_bound(trace, SHAPE, HW, 0.5, None)
    capped = workload_bound(trace, SHAPE, HW, 0.5, 8)
    assert dense["prefill_s"] == pytest.approx(flops / 0.5e6)
    assert dense["decode_s"] == pytest.approx((2 * params * 2 + (30 + 11) * kv) / 1e3)
    assert capped["decode_s"] == pytest.approx((2 * params * 2 + (16 + 8) * kv) / 1e3)
    assert dense["output_throughput"] == pytest.approx(3 / dense["total_s"])
    late = [TraceRequest(0.0, 10, 2, ()), TraceRequest(1e6, 20, 1, ())]
    assert workload_bound(late, SHAPE, HW, 0.5, None)["total_s"] == 1e6  # never before the last arrival


def _run(
    folder: Path,
    tag: str,
    tok_s: float,
    ttft_ms: float,
    goodput: float,
    metrics: str = "",
    workload: list | None = None,
) -> None:
    stats = lambda mean: {"mean": mean, "p50": mean, "p90": mean, "p99": 2 * mean}  # noqa: E731
    summary = {
        "completed": 4,
        "failed": 0,
        "output_throughput": tok_s,
        "total_input_tokens": 1000,
        "ttft_ms": stats(ttft_ms),
        "tpot_ms": stats(20.0),
        "e2e_ms": stats(ttft_ms + 1000),
        "goodput": goodput,
    }
    if workload is not None:
        summary["workload"] = workload
    (folder / f"serve_{tag}.json").write_text(json.dumps({"runs": [summary]}))
    (folder / f"metrics_{tag}.txt").write_text(metrics + 'sparseserve:prompt_tokens_total{model_name="m"} 500.0\n')


def test_ladder_rows_ratios_against_dense_of_the_same_group(tmp_path):
    offload = (
        'sparseserve:offload_hbm_hits_total{model_name="m"} 90.0\n'
        'sparseserve:offload_head_blocks_loaded_total{model_name="m"} 10.0\n'
        'sparseserve:working_set_hold_backs_total{model_name="m"} 3.0\n'
        'sparseserve:working_set_prefill_aheads_total{model_name="m"} 2.0\n'
    )
    _run(tmp_path, "dense_ts1_out512", 100.0, 8000.0, 0.5)
    _run(tmp_path, "layerseg_ts1_out512", 300.0, 1000.0, 2.0, offload)
    _run(tmp_path, "offload_ts1_out512", 200.0, 2000.0, 1.0, offload)
    _run(tmp_path, "dense_ts1_fix2048", 50.0, 4000.0, 0.25)
    _run(tmp_path, "ws_ts1_fix2048", 150.0, 4000.0, 0.5, offload)
    (tmp_path / "serve_notes.json").write_text("{}")  # not a result: ignored
    runs = load_runs(tmp_path)
    assert len(runs) == 5
    rows = ladder_rows(runs, {"dense": 200.0, "sparse": 400.0})
    assert [(r["outputs"], r["config"]) for r in rows] == [
        ("out512", "dense"),
        ("out512", "offload"),
        ("out512", "layerseg"),
        ("fix2048", "dense"),
        ("fix2048", "ws"),
    ]
    by = {(r["outputs"], r["config"]): r for r in rows}
    lay = by["out512", "layerseg"]
    assert lay["x dense"] == 3.0 and lay["step gain"] == 1.5 and lay["TTFT x lower"] == 8.0
    assert lay["goodput x dense"] == 4.0 and lay["hit ratio"] == 0.9 and lay["hold-backs"] == 3.0
    assert lay["prefills ahead"] == 2.0
    assert lay["computed/prompt"] == 0.5 and lay["of bound"] == 300.0 / 400.0
    assert by["out512", "dense"]["of bound"] == 0.5 and by["out512", "dense"]["hit ratio"] is None
    assert by["fix2048", "ws"]["x dense"] == 3.0 and by["fix2048", "dense"]["step gain"] is None


def test_trace_output_len_overrides_every_request(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 7 + i, "hash_ids": [i, 100 + i]})
            + "\n"
            for i in range(3)
        )
    )
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    # the prompt text is the builder's business (tests/bench/test_bench_serve.py, with the essays)
    builder = SimpleNamespace(trace_prompt=lambda hash_ids, n, seed: f"{hash_ids}:{n}:{seed}")
    capped = serve._specs(parser.parse_args(["--trace", str(trace), "--max-output-len", "8"]), builder, None)
    fixed = serve._specs(parser.parse_args(["--trace", str(trace), "--trace-output-len", "2K"]), builder, None)
    assert [s.output_len for s in capped] == [7, 8, 8] and [s.output_len for s in fixed] == [2048] * 3
    assert [s.prompt for s in fixed] == [f"[{i}, {100 + i}]:600:0" for i in range(3)]  # the trace's prompts
    assert [s.arrival_s for s in fixed] == [0.0, 1.0, 2.0]


def _config(folder: Path) -> None:
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "num_hidden_layers": 2,
                "hidden_size": 8,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "intermediate_size": 16,
                "vocab_size": 10,
                "rms_norm_eps": 1e-5,
            }
        )
    )


def test_main_writes_the_report(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": 500 * i, "input_length": 100, "output_length": 4, "hash_ids": [i]}) + "\n"
            for i in range(4)
        )
    )
    _config(tmp_path)
    _run(tmp_path, "dense_ts1_out4", 10.0, 100.0, 1.0)
    _run(tmp_path, "sparse_ts1_out4", 12.0, 90.0, 1.0)
    _run(tmp_path, "dense_ts2_out4", 8.0, 50.0, 1.0)
    assert ModelShape.from_model_dir(tmp_path) == SHAPE
    report = serve_ladder.main([str(tmp_path), "--trace", str(trace), "--model", str(tmp_path), "--num-prompts", "4"])
    assert set(report["tables"]) == {"out4_ts1", "out4_ts2"}
    assert report["tables"]["out4_ts1"][1]["x dense"] == pytest.approx(1.2)
    assert json.loads((tmp_path / "ladder.json").read_text())["bounds"]["out4_ts2"]["dense"]["total_s"] >= 3.0
    assert (tmp_path / "ladder.png").stat().st_size > 0
    assert "time scale 2" in capsys.readouterr().out


def test_longbench_runs_get_their_bound_from_the_requests_they_asked(tmp_path, capsys):
    """Poisson runs of LongBench's mix (rate loads): grouped by rate, ratios against dense, the bound from the
    recorded requests (no trace needed); a trace run without --trace gets its table without a bound."""
    _config(tmp_path)
    asked = {1: [[0.0, 300, 128], [1.0, 200, 64]], 2: [[0.0, 300, 128], [0.5, 200, 64]]}
    for rate in (1, 2):
        _run(tmp_path, f"dense_rate{rate}_lbmax", 10.0 * rate, 100.0, 1.0, workload=asked[rate])
        _run(tmp_path, f"layerseg_rate{rate}_lbmax", 15.0 * rate, 50.0, 1.0, workload=asked[rate])
    _run(tmp_path, "dense_rate0.5_fix1024", 5.0, 100.0, 1.0, workload=[[0.0, 300, 1024]])
    _run(tmp_path, "dense_rateinf_fix1024", 6.0, 100.0, 1.0, workload=[[0.0, 300, 1024]])
    _run(tmp_path, "dense_ts1_out4", 10.0, 100.0, 1.0)
    runs = load_runs(tmp_path)
    assert {(r["load"], r["outputs"], r["rate"]) for r in runs if r["config"] == "dense"} == {
        ("rate1", "lbmax", 1.0),
        ("rate2", "lbmax", 2.0),
        ("rate0.5", "fix1024", 0.5),
        ("rateinf", "fix1024", math.inf),
        ("ts1", "out4", None),
    }
    report = serve_ladder.main([str(tmp_path), "--model", str(tmp_path)])
    assert set(report["tables"]) == {"out4_ts1", "fix1024_rate0.5", "fix1024_rateinf", "lbmax_rate1", "lbmax_rate2"}
    assert set(report["bounds"]) == {"fix1024_rate0.5", "fix1024_rateinf", "lbmax_rate1", "lbmax_rate2"}
    assert report["tables"]["lbmax_rate2"][1]["x dense"] == pytest.approx(1.5)
    want = workload_bound(
        [TraceRequest(0.0, 300, 128, ()), TraceRequest(0.5, 200, 64, ())],
        SHAPE,
        serve_ladder.DEFAULT_HARDWARE,
        serve_ladder.DEFAULT_PREFILL_MFU,
        None,
    )
    assert report["bounds"]["lbmax_rate2"]["dense"] == pytest.approx(want)
    assert "of bound" in report["tables"]["lbmax_rate1"][0] and "of bound" not in report["tables"]["out4_ts1"][0]
    printed = capsys.readouterr().out
    assert "LongBench output caps, Poisson 2 req/s: bound" in printed and "outputs = 1024, Poisson 0.5" in printed
    assert "outputs <= 4, time scale 1: no bound" in printed and "outputs = 1024, all at once: bound" in printed
    assert (tmp_path / "ladder.png").stat().st_size > 0
