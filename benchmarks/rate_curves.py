"""The SparseServe paper's figures 10-12 from in-process replays: mean TTFT, throughput and TPOT (TBT) against
the request rate, one line per config, each rate's ratios against dense of the same replay.

Reads `benchmarks.decode_time --dataset longbench --request-rate R --json F` results, one file per rate (the
configs of a file ran one after the other in one call, each in a process of its own with `--fresh-process`, so
each ratio is within one call), prints one table and writes curves.json and curves.png beside the first file (or
--out):

    for r in 1 1.5 2 3; do python -m benchmarks.decode_time --model mha7b --dataset longbench \\
        --longbench-tokenizer llama2 --num-requests 24 --request-rate $r --gpu-memory-gb 40 \\
        --engine-arg host_kv_memory=90GB --configs dense sparse_async kvoffload_async --fresh-process \\
        --json rate$r.json; done
    python -m benchmarks.rate_curves rate*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.serve_ladder import plot, ratio
from sparseserve.bench.hardware import print_table


def curve_rows(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (rate, config) of decode_time reports, ordered by rate; ratios against the dense row of the
    same report, throughput also against its sparse-only row (sparse or sparse_async: the paper's vLLM-S); None
    without one."""
    rows = []
    for report in sorted(reports, key=lambda r: r["args"]["request_rate"]):
        rate = report["args"]["request_rate"]
        dense = next((r for r in report["rows"] if r["config"] == "dense"), None)
        sparse = next((r for r in report["rows"] if r["config"] in ("sparse", "sparse_async")), None)
        for r in report["rows"]:
            rows.append(
                {
                    "rate": rate,
                    "config": r["config"],
                    "out tok/s": r["output_tok_s"],
                    "x dense": ratio(r["output_tok_s"], dense and dense["output_tok_s"]),
                    "x sparse-only": ratio(r["output_tok_s"], sparse and sparse["output_tok_s"]),
                    "TTFT s": r["mean_ttft_s"],
                    "TTFT x lower": ratio(dense and dense["mean_ttft_s"], r["mean_ttft_s"]),
                    "TPOT ms": r["tpot_ms"],
                    "TPOT / dense": ratio(r["tpot_ms"], dense and dense["tpot_ms"]),
                    "hit": r.get("hbm_hit"),
                }
            )
    return rows


def as_ladder_runs(rows: list[dict[str, Any]], outputs: str) -> list[dict[str, Any]]:
    """The rows in serve_ladder.plot's shape (its summary keys, times in ms)."""
    return [
        {
            "config": r["config"],
            "outputs": outputs,
            "rate": r["rate"],
            "summary": {
                "ttft_ms": {"mean": 1e3 * r["TTFT s"]},
                "tpot_ms": {"mean": r["TPOT ms"]},
                "output_throughput": r["out tok/s"],
            },
        }
        for r in rows
    ]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", type=Path, help="decode_time JSON files, one per request rate")
    p.add_argument("--out", type=Path, default=None, help="folder for curves.json and curves.png")
    args = p.parse_args(argv)
    reports = [json.loads(f.read_text()) for f in args.reports]
    if any(r["args"].get("request_rate") is None for r in reports):
        raise SystemExit("every report needs a --request-rate (a LongBench replay at a rate)")
    rows = curve_rows(reports)
    first = reports[0]["args"]
    print_table(rows, f"{first['model']}, {first['num_requests']} requests a rate: against dense of the same call")
    out = args.out or args.reports[0].parent
    out.mkdir(parents=True, exist_ok=True)
    (out / "curves.json").write_text(json.dumps(rows, indent=2))
    plot(
        as_ladder_runs(rows, "lbmax" if not first.get("output_len") else f"fix{first['output_len']}"),
        out / "curves.png",
    )
    print(f"wrote {out / 'curves.json'} and {out / 'curves.png'}")
    return rows


if __name__ == "__main__":
    main()
