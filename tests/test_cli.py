"""The README's first command path: the CLI on the embedded default model, and flags mirroring LLM kwargs."""
from __future__ import annotations

import subprocess
import sys

from sparseserve.config import EngineConfig
from sparseserve.entrypoints.cli import build_parser, engine_kwargs_from_args


def test_every_engine_option_is_a_flag():
    args = build_parser([]).parse_args(["generate", "some/model", "--max-num-seqs", "3", "--block-size", "16",
                                      "--enforce-eager", "--no-enable-chunked-prefill", "--dtype", "bfloat16"])
    kwargs = engine_kwargs_from_args(args)
    assert set(kwargs) == {f.name for f in EngineConfig.arg_fields()}
    cfg = EngineConfig.from_kwargs(**kwargs)
    assert cfg.model_config.model == "some/model" and cfg.model_config.dtype == "bfloat16"
    assert cfg.scheduler_config.max_num_seqs == 3 and not cfg.scheduler_config.enable_chunked_prefill
    assert cfg.cache_config.block_size == 16 and cfg.model_config.enforce_eager


def test_generate_command_on_embedded_default():
    out = subprocess.run([sys.executable, "-m", "sparseserve", "generate", "--device", "cpu", "--max-tokens", "5",
                          "--prompt", "Hello there"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Output:" in out.stdout and "Hello there" in out.stdout


def test_generate_command_reports_bad_input():
    out = subprocess.run([sys.executable, "-m", "sparseserve", "generate", "/no/such/model", "--device", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "model directory not found" in out.stderr
