"""`sparseserve calibrate`: offline calibration from a dense run, for two engine options.

    sparseserve calibrate [MODEL] --lengths 8192 --num-samples 4 --out heads.json
    sparseserve calibrate [MODEL] --prefill --lengths 16384 --num-samples 2 --out prefill.json
    sparseserve calibrate smollm2 --suite completion --lengths 8128 --out smollm2_heads.json

Default: streaming heads, the --streaming-heads file (calibration/heads.py). --prefill: the per-head thresholds
of SALE's sparse prefill, the --sparse-prefill-calibration file (calibration/prefill.py). Prompts: long-context
task prompts (workloads/tasks.py, or workloads/completion_tasks.py with --suite completion), or random tokens.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from sparseserve.calibration import heads, prefill

# Retrieval prompts: a head that the needle's lookup needs must not look like a streaming head.
CALIBRATION_TASKS = {
    "ruler": "niah_single,variable_tracking",
    "completion": "needle_multikey,needle_multivalue,extract_record",
}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="Model directory, .gguf file or known name such as smollm2 (default: embedded model).",
    )
    p.add_argument("--out", required=True, help="JSON file to write (streaming heads, or --prefill thresholds).")
    p.add_argument(
        "--prefill",
        action="store_true",
        help="Calibrate the per-head thresholds of sparse prefill (sparse_prefill=sale) instead.",
    )
    p.add_argument("--lengths", default="8192", help="Prompt lengths in tokens, comma-separated.")
    p.add_argument("--num-samples", type=int, default=2, help="Prompts per task and length.")
    p.add_argument(
        "--suite",
        default="ruler",
        choices=["ruler", "completion"],
        help="Task suite of the prompts (bench/accuracy.py): completion for small instruct models.",
    )
    p.add_argument(
        "--tasks",
        default=None,
        help="Tasks of the suite (default: ruler niah_single,variable_tracking; "
        "completion needle_multikey,needle_multivalue,extract_record).",
    )
    p.add_argument("--random-prompts", action="store_true", help="Random token prompts instead of tasks.")
    p.add_argument("--decode-steps", type=int, default=8, help="Decode steps measured per prompt.")
    p.add_argument("--threshold", type=float, default=0.9, help="Minimum sink + local mass of a streaming head.")
    p.add_argument("--max-fraction", type=float, default=0.5, help="At most this share of sparse-layer heads.")
    p.add_argument("--sparse-sink-blocks", type=int, default=1, help="As the engine flag.")
    p.add_argument("--sparse-local-blocks", type=int, default=4, help="As the engine flag.")
    p.add_argument("--sparse-dense-layers", type=int, default=2, help="As the engine flag.")
    p.add_argument("--block-size", type=int, default=32, help="As the engine flag.")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu.")
    p.add_argument("--dtype", default="auto", help="Model dtype.")
    p.add_argument("--data-dir", default=None, help="Essay folder of the tasks.")
    p.add_argument("--seed", type=int, default=0)
    prefill.add_cli_args(p)


def calibration_prompts(engine: Any, args: argparse.Namespace) -> list[list[int]]:
    """Task prompts (workloads/tasks.py) or random tokens, --num-samples of each length (and task)."""
    from sparseserve.workloads import tasks as T

    lengths = [int(x) for x in args.lengths.split(",") if x]
    if args.random_prompts:
        g = torch.Generator().manual_seed(args.seed)
        vocab = engine.model_runner.arch.vocab_size
        return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths for _ in range(args.num_samples)]
    tok = engine.tokenizer
    builder = T.TaskBuilder(tok, T.load_essays(T.find_haystack_dir(args.data_dir)), eos_id=tok.eos_token_id)
    from sparseserve.bench.accuracy import SUITES

    tasks = args.tasks or CALIBRATION_TASKS[args.suite]
    samples = SUITES[args.suite].build(
        builder, [t for t in tasks.split(",") if t], lengths, args.num_samples, args.seed
    )
    return [s.prompt_ids for s in samples]


def main(args: argparse.Namespace) -> dict:
    module = prefill if args.prefill else heads
    return module.calibrate(args, lambda engine: calibration_prompts(engine, args))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(ap)
    main(ap.parse_args())
