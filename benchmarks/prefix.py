"""Prefix caching, admission and preemption on the GPU, in-process with LLMEngine (no server), each workload's
configurations side by side in one run (ratios, not absolute times).

    python -m benchmarks.prefix --model 8b [--workloads conversation long hitrate] [--json out.json]

conversation: the first 48 requests of the Mooncake conversation trace replayed at their arrival times (time
    scale 1: saturating), inputs capped at 32K tokens, outputs at 512; dense attention.
long: 24 requests of 16K tokens with 1,024 outputs each, all arriving at once; dense.
    Both against three configurations: `baseline` (no prefix caching, admission by what fits now: the engine
    before prefix caching), `admission` (the admission estimate only) and `cached` (the defaults: prefix
    caching and the admission estimate).
hitrate: --hitrate-requests requests (default 1,000) of the conversation trace at a compressed time scale: dense
    without caching, dense with its device prefix cache, and dense with the host tier (host_prefix_cache_memory):
    prefix hit rate and mean TTFT (the gain of each against no caching).
Each row: prompt tokens computed / prompt tokens (the recompute that preemption causes; below 1 with cache hits),
preemptions, prefix-cache hit rates, mean and p99 TTFT, output and total throughput.

`--model 8b`: Llama-3.1-8B shapes with the embedded tokenizer's vocabulary and dummy bf16 weights (the serving
reference workload), GPU memory capped at --gpu-memory-gb (default 40). Any model directory works; on CPU the
smoke test runs it with a tiny model and tiny sizes (tests/benchmarks/test_prefix_bench.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
from pathlib import Path

from benchmarks.common import (
    Job,
    add_replay_args,
    engine_kwargs,
    fresh_engine,
    long_jobs,
    model_dir,
    replay,
    trace_jobs,
)
from sparseserve.bench.hardware import print_table

logger = logging.getLogger(__name__)

CONFIGS = {
    "baseline": dict(enable_prefix_caching=False, init_new_token_ratio=0.0, min_new_token_ratio=0.0),
    "admission": dict(enable_prefix_caching=False),
    "cached": dict(),
}


def run_config(model: str, name: str, jobs: list[Job], engine_kw: dict, extra: dict) -> dict:
    with fresh_engine(model=model, **engine_kw, **extra) as engine:
        row = {"config": name, **replay(engine, jobs)}
    logger.info("%s", row)
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_replay_args(p)
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["conversation", "long", "hitrate"],
        choices=["conversation", "long", "hitrate"],
    )
    p.add_argument("--long-requests", type=int, default=24)
    p.add_argument("--long-input", type=int, default=16384)
    p.add_argument("--long-output", type=int, default=1024)
    p.add_argument("--hitrate-requests", type=int, default=1000)
    p.add_argument("--hitrate-time-scale", type=float, default=0.1, help="hitrate: compressed trace time scale")
    p.add_argument("--hitrate-max-input-len", type=int, default=32768)
    p.add_argument(
        "--hitrate-max-output-len", type=int, default=64, help="hitrate: outputs capped lower (the question is prefill)"
    )
    p.add_argument("--host-cache-gb", type=float, default=64.0, help="hitrate: the host tier's size")
    p.add_argument(
        "--hitrate-configs",
        nargs="+",
        default=["none", "device", "host"],
        choices=["none", "device", "host"],
        help="hitrate: no caching, the device prefix cache, and "
        "the device cache with the host tier (each alone fits a 10-minute run where all do not)",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=list(CONFIGS),
        help="conversation and long: the configurations to compare",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    from transformers import AutoTokenizer

    report: dict = {"date": datetime.date.today().isoformat(), "model": args.model, "args": vars(args)}
    with model_dir(args) as model:
        tokenizer = AutoTokenizer.from_pretrained(model)
        if "conversation" in args.workloads:
            jobs = trace_jobs(
                tokenizer, args.trace, args.num_requests, args.time_scale, args.max_input_len, args.max_output_len
            )
            kw = engine_kwargs(args, args.max_input_len + args.max_output_len)
            report["conversation"] = rows = [run_config(model, c, jobs, kw, CONFIGS[c]) for c in args.configs]
            print_table(
                rows, f"conversation trace, first {args.num_requests} requests at time scale {args.time_scale:g}, dense"
            )
        if "long" in args.workloads:
            jobs = long_jobs(tokenizer, args.long_requests, args.long_input, args.long_output)
            kw = engine_kwargs(args, args.long_input + args.long_output + 8)
            report["long"] = rows = [run_config(model, c, jobs, kw, CONFIGS[c]) for c in args.configs]
            print_table(
                rows, f"{args.long_requests} x {args.long_input} tokens, {args.long_output} outputs, at once, dense"
            )
        if "hitrate" in args.workloads:
            jobs = trace_jobs(
                tokenizer,
                args.trace,
                args.hitrate_requests,
                args.hitrate_time_scale,
                args.hitrate_max_input_len,
                args.hitrate_max_output_len,
            )
            kw = engine_kwargs(args, args.hitrate_max_input_len + args.hitrate_max_output_len)
            host = dict(host_prefix_cache_memory=int(args.host_cache_gb * 2**30))
            configs = {
                "none": ("no caching", dict(enable_prefix_caching=False)),
                "device": ("device cache", {}),
                "host": ("device + host tier", host),
            }
            rows = [run_config(model, configs[c][0], jobs, kw, configs[c][1]) for c in args.hitrate_configs]
            if args.hitrate_configs[0] == "none":
                for r in rows[1:]:
                    r["ttft_gain"] = rows[0]["mean_ttft_s"] / r["mean_ttft_s"] if r["mean_ttft_s"] else 0.0
            report["hitrate"] = rows
            print_table(
                rows,
                f"conversation trace, {args.hitrate_requests} requests at time scale "
                f"{args.hitrate_time_scale:g}: prefix hit rate, dense",
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
