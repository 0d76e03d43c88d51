"""Async scheduling against synchronous scheduling, side by side in one run: decode step time (the median of
whole-batch decode steps, `bench throughput`'s measure) per batch size, against the HBM roofline measured in
the same run on CUDA. Both engines live at once, on the same weights and prompts, and their runs alternate.

    python -m benchmarks.async_overlap 8b --input-len 8192 --batch-sizes 1,8 --json async.json

(`8b`: Llama-3.1-8B shapes with the embedded tokenizer and dummy bf16 weights, benchmarks/common.py.)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import make_8b_dir
from sparseserve.bench.hardware import hbm_bandwidth, print_table
from sparseserve.bench.steps import StepLog
from sparseserve.bench.throughput import _ints, decode_bytes, make_prompts, run_engine
from sparseserve.engine.engine import LLMEngine


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="Model directory, or 8b (Llama-3.1-8B shapes, dummy weights; default: the embedded model).",
    )
    p.add_argument(
        "--load-format",
        default=None,
        choices=["auto", "dummy"],
        help="dummy: random weights (default: dummy for 8b, else auto).",
    )
    p.add_argument("--dtype", default=None, help="Model dtype (default: bfloat16 for 8b, else auto).")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu (default: auto).")
    p.add_argument("--input-len", type=int, default=8192, help="Prompt tokens (default: 8192).")
    p.add_argument("--output-len", type=int, default=128, help="Generated tokens per request (default: 128).")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8], help="Concurrent requests (default: 1,8).")
    p.add_argument(
        "--repeats", type=int, default=2, help="Runs of each engine per batch size, alternating (default: 2)."
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.45,
        help="Each engine's share of GPU memory: both live at once (default: 0.45).",
    )
    p.add_argument("--json", help="Write the results to this JSON file.")
    args = p.parse_args(argv)
    model, tmp = args.model, None
    if model == "8b":
        tmp = tempfile.TemporaryDirectory()
        model = str(make_8b_dir(Path(tmp.name) / "m8b"))
    load_format = args.load_format or ("dummy" if args.model == "8b" else "auto")
    dtype = args.dtype or ("bfloat16" if args.model == "8b" else "auto")
    logs = {mode: StepLog() for mode in ("sync", "async")}
    engines = {
        mode: LLMEngine.from_kwargs(
            logs[mode],
            model=model,
            load_format=load_format,
            dtype=dtype,
            device=args.device,
            max_model_len=args.input_len + args.output_len,
            max_num_seqs=max(args.batch_sizes),
            gpu_memory_utilization=args.gpu_memory_utilization,
            async_scheduling=mode == "async",
        )
        for mode in ("sync", "async")
    }
    dev = engines["sync"].model_runner.device
    hbm = hbm_bandwidth() if dev.type == "cuda" else None
    vocab = engines["sync"].model_runner.arch.vocab_size
    rows = []
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.input_len, vocab, seed=0)
        steps: dict[str, list[float]] = {"sync": [], "async": []}
        for _ in range(args.repeats):
            for mode, engine in engines.items():
                r = run_engine(engine, prompts, args.output_len, logs[mode])
                if r["decode_step_ms"] is not None:
                    steps[mode].append(r["decode_step_ms"])
        row = {"batch": batch, "input": args.input_len}
        for mode, ms in steps.items():
            row[f"{mode}_step_ms"] = min(ms) if ms else None
        if row["sync_step_ms"] and row["async_step_ms"]:
            row["async/sync"] = row["async_step_ms"] / row["sync_step_ms"]
        if hbm is not None:
            roof = 1e3 * decode_bytes(engines["sync"], batch, args.input_len + args.output_len // 2) / hbm
            row["roofline_ms"] = roof
            for mode in steps:
                if row[f"{mode}_step_ms"]:
                    row[f"{mode}/roofline"] = row[f"{mode}_step_ms"] / roof
        rows.append(row)
        print_table([row])
    result = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
        "hbm_bytes_per_s": hbm,
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if tmp is not None:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
