"""What the experiments share: engines built (and freed) one after another, a trace replayed in-process with
arrival times, the replay's command-line options, and the 8B model directory for dummy weights."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.model_dir import PRESETS, make_model_dir
from sparseserve.workloads.datasets import PromptBuilder, data_dir, load_trace


@dataclass(frozen=True)
class Job:
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int


def free_memory() -> None:
    """The dropped engines' GPU memory back (engines hold reference cycles)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_engine(profiler: Any = None, **engine_kw) -> Any:
    """An LLMEngine of these LLM keyword arguments, with an optional sparseserve.profiler.Profiler."""
    from sparseserve.config import EngineConfig
    from sparseserve.engine.engine import LLMEngine

    if profiler is None:
        return LLMEngine.from_kwargs(**engine_kw)
    return LLMEngine(EngineConfig.from_kwargs(**engine_kw), profiler=profiler)


@contextlib.contextmanager
def fresh_engine(profiler: Any = None, **engine_kw) -> Iterator:
    """An LLMEngine whose memory is given back afterwards (configurations run one after another in a process)."""
    free_memory()
    engine = build_engine(profiler, **engine_kw)
    try:
        yield engine
    finally:
        del engine
        free_memory()


def make_8b_dir(out: Path) -> Path:
    """Llama-3.1-8B's shapes over the embedded tokenizer's vocabulary, no weights (load_format='dummy')."""
    return make_model_dir(out, "llama-3.1-8b", embedded_vocab=True)


def trace_jobs(tokenizer, path: str, n: int, time_scale: float, max_in: int, max_out: int, seed: int = 0) -> list[Job]:
    """Trace requests as token ids: equal hash ids give equal token blocks (workloads/datasets.py trace_block), BOS
    first as a server would tokenize them."""
    builder = PromptBuilder(tokenizer)
    return [
        Job(
            t.arrival_s, tokenizer.encode(builder.trace_prompt(list(t.hash_ids), t.input_length, seed)), t.output_length
        )
        for t in load_trace(path, n, time_scale, max_in, max_out)
    ]


def longbench_jobs(tokenizer, args: argparse.Namespace) -> list[Job]:
    """`bench serve --dataset longbench`'s requests (workloads/longbench.py) as token ids, Poisson arrivals at
    args.request_rate (inf: all at once); --output-len makes every request ask for exactly that many tokens."""
    from sparseserve.bench.serve import poisson_arrivals
    from sparseserve.workloads import longbench

    builder = PromptBuilder(tokenizer)
    reqs = longbench.sample_requests(
        args.num_requests, 0, args.longbench_tokenizer, args.max_input_len, "max", args.output_len
    )
    arrivals = poisson_arrivals(args.num_requests, args.request_rate, 0)
    return [
        Job(t, tokenizer.encode(builder.prompt(r.full_len, f"0:lb:{i}", keep=r.prompt_len)), r.output_len)
        for i, (r, t) in enumerate(zip(reqs, arrivals))
    ]


def workload_jobs(tokenizer, args: argparse.Namespace) -> list[Job]:
    """The replay's requests: the conversation trace (`trace_jobs`) or LongBench's mix (`longbench_jobs`)."""
    if args.dataset == "longbench":
        return longbench_jobs(tokenizer, args)
    out = args.output_len or args.max_output_len
    jobs = trace_jobs(tokenizer, args.trace, args.num_requests, args.time_scale, args.max_input_len, out)
    return [dataclasses.replace(j, max_tokens=out) for j in jobs] if args.output_len else jobs


def max_output_len(args: argparse.Namespace) -> int:
    """The longest output a replay's request may ask for (for max_model_len)."""
    if args.output_len:
        return args.output_len
    if args.dataset == "longbench":
        from sparseserve.workloads import longbench

        return max(d.max_gen for d in longbench.DATASETS)
    return args.max_output_len


