"""Prefix caching, admission and preemption on the GPU, in-process with LLMEngine (no server), each workload's
configurations side by side in one run (DESIGN.md: ratios).

    python -m sparseserve.bench.prefix --model 8b [--workloads conversation long hitrate] [--json out.json]

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

`--model 8b`: Llama-3.1-8B shapes with the embedded tokenizer's vocabulary and dummy bf16 weights (DESIGN.md's
reference workload), GPU memory capped at --gpu-memory-gb (default 40). Any model directory works; on CPU the
smoke test runs it with a tiny model and tiny sizes (tests/bench/test_bench_prefix.py).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sparseserve.bench.datasets import PromptBuilder, data_dir, load_trace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int


def make_8b_dir(out: Path) -> Path:
    """Llama-3.1-8B's shapes over the embedded model's tokenizer and config keys (for load_format='dummy')."""
    import shutil

    from sparseserve.models.loader import DEFAULT_MODEL_DIR
    cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    cfg.update(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, tie_word_embeddings=False,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (DEFAULT_MODEL_DIR / f).exists():
            shutil.copy(DEFAULT_MODEL_DIR / f, out / f)
    return out


def trace_jobs(tokenizer, path: str, n: int, time_scale: float, max_in: int, max_out: int, seed: int = 0) -> list[Job]:
    """Trace requests as token ids: equal hash ids give equal token blocks (bench/datasets.py trace_block), BOS
    first as a server would tokenize them."""
    builder = PromptBuilder(tokenizer)
    return [Job(t.arrival_s, tokenizer.encode(builder.trace_prompt(list(t.hash_ids), t.input_length, seed)),
                t.output_length) for t in load_trace(path, n, time_scale, max_in, max_out)]


def long_jobs(tokenizer, n: int, prompt_len: int, output_len: int) -> list[Job]:
    """n distinct prompts of prompt_len tokens, all at time 0 (nothing to share: only preemption's recompute)."""
    builder = PromptBuilder(tokenizer)
    return [Job(0.0, tokenizer.encode(builder.prompt(prompt_len, f"long:{i}")), output_len) for i in range(n)]


def replay(engine, jobs: list[Job], on_step: Callable[[list, float, float], None] | None = None) -> dict:
    """Adds each job at its arrival time (seconds after the start) and steps the engine until all finished.
    TTFT counts from the arrival time. on_step(outputs, t, idle): after each engine step, its outputs (request ids
    "j<index in arrival order>"), the seconds since the start, and the seconds the replay slept since the step
    before, waiting for an arrival with nothing to run (bench/decode_time.py's timeline)."""
    import numpy as np

    from sparseserve import SamplingParams
    jobs = sorted(jobs, key=lambda j: j.arrival_s)
    before = engine.get_stats(sync=True)
    first: dict[str, float] = {}
    arrival = {f"j{i}": j.arrival_s for i, j in enumerate(jobs)}
    out_tokens = 0
    t0 = time.perf_counter()
    i, idle = 0, 0.0
    while i < len(jobs) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while i < len(jobs) and jobs[i].arrival_s <= now:
            j = jobs[i]
            engine.add_request(f"j{i}", {"prompt_token_ids": j.prompt_token_ids},
                               SamplingParams(temperature=0.0, max_tokens=j.max_tokens, ignore_eos=True))
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(jobs[i].arrival_s - now, 0.05)))
            idle += time.perf_counter() - t0 - now
            continue
        outputs = engine.step()
        if on_step is not None:
            on_step(outputs, time.perf_counter() - t0, idle)
        idle = 0.0
        for out in outputs:
            new = sum(len(c.token_ids) for c in out.outputs)  # deltas: the tokens new since the last output
            if out.request_id not in first and new:
                first[out.request_id] = time.perf_counter() - t0
            out_tokens += new
    duration = time.perf_counter() - t0
    after = engine.get_stats(sync=True)
    d = {k: getattr(after, k) - getattr(before, k) for k in (
        "num_prompt_tokens", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
        "host_prefix_cache_queries", "host_prefix_cache_hits")}
    prompt_tokens = sum(len(j.prompt_token_ids) for j in jobs)
    ttft = np.array([first[r] - arrival[r] for r in first])
    q = d["prefix_cache_queries"]
    return {"requests": len(jobs), "prompt_tokens": prompt_tokens, "prompt_tokens_computed": d["num_prompt_tokens"],
            "computed_per_prompt": d["num_prompt_tokens"] / prompt_tokens, "preemptions": d["num_preemptions"],
            "hit_rate": d["prefix_cache_hits"] / q if q else 0.0,
            "host_hit_rate": d["host_prefix_cache_hits"] / q if q else 0.0,
            "mean_ttft_s": float(ttft.mean()), "p99_ttft_s": float(np.percentile(ttft, 99)), "duration_s": duration,
            "output_tok_s": out_tokens / duration, "total_tok_s": (prompt_tokens + out_tokens) / duration}


CONFIGS = {
    "baseline": dict(enable_prefix_caching=False, init_new_token_ratio=0.0, min_new_token_ratio=0.0),
    "admission": dict(enable_prefix_caching=False),
    "cached": dict(),
}


@contextlib.contextmanager
def fresh_engine(**engine_kw) -> Iterator:
    """An LLMEngine whose memory is given back afterwards (configurations run one after another in a process)."""
    import torch

    from sparseserve.engine.engine import LLMEngine
    engine = LLMEngine.from_kwargs(**engine_kw)
    try:
        yield engine
    finally:
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_config(model: str, name: str, jobs: list[Job], engine_kw: dict, extra: dict) -> dict:
    with fresh_engine(model=model, **engine_kw, **extra) as engine:
        row = {"config": name, **replay(engine, jobs)}
    logger.info("%s", row)
    return row


