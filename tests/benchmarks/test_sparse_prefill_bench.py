"""The sparse prefill benchmarks run end to end on the CPU (the kernel benchmark under the Triton interpreter at a
tiny context; the end-to-end one on tiny models): their numbers matter on the GPU only."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks import sparse_prefill as bench


@pytest.mark.slow
def test_sparse_prefill_bench_rows(tmp_path):
    """On the CPU under the Triton interpreter (tests/conftest.py sets it only there); with CUDA on the GPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    parser = argparse.ArgumentParser()
    bench.add_cli_args(parser)
    out = tmp_path / "sp.json"
    bench.main(
        parser.parse_args(
            [
                "--device",
                device,
                "--dtype",
                "float32",
                "--contexts",
                "80",
                "--q-tile",
                "16",
                "--k-tile",
                "16",
                "--densities",
                "0.5",
                "--thresholds",
                "0.1",
                "--rounds",
                "2",
                "--output",
                str(out),
            ]
        )
    )
    (res,) = json.loads(out.read_text())["contexts"]
    kinds = [r["kind"] for r in res["rows"]]
    assert kinds == [
        "dense_triton",
        "sdpa_flash",
        "quantize",
        "select_tiles",
        "select",
        "attn@0.5",
        "select+attn@0.5",
        "sale@0.1",
        "streaming/2@0.1",
    ]
    assert res["rel_err_sparse_all_vs_dense"] < 1e-5
    rows = {r["kind"]: r for r in res["rows"]}
    assert 0 < rows["attn@0.5"]["tile_fraction"] < 1 and rows["sale@0.1"]["tile_fraction"] <= 1
    assert rows["streaming/2@0.1"]["tile_fraction"] < rows["sale@0.1"]["tile_fraction"]
    assert all(r["ms"] > 0 for r in res["rows"] if r["kind"] != "sdpa_flash")


def _e2e(argv: list[str]) -> dict:
    from benchmarks import sparse_prefill_e2e as e2e

    parser = argparse.ArgumentParser()
    e2e.add_cli_args(parser)
    return e2e.main(parser.parse_args(argv))


def test_e2e_ttft_rows(tiny_model_dir, tmp_path):
    """The TTFT mode on the CPU (tiny model, 450 tokens): every variant timed in every repeat; threshold 0 computes
    every tile, a large threshold fewer."""
    out = tmp_path / "ttft.json"
    res = _e2e(
        [
            "ttft",
            str(tiny_model_dir),
            "--context",
            "450",
            "--thresholds",
            "0",
            "1.0",
            "--min-len",
            "0",
            "--repeats",
            "1",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--engine-arg",
            "block_size=16",
            "--engine-arg",
            "max_num_batched_tokens=200",
            "--output",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["variants"]
    assert list(rows) == ["dense", "sale@0", "sale@1"] and res["prompt_tokens"] == 449
    assert all(len(r["ttft_s"]) == 1 and r["median_s"] > 0 for r in rows.values())
    assert rows["dense"]["tile_fraction"] == rows["sale@0"]["tile_fraction"] == 1.0
    assert rows["sale@1"]["tile_fraction"] < 1.0


def test_e2e_accuracy_curve(tmp_path):
    """The accuracy mode on the CPU (embedded model, one passkey sample of 320 tokens): threshold 0 gives dense's
    outputs at every tile; the calibration-file variant runs from its file."""
    from sparseserve.workloads import tasks as T

    try:
        T.find_haystack_dir()
    except FileNotFoundError:
        pytest.skip("essay haystack (../shared/data/haystack) not found")
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"sparse_prefill_thresholds": [[0.5] * 8] * 6}))
    res = _e2e(
        [
            "accuracy",
            "--lengths",
            "320",
            "--num-samples",
            "1",
            "--tasks",
            "passkey",
            "--thresholds",
            "0",
            "--calibration",
            str(cal),
            "--min-len",
            "0",
            "--device",
            "cpu",
            "--quiet",
            "--output",
            str(tmp_path / "acc.json"),
        ]
    )
    curve = res["curve"]
    assert list(curve) == ["dense", "sale@0", "sale:cal.json"]
    assert curve["sale@0"]["equal_to_dense"] == 1 and curve["sale@0"]["tile_fraction"] == 1.0
    assert curve["sale:cal.json"]["tile_fraction"] < 1.0
    assert set(res["accuracy"]["dense"]) == {"passkey"}
