"""The rate curves (benchmarks/rate_curves.py): decode_time reports at several rates become one table, ratios
against the dense row of the same report, and the figure."""

from __future__ import annotations

import json

import pytest

from benchmarks import rate_curves as C


def _report(rate, rows):
    return {"args": {"request_rate": rate, "model": "mha7b", "num_requests": 8, "output_len": None}, "rows": rows}


def _row(config, tok_s, ttft, tpot, hit=None):
    row = {"config": config, "output_tok_s": tok_s, "mean_ttft_s": ttft, "tpot_ms": tpot}
    return row | ({"hbm_hit": hit} if hit is not None else {})


def test_rows_are_ratios_within_each_report(tmp_path):
    reports = [
        _report(
            2.0,
            [
                _row("dense", 200.0, 8.0, 10.0),
                _row("sparse_async", 208.0, 4.0, 9.0),
                _row("kvoffload_async", 260.0, 2.0, 15.0, 0.98),
            ],
        ),
        _report(0.5, [_row("kvoffload_async", 90.0, 0.5, 12.0, 0.99), _row("dense", 100.0, 1.0, 11.0)]),
    ]
    files = []
    for i, r in enumerate(reports):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(r))
    rows = C.main([str(f) for f in files])
    assert [(r["rate"], r["config"]) for r in rows] == [
        (0.5, "kvoffload_async"),
        (0.5, "dense"),
        (2.0, "dense"),
        (2.0, "sparse_async"),
        (2.0, "kvoffload_async"),
    ]
    kv2 = rows[4]
    assert kv2["x dense"] == pytest.approx(1.3) and kv2["TTFT x lower"] == pytest.approx(4.0)
    assert kv2["x sparse-only"] == pytest.approx(1.25) and rows[0]["x sparse-only"] is None
    assert kv2["TPOT / dense"] == pytest.approx(1.5) and kv2["hit"] == 0.98
    assert rows[0]["x dense"] == pytest.approx(0.9) and rows[1]["hit"] is None
    assert json.loads((tmp_path / "curves.json").read_text()) == rows
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_a_report_without_a_rate_is_refused(tmp_path):
    f = tmp_path / "r.json"
    f.write_text(json.dumps(_report(None, [_row("dense", 1.0, 1.0, 1.0)])))
    with pytest.raises(SystemExit, match="request-rate"):
        C.main([str(f)])
