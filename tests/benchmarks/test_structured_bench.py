"""The structured-outputs benchmark runs every config with both schedulings (tiny sizes on CPU; the numbers are
the GPU's)."""

from __future__ import annotations

import pytest

from benchmarks.structured import main
from sparseserve.models.loader import DEFAULT_MODEL_DIR

pytest.importorskip("llguidance")


def test_structured_bench_reports_every_config(tmp_path):
    out = main(
        [
            str(DEFAULT_MODEL_DIR),
            "--device",
            "cpu",
            "--batch",
            "3",
            "--input-len",
            "16",
            "--output-len",
            "6",
            "--repeats",
            "1",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert [(r["scheduling"], r["config"], r["constrained"]) for r in out["rows"]] == [
        (mode, name, n) for mode in ("sync", "async") for name, n in (("free", 0), ("one", 1), ("all", 3))
    ]
    assert all(r["step_ms"] > 0 and r["throughput_vs_free"] > 0 for r in out["rows"])
    assert (tmp_path / "r.json").is_file()