def engine_kwargs(args: argparse.Namespace, max_model_len: int) -> dict:
    import torch
    kw = dict(max_model_len=max_model_len, device=args.device, seed=0)
    if args.load_format == "dummy":
        kw.update(load_format="dummy", dtype="bfloat16")
    if args.num_gpu_blocks is not None:
        kw["num_gpu_blocks_override"] = args.num_gpu_blocks
    elif torch.cuda.is_available() and args.device != "cpu":
        kw["gpu_memory_utilization"] = args.gpu_memory_gb * 1e9 / torch.cuda.mem_get_info()[1]
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kw


def add_replay_args(p: argparse.ArgumentParser) -> None:
    """The model, engine-size and trace options of an in-process replay benchmark (`engine_kwargs`, `model_dir`,
    `trace_jobs`)."""
    p.add_argument("--model", default="8b", help="model directory, or 8b (Llama-3.1-8B shapes, dummy weights)")
    p.add_argument("--load-format", default=None, choices=["auto", "dummy"], help="default: dummy for 8b")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--gpu-memory-gb", type=float, default=40.0, help="GPU memory cap (CUDA)")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="exact KV blocks instead (CPU smoke runs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--trace", default=str(data_dir() / "traces" / "mooncake_conversation.jsonl"))
    p.add_argument("--num-requests", type=int, default=48, help="the trace's first requests to replay")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies the trace's inter-arrival times")
    p.add_argument("--max-input-len", type=int, default=32768, help="cap on the trace's prompt lengths")
    p.add_argument("--max-output-len", type=int, default=512, help="cap on the trace's output lengths")


@contextlib.contextmanager
def model_dir(args: argparse.Namespace) -> Iterator[str]:
    """args.model, or for "8b" a temporary Llama-3.1-8B-shaped directory (dummy weights) for the duration."""
    if args.model != "8b":
        yield args.model
        return
    args.load_format = args.load_format or "dummy"
    with tempfile.TemporaryDirectory() as tmp:
        yield str(make_8b_dir(Path(tmp) / "m8b"))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_replay_args(p)
    p.add_argument("--workloads", nargs="+", default=["conversation", "long", "hitrate"],
                   choices=["conversation", "long", "hitrate"])
    p.add_argument("--long-requests", type=int, default=24)
    p.add_argument("--long-input", type=int, default=16384)
    p.add_argument("--long-output", type=int, default=1024)
    p.add_argument("--hitrate-requests", type=int, default=1000)
    p.add_argument("--hitrate-time-scale", type=float, default=0.1, help="hitrate: compressed trace time scale")
    p.add_argument("--hitrate-max-input-len", type=int, default=32768)
    p.add_argument("--hitrate-max-output-len", type=int, default=64, help="hitrate: outputs capped lower (the "
                   "question is prefill)")
    p.add_argument("--host-cache-gb", type=float, default=64.0, help="hitrate: the host tier's size")
    p.add_argument("--hitrate-configs", nargs="+", default=["none", "device", "host"],
                   choices=["none", "device", "host"], help="hitrate: no caching, the device prefix cache, and "
                   "the device cache with the host tier (each alone fits a 10-minute run where all do not)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                   help="conversation and long: the configurations to compare")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    from transformers import AutoTokenizer

    from sparseserve.bench.hardware import print_table
    report: dict = {"date": datetime.date.today().isoformat(), "model": args.model, "args": vars(args)}
    with model_dir(args) as model:
        tokenizer = AutoTokenizer.from_pretrained(model)
        if "conversation" in args.workloads:
            jobs = trace_jobs(tokenizer, args.trace, args.num_requests, args.time_scale, args.max_input_len,
                              args.max_output_len)
            kw = engine_kwargs(args, args.max_input_len + args.max_output_len)
            report["conversation"] = rows = [run_config(model, c, jobs, kw, CONFIGS[c]) for c in args.configs]
            print_table(rows, f"conversation trace, first {args.num_requests} requests at time scale "
                              f"{args.time_scale:g}, dense")
        if "long" in args.workloads:
            jobs = long_jobs(tokenizer, args.long_requests, args.long_input, args.long_output)
            kw = engine_kwargs(args, args.long_input + args.long_output + 8)
            report["long"] = rows = [run_config(model, c, jobs, kw, CONFIGS[c]) for c in args.configs]
            print_table(rows, f"{args.long_requests} x {args.long_input} tokens, {args.long_output} outputs, "
                              f"at once, dense")
        if "hitrate" in args.workloads:
            jobs = trace_jobs(tokenizer, args.trace, args.hitrate_requests, args.hitrate_time_scale,
                              args.hitrate_max_input_len, args.hitrate_max_output_len)
            kw = engine_kwargs(args, args.hitrate_max_input_len + args.hitrate_max_output_len)
            host = dict(host_prefix_cache_memory=int(args.host_cache_gb * 2**30))
            configs = {"none": ("no caching", dict(enable_prefix_caching=False)), "device": ("device cache", {}),
                       "host": ("device + host tier", host)}
            rows = [run_config(model, configs[c][0], jobs, kw, configs[c][1]) for c in args.hitrate_configs]
            if args.hitrate_configs[0] == "none":
                for r in rows[1:]:
                    r["ttft_gain"] = rows[0]["mean_ttft_s"] / r["mean_ttft_s"] if r["mean_ttft_s"] else 0.0
            report["hitrate"] = rows
            print_table(rows, f"conversation trace, {args.hitrate_requests} requests at time scale "
                              f"{args.hitrate_time_scale:g}: prefix hit rate, dense")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
