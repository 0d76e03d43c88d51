"""`python -m sparseserve.bench.offload --real MODEL`: KV offload against all KV in HBM on real prompts, side by side
per batch size; a CPU smoke run on a tiny model (its numbers matter on the GPU only)."""
from __future__ import annotations

import json

import pytest

from sparseserve.bench import offload


def test_real_mode_smoke(tiny_model_dir, tmp_path, capsys):
    from sparseserve.bench.datasets import data_dir
    if not (data_dir() / "haystack").is_dir():
        pytest.skip("essay haystack (../shared/data/haystack) not found")
    out = tmp_path / "real.json"
    offload.main(["--real", str(tiny_model_dir), "--batches", "1,3", "--prompt-len", "400", "--output-len", "6",
                  "--budget", "192", "--device", "cpu", "--dtype", "float32", "--engine-arg", "sparse_dense_layers=0",
                  "--json", str(out)])
    assert "KV offload" in capsys.readouterr().out
    rows = json.loads(out.read_text())["real"]
    assert [(r["batch"], "offload" in r["config"]) for r in rows] == [(1, False), (1, True), (3, False), (3, True)]
    for base, off in zip(rows[::2], rows[1::2]):
        assert off["same_tokens"] is True  # offload changes where blocks are read from, never a token
        assert 0.0 <= off["hbm_hit_ratio"] <= 1.0 and off["blocks_loaded"] > 0
        assert off["tpot_ms"] > 0 and base["tpot_ms"] > 0 and off["tpot_vs_hbm"] > 0
        assert base["decode_steps"] > 0 and base["preemptions"] == 0
        # topk at 192 tokens (6 blocks of 32) of a 400-token context: the policy really was sparse on both sides.
        assert 0 < base["tokens_attended"] <= 192 and 0 < off["tokens_attended"] <= 192
