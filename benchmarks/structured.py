"""Structured outputs' cost in decode: the whole-batch decode step of a batch where none, one or every request is
JSON-constrained, side by side on one engine (runs alternate), with sync and async scheduling.

    python -m benchmarks.structured 8b --batch 32 --input-len 1024 --output-len 256 --json structured.json

(`8b`: Llama-3.1-8B shapes and vocabulary (128,256) with dummy bf16 weights; the embedded tokenizer's 4,096 tokens
are the ones a grammar can allow, so the host's mask fill is that of a small vocabulary, while the device's
mask application covers the full one; --tokenizer DIR takes a real tokenizer.) The constraint is an array of at
least 1,000 objects: no request can complete it (and stop) within the run. Reports the median whole-batch decode
step, tokens/s, and each config's ratio to the unconstrained batch (the target: one of 32 constrained >= 0.9x).
Needs llguidance (`pip install 'sparseserve[structured]'`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.model_dir import make_model_dir
from sparseserve.bench.hardware import print_table
from sparseserve.bench.steps import StepLog
from sparseserve.bench.throughput import make_prompts
from sparseserve.engine.engine import LLMEngine
from sparseserve.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["id", "name", "tags"],
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 16},
            "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 4},
        },
    },
}
CONFIGS = {"free": 0, "one": 1, "all": None}  # constrained requests of the batch (None: all)


def run(engine: LLMEngine, log: StepLog, prompts: list[list[int]], output_len: int, constrained: int) -> dict:
    free = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    json_params = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    engine.reset_prefix_cache()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, json_params if i < constrained else free)
    steps = []
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        engine.step()  # ends in a host sync (the sampled tokens)
        te = time.perf_counter()
        if log.last is not None and log.last.pure_decode(len(prompts)):
            steps.append(te - ts)
    return {"steps": len(steps), "step_ms": 1e3 * statistics.median(steps) if steps else None}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="8b", help="Model directory, or 8b (default).")
    p.add_argument("--tokenizer", default=None, help="Tokenizer directory (default: the model's).")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu (default: auto).")
    p.add_argument("--batch", type=int, default=32, help="Concurrent requests (default: 32).")
    p.add_argument("--input-len", type=int, default=1024, help="Prompt tokens (default: 1024).")
    p.add_argument("--output-len", type=int, default=256, help="Generated tokens per request (default: 256).")
    p.add_argument("--repeats", type=int, default=3, help="Runs of each config, alternating (default: 3).")
    p.add_argument("--scheduling", default="sync,async", help="sync, async or both (default: sync,async).")
    p.add_argument("--json", help="Write the results to this JSON file.")
    args = p.parse_args(argv)
    model, tmp = args.model, None
    kw = {}
    if model == "8b":
        tmp = tempfile.TemporaryDirectory()
        model = str(make_model_dir(Path(tmp.name) / "m8b", "llama-3.1-8b"))
        kw = dict(load_format="dummy", dtype="bfloat16")
    rows = []
    for mode in args.scheduling.split(","):
        log = StepLog()
        engine = LLMEngine.from_kwargs(
            log,
            model=model,
            tokenizer=args.tokenizer,
            device=args.device,
            max_model_len=args.input_len + args.output_len + 8,
            max_num_seqs=args.batch,
            async_scheduling=mode == "async",
            **kw,
        )
        prompts = make_prompts(args.batch, args.input_len, engine.model_runner.arch.vocab_size, seed=0)
        times: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for _ in range(args.repeats):
            for name, n in CONFIGS.items():
                r = run(engine, log, prompts, args.output_len, args.batch if n is None else n)
                if r["step_ms"] is not None:
                    times[name].append(r["step_ms"])
        free_ms = min(times["free"]) if times["free"] else None
        for name, ms in times.items():
            best = min(ms) if ms else None
            row = {
                "scheduling": mode,
                "config": name,
                "batch": args.batch,
                "constrained": args.batch if CONFIGS[name] is None else CONFIGS[name],
                "step_ms": best,
                "tok_s": args.batch * 1e3 / best if best else None,
            }
            if best and free_ms:
                row["throughput_vs_free"] = free_ms / best
                row["extra_ms_per_step"] = best - free_ms
            rows.append(row)
        del engine
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print_table(rows, "structured outputs: whole-batch decode steps (best of the repeats' medians)")
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "input_len": args.input_len,
        "output_len": args.output_len,
        "schema": SCHEMA,
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if tmp is not None:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
