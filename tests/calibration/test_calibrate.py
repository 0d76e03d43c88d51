"""Streaming-head calibration on task prompts of either suite, and its refusal of prompts beyond the model's
context (SmolLM2: 8192 tokens) with the length that fits."""

from __future__ import annotations

import argparse
import json

import pytest

from sparseserve.workloads import tasks as T
from sparseserve.calibration import cli as calibrate


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    calibrate.add_cli_args(p)
    return p.parse_args(argv)


def test_completion_suite_prompts(tmp_path):
    try:
        T.find_haystack_dir()
    except FileNotFoundError:
        pytest.skip("essay haystack (../shared/data/haystack) not found")
    out = tmp_path / "heads.json"
    res = calibrate.main(
        _args(
            [
                "--suite",
                "completion",
                "--lengths",
                "400",
                "--num-samples",
                "1",
                "--decode-steps",
                "2",
                "--threshold",
                "0",
                "--device",
                "cpu",
                "--out",
                str(out),
            ]
        )
    )
    data = json.loads(out.read_text())
    assert data["num_prompts"] == 3  # the completion suite's three calibration tasks, one prompt each
    assert data["streaming_heads"] == res["streaming_heads"] and res["streaming_heads"]
    assert all(int(layer) >= 2 for layer in res["streaming_heads"])  # the dense layers are never proposed
    masses = [m for layer in data["sink_local_mass"].values() for m in layer["min"]]
    assert all(0.0 < m <= 1.0 + 1e-6 for m in masses)


def test_prompts_beyond_the_context_are_refused(tiny_model_dir, tmp_path):
    # The tiny model's context is 1024 tokens: 1020 + 8 decode steps + 8 do not fit, 1008 does.
    with pytest.raises(ValueError, match="use --lengths 1008 or less"):
        calibrate.main(
            _args(
                [
                    str(tiny_model_dir),
                    "--random-prompts",
                    "--lengths",
                    "1020",
                    "--device",
                    "cpu",
                    "--out",
                    str(tmp_path / "h.json"),
                ]
            )
        )


def test_the_cli_command_runs_the_calibration(tiny_model_dir, tmp_path):
    from sparseserve.entrypoints.cli import build_parser

    argv = [
        "calibrate",
        str(tiny_model_dir),
        "--prefill",
        "--random-prompts",
        "--lengths",
        "1020",
        "--out",
        str(tmp_path / "p.json"),
    ]
    args = build_parser(argv).parse_args(argv)
    assert args.func is calibrate.main and args.prefill and args.error_bound == 0.02
    argv = ["calibrate", str(tiny_model_dir), "--random-prompts", "--lengths", "1020", "--out", str(tmp_path / "h")]
    args = build_parser(argv).parse_args(argv)
    with pytest.raises(ValueError, match="use --lengths 1008 or less"):
        args.func(args)
