"""The README's first command path: the CLI on the embedded default model, and flags mirroring LLM kwargs."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from sparseserve.config import EngineConfig
from sparseserve.entrypoints.cli import build_parser, engine_kwargs_from_args


def test_every_engine_option_is_a_flag():
    args = build_parser([]).parse_args(
        [
            "generate",
            "some/model",
            "--max-num-seqs",
            "3",
            "--block-size",
            "16",
            "--enforce-eager",
            "--no-enable-chunked-prefill",
            "--dtype",
            "bfloat16",
        ]
    )
    kwargs = engine_kwargs_from_args(args)
    assert set(kwargs) == {f.name for f in EngineConfig.arg_fields()}
    cfg = EngineConfig.from_kwargs(**kwargs)
    assert cfg.model_config.model == "some/model" and cfg.model_config.dtype == "bfloat16"
    assert cfg.scheduler_config.max_num_seqs == 3 and not cfg.scheduler_config.enable_chunked_prefill
    assert cfg.cache_config.block_size == 16 and cfg.model_config.enforce_eager


@pytest.mark.slow
def test_generate_command_on_embedded_default():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparseserve",
            "generate",
            "--device",
            "cpu",
            "--max-tokens",
            "5",
            "--prompt",
            "Hello there",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "Output:" in out.stdout and "Hello there" in out.stdout


@pytest.mark.slow
def test_generate_command_reports_bad_input():
    out = subprocess.run(
        [sys.executable, "-m", "sparseserve", "generate", "/no/such/model", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "model directory not found" in out.stderr


def _parsers():
    """generate, serve and bench serve: the parsers whose help a user reads first."""
    from sparseserve.bench.serve import add_cli_args as bench_serve_args
    from sparseserve.entrypoints.api_server import add_cli_args as serve_args

    bench = argparse.ArgumentParser()
    bench_serve_args(bench)
    serve = argparse.ArgumentParser()
    serve_args(serve)
    generate = build_parser(["generate"])._subparsers._group_actions[0].choices["generate"]
    return {"generate": generate, "serve": serve, "bench serve": bench}


def test_every_flag_states_one_default():
    for name, parser in _parsers().items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.dest == "help" or action.help == argparse.SUPPRESS:  # removed options' flags
                continue
            text = formatter._expand_help(action)  # the help as printed, %(default)s filled in
            assert text.count("default") == 1, (name, action.option_strings or action.dest, text)
            assert "default: None" not in text, (name, action.option_strings, text)


def test_async_scheduling_flags_and_default():
    """--async-scheduling and --no-async-scheduling; neither: None, the engine's default for its device (on with
    KV offload on CUDA), which the help states."""
    for argv, want in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        args = build_parser([]).parse_args(["generate", "--kv-offload", "--sparse-policy", "topk", *argv])
        kw = engine_kwargs_from_args(args)
        assert kw["async_scheduling"] is want
        assert EngineConfig.from_kwargs(**kw).schedules_async("cuda") is (want is not False)
    generate = _parsers()["generate"]
    action = next(a for a in generate._actions if a.dest == "async_scheduling")
    assert action.option_strings == ["--async-scheduling", "--no-async-scheduling"]
    assert "default: on with kv_offload on a CUDA device" in generate._get_formatter()._expand_help(action)


def test_sizes_and_vllm_flag_names():
    args = build_parser([]).parse_args(
        [
            "generate",
            "--max-model-len",
            "32k",
            "--max-num-batched-tokens",
            "4K",
            "--kv-cache-memory-bytes",
            "2GiB",
            "--host-kv-memory",
            "1.5G",
        ]
    )
    kw = engine_kwargs_from_args(args)
    assert (kw["max_model_len"], kw["max_num_batched_tokens"]) == (32000, 4096)
    assert (kw["kv_cache_memory"], kw["host_kv_memory"]) == (2 * 2**30, 3 * 2**29)
    old = build_parser([]).parse_args(["generate", "--kv-cache-memory", "1000"])  # the old spelling still works
    assert engine_kwargs_from_args(old)["kv_cache_memory"] == 1000


def test_a_bad_size_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser([]).parse_args(["generate", "--max-model-len", "lots"])
    assert e.value.code == 2 and "invalid size 'lots'" in capsys.readouterr().err


def test_bench_serve_takes_vllm_names(tmp_path):
    from sparseserve.bench.serve import output_path

    bench = _parsers()["bench serve"]
    args = bench.parse_args(
        [
            "--random-input-len",
            "2k",
            "--random-output-len",
            "64",
            "--goodput",
            "ttft:500",
            "e2el:9000",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "r.json",
            "--save-detailed",
        ]
    )
    assert (args.input_len, args.output_len, args.save_details) == (2000, 64, True)
    assert dict(args.slo) == {"ttft": 500.0, "e2e": 9000.0}
    assert output_path(args) == tmp_path / "r.json"
    assert output_path(bench.parse_args([])) is None
    assert output_path(bench.parse_args(["--output-json", "x.json", "--save-result"])).name == "x.json"
