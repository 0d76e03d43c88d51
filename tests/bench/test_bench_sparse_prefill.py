"""The sparse prefill benchmark runs end to end on the CPU (Triton interpreter, tiny context): its numbers matter on
the GPU only."""
from __future__ import annotations

import argparse
import json

import pytest

from sparseserve.bench import sparse_prefill as bench


@pytest.mark.slow
def test_sparse_prefill_bench_rows(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_cli_args(parser)
    out = tmp_path / "sp.json"
    bench.main(parser.parse_args(["--device", "cpu", "--dtype", "float32", "--contexts", "80", "--q-tile", "16",
                                  "--k-tile", "16", "--densities", "0.5", "--thresholds", "0.1",
                                  "--output", str(out)]))
    (res,) = json.loads(out.read_text())["contexts"]
    kinds = [r["kind"] for r in res["rows"]]
    assert kinds == ["dense_triton", "sdpa_flash", "quantize", "select_tiles", "select", "attn@0.5",
                     "select+attn@0.5", "sale@0.1", "streaming/2@0.1"]
    assert res["rel_err_sparse_all_vs_dense"] < 1e-5
    rows = {r["kind"]: r for r in res["rows"]}
    assert 0 < rows["attn@0.5"]["tile_fraction"] < 1 and rows["sale@0.1"]["tile_fraction"] <= 1
    assert rows["streaming/2@0.1"]["tile_fraction"] < rows["sale@0.1"]["tile_fraction"]
    assert all(r["ms"] > 0 for r in res["rows"] if r["kind"] != "sdpa_flash")
