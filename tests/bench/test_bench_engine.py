"""The engine benchmarks run end to end on CPU (their numbers matter on the GPU only)."""

from __future__ import annotations

import json

from sparseserve.entrypoints.cli import build_parser


def run(argv: list[str]) -> None:
    args = build_parser(argv).parse_args(argv)
    args.func(args)


def test_throughput_bench_writes_side_by_side_rows(tmp_path):
    out = tmp_path / "t.json"
    run(
        [
            "bench",
            "throughput",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--input-lens",
            "24",
            "--output-len",
            "4",
            "--batch-sizes",
            "1,3",
            "--hf-batch-sizes",
            "1",
            "--json",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    ours = [r for r in rows if r["engine"] == "sparseserve"]
    assert [(r["input"], r["batch"]) for r in ours] == [(24, 1), (24, 3)]
    assert all(r["output_tok_s"] > 0 and r["decode_step_ms"] > 0 for r in ours)
    assert "speedup_vs_hf" in ours[0] and any(r["engine"] == "transformers" for r in rows)


def test_parity_bench_matches_transformers_on_cpu(tmp_path, tiny_model_dir):
    from sparseserve.bench import parity

    args = build_parser([]).parse_args(["generate"])  # any namespace; fields set below
    for k, v in dict(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        prompt_len=40,
        max_tokens=6,
        gpu_memory_utilization=0.5,
        seed=0,
        json=str(tmp_path / "p.json"),
    ).items():
        setattr(args, k, v)
    row = parity.main(args)
    assert row["logits_rel_err"] < 1e-4 and row["logits_rel_err_vs_eager"] < 1e-4
    assert row["greedy_tokens_equal_prefix"] == "6/6"
