"""The async-scheduling benchmark runs both engines side by side (tiny sizes on CPU; the numbers are the GPU's)."""

from __future__ import annotations

from benchmarks.async_overlap import main


def test_async_overlap_bench_reports_both_modes(tmp_path):
    out = main(
        [
            "--device",
            "cpu",
            "--input-len",
            "64",
            "--output-len",
            "6",
            "--batch-sizes",
            "1,3",
            "--repeats",
            "1",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert [r["batch"] for r in out["rows"]] == [1, 3]
    assert all(r["sync_step_ms"] > 0 and r["async_step_ms"] > 0 and "async/sync" in r for r in out["rows"])
    assert (tmp_path / "r.json").is_file()
