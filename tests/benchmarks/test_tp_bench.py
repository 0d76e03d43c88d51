"""scripts/tp_bench.py on CPU ranks (gloo), what gpu_tp_check.sh runs on GPUs: every mode's rows against TP=1 in
one process, float32 parity exact, the host store per rank doubling what TP=2 admits, and the serving report's
ratios against TP=1 and dense of the same load."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import VARIANTS, make_hf_model

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("tp_bench", ROOT / "scripts" / "tp_bench.py")
tp_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tp_bench)


@pytest.fixture(scope="module")
def model4(tmp_path_factory) -> Path:
    """The 2-KV-head tiny Llama with 4 layers (KV offload keeps sparse_dense_layers=2 of them dense)."""
    path = tmp_path_factory.mktemp("tiny4")
    cls, overrides = VARIANTS["llama3-gqa-d128-tied-rope"]
    make_hf_model(path, cls, num_hidden_layers=4, **overrides)
    return path


def bench(*argv: str) -> list[dict]:
    return tp_bench.main([*argv, "--device", "cpu"])


def test_compare_reports_the_gap_at_each_divergence():
    """A flip where the reference's two best tokens are 1e-6 apart is a near tie: `divergence_gap_max` says so."""
    from types import SimpleNamespace as NS

    def out(tokens: list[int], tops: list[dict[int, float]]):
        return NS(token_ids=tokens, logprobs=[{t: NS(logprob=v) for t, v in top.items()} for top in tops])

    tie = {5: -0.693146, 6: -0.693147, 7: -3.0}
    ref = [out([1, 5], [{1: -0.1, 2: -2.0}, tie]), out([3, 4], [{3: -0.2, 4: -1.0}, {4: -0.1, 9: -2.5}])]
    got = [out([1, 6], [{1: -0.1, 2: -2.0}, tie]), out([3, 4], [{3: -0.2, 4: -1.0}, {4: -0.1, 9: -2.5}])]
    row = tp_bench.compare(ref, got)
    assert row["identical_seqs"] == "1/2" and row["first_divergence_min"] == 1
    assert row["divergence_gap_max"] == pytest.approx(1e-6, abs=1e-9)
    assert tp_bench.compare(ref, ref)["divergence_gap_max"] is None  # nothing diverged


@pytest.mark.slow
def test_parity_float32_equal_and_bf16_beside_the_spread(model4, tmp_path):
    out = tmp_path / "parity.json"
    rows = bench(
        "parity", str(model4), "--dtypes", "float32", "bfloat16", "--num-prompts", "3", "--prompt-len", "40",
        "--max-tokens", "8", "--json", str(out),
    )  # fmt: skip
    assert [(r["dtype"], r["compare"][:4]) for r in rows] == [
        ("float32", "TP=1"),
        ("float32", "TP=2"),
        ("bfloat16", "TP=1"),
        ("bfloat16", "TP=2"),
    ]
    tp2 = rows[1]
    assert tp2["tokens_equal"] and tp2["first_divergence_min"] == 8  # all 8 tokens compared
    assert tp2["max_dlogprob_topk"] < 1e-4 and tp2["same_topk_share"] == 1.0
    assert 0 < rows[3]["max_dlogprob_topk"] < 0.5  # bf16: rounding moves the logprobs a little
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))


@pytest.mark.slow
def test_step_rows_for_each_tp_against_tp1(model4):
    rows = bench("step", str(model4), "--tp", "2", "--batch", "3", "--context", "48", "--steps", "7")
    assert [(r["mode"], r["tp"]) for r in rows] == [("sync", 1), ("sync", 2), ("async", 1), ("async", 2)]
    assert all(r["steps"] == 4 for r in rows)  # 7 pure decode steps of the whole batch, the first 3 warm up
    for tp1, tp2 in (rows[:2], rows[2:]):  # each mode against its own TP=1
        assert tp1["vs TP=1"] == 1 and tp2["vs TP=1"] == tp2["step_ms_median"] / tp1["step_ms_median"]