def long_jobs(tokenizer, n: int, prompt_len: int, output_len: int) -> list[Job]:
    """n distinct prompts of prompt_len tokens, all at time 0 (nothing to share: only preemption's recompute)."""
    builder = PromptBuilder(tokenizer)
    return [Job(0.0, tokenizer.encode(builder.prompt(prompt_len, f"long:{i}")), output_len) for i in range(n)]


def replay(engine, jobs: list[Job], on_step: Callable[[list, float, float], None] | None = None) -> dict:
    """Adds each job at its arrival time (seconds after the start) and steps the engine until all finished.
    TTFT counts from the arrival time. on_step(outputs, t, idle): after each engine step, its outputs (request ids
    "j<index in arrival order>"), the seconds since the start, and the seconds the replay slept since the step
    before, waiting for an arrival with nothing to run (benchmarks/decode_time.py's timeline)."""
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
            engine.add_request(
                f"j{i}",
                {"prompt_token_ids": j.prompt_token_ids},
                SamplingParams(temperature=0.0, max_tokens=j.max_tokens, ignore_eos=True),
            )
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
    d = {
        k: getattr(after, k) - getattr(before, k)
        for k in (
            "num_prompt_tokens",
            "num_preemptions",
            "prefix_cache_queries",
            "prefix_cache_hits",
            "host_prefix_cache_queries",
            "host_prefix_cache_hits",
        )
    }
    prompt_tokens = sum(len(j.prompt_token_ids) for j in jobs)
    ttft = np.array([first[r] - arrival[r] for r in first])
    q = d["prefix_cache_queries"]
    return {
        "requests": len(jobs),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_computed": d["num_prompt_tokens"],
        "computed_per_prompt": d["num_prompt_tokens"] / prompt_tokens,
        "preemptions": d["num_preemptions"],
        "hit_rate": d["prefix_cache_hits"] / q if q else 0.0,
        "host_hit_rate": d["host_prefix_cache_hits"] / q if q else 0.0,
        "mean_ttft_s": float(ttft.mean()),
        "p99_ttft_s": float(np.percentile(ttft, 99)),
        "duration_s": duration,
        "output_tok_s": out_tokens / duration,
        "total_tok_s": (prompt_tokens + out_tokens) / duration,
    }


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
    p.add_argument(
        "--model",
        default="8b",
        help="model directory, or a benchmarks/model_dir.py preset over the embedded vocabulary with dummy weights: "
        "8b (Llama-3.1-8B), mha7b (Llama-2-7B / LWM-7B), gqa8b (Llama-3-8B-262K)",
    )
    p.add_argument("--load-format", default=None, choices=["auto", "dummy"], help="default: dummy for a preset")
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


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """`workload_jobs`' options beside `add_replay_args`': the conversation trace or LongBench's mix."""
    p.add_argument(
        "--dataset",
        default="trace",
        choices=["trace", "longbench"],
        help="trace (--trace replayed at --time-scale) or longbench (LongBench v1's mix, workloads/longbench.py, "
        "Poisson arrivals at --request-rate, prompts capped at --max-input-len, LongBench's output caps)",
    )
    p.add_argument("--request-rate", type=float, default=math.inf, help="longbench: requests/s (default: all at once)")
    p.add_argument("--longbench-tokenizer", default="llama3", choices=["llama3", "llama2"], help="longbench lengths")
    p.add_argument("--output-len", type=int, default=None, help="every request asks for exactly this many tokens")


@contextlib.contextmanager
def model_dir(args: argparse.Namespace) -> Iterator[str]:
    """args.model, or for a preset name ("8b" or one of benchmarks/model_dir.py's) a temporary directory of its
    shapes (dummy weights) for the duration."""
    preset = {"8b": "llama-3.1-8b"}.get(args.model, args.model)
    if preset not in PRESETS or Path(args.model).is_dir():  # a directory of that name wins
        yield args.model
        return
    args.load_format = args.load_format or "dummy"
    with tempfile.TemporaryDirectory() as tmp:
        yield str(make_model_dir(Path(tmp) / preset, preset, embedded_vocab=True))