@pytest.mark.slow
def test_capacity_doubles_with_the_host_store_per_rank(model4):
    # 4 layers x 2 KV heads x 128 x K,V x fp32 = 8 KiB a token at TP=1: about 2 windows of 576 tokens (prompt +
    # output) in 10 MiB, and every rank of TP=2 holds half the KV heads in its own 10 MiB
    rows = bench(
        "capacity", str(model4), "--tp", "2", "--dtype", "float32", "--context", "576", "--output-len", "64",
        "--sparse-budget", "256", "--host-kv-gb", str(10 * 2**20 / 1e9), "--requests-tp1", "4", "--plateau", "6",
        "--reuse", "1",
    )  # fmt: skip
    assert [(r["tp"], r["requests"]) for r in rows] == [(1, 4), (2, 8)]
    assert not rows[0]["all_admitted"] and rows[0]["max_running"] >= 1
    assert rows[1]["max_running"] == 2 * rows[0]["max_running"] and rows[1]["running vs TP=1"] == 2
    assert rows[1]["host_blocks"] == 2 * rows[0]["host_blocks"]


def _run(folder: Path, tag: str, tok_s: float, ttft_ms: float, tpot_ms: float) -> None:
    stats = lambda mean: {"mean": mean, "p50": mean, "p90": mean, "p99": 2 * mean}  # noqa: E731
    summary = {
        "completed": 4,
        "failed": 0,
        "output_throughput": tok_s,
        "total_input_tokens": 1000,
        "ttft_ms": stats(ttft_ms),
        "tpot_ms": stats(tpot_ms),
        "e2e_ms": stats(ttft_ms + 1000),
        "goodput": 1.0,
    }
    (folder / f"serve_{tag}.json").write_text(json.dumps({"runs": [summary]}))
    (folder / f"metrics_{tag}.txt").write_text('sparseserve:num_preemptions_total{model_name="m"} 3.0\n')


def test_serve_report_ratios_against_tp1_and_dense(tmp_path, capsys):
    _run(tmp_path, "dense_rate1_lbmax", 100.0, 4000.0, 40.0)
    _run(tmp_path, "dense_tp2_rate1_lbmax", 150.0, 2000.0, 25.0)
    _run(tmp_path, "ws_rate1_lbmax", 120.0, 3000.0, 50.0)
    _run(tmp_path, "ws_tp2_rate1_lbmax", 240.0, 1000.0, 30.0)
    _run(tmp_path, "ws_tp4_rate2_lbmax", 300.0, 1000.0, 30.0)  # another load, no TP=1: no ratio
    rows = {(r["config"], r["tp"], r["load"]): r for r in tp_bench.serve_rows(tmp_path)}
    assert set(rows) == {("dense", 1, "rate1"), ("dense", 2, "rate1"), ("ws", 1, "rate1"), ("ws", 2, "rate1"),
                         ("ws", 4, "rate2")}  # fmt: skip
    r = rows["ws", 2, "rate1"]
    assert r["x TP=1"] == 2.0 and r["TTFT / TP=1"] == 1 / 3 and r["TPOT / TP=1"] == 0.6
    assert r["x dense"] == 240.0 / 150.0 and rows["ws", 1, "rate1"]["x dense"] == 1.2
    assert r["preempt"] == 3.0 and r["p99 TTFT s"] == 2.0
    assert rows["ws", 4, "rate2"]["x TP=1"] is None and rows["ws", 4, "rate2"]["x dense"] is None
    tp_bench.main(["serve-report", str(tmp_path), "--json", str(tmp_path / "tp_serve.json")])
    assert "x TP=1" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "tp_serve.json").read_text())["rows"]) == 5
    with pytest.raises(SystemExit, match="no serve_"):
        tp_bench.main(["serve-report", str(tmp_path / "nothing")])


def test_message_rows_whole_tables_against_a_steady_step():
    """`message`: rank 0's step message over a 2-process gloo group, whole block tables (32 KB: past
    TPGroup.broadcast_object's one-broadcast buffer) against the entries a steady decode step adds (none here),
    each through the engine's broadcast and through broadcast_object_list; every rank checks what it got."""
    rows = bench("message", "--tp", "2", "--batch", "4", "--context", "32768", "--block-size", "16")
    assert [(r["tp"], r["message"], r["sender"]) for r in rows] == [
        (2, kind, sender)
        for kind in ("whole tables", "steady decode")
        for sender in ("TPGroup.broadcast_object", "broadcast_object_list")
    ]
    whole, steady = rows[0]["bytes"], rows[2]["bytes"]
    assert whole > 4 * 2048 * 4 > 16384 > 20 * steady and all(r["broadcast_ms"] > 0 for r in rows)
