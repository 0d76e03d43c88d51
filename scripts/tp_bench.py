"""Tensor parallelism on one host's GPUs (needs tensor_parallel_size of them): each measurement runs TP=N and
TP=1 side by side in one process (the TP=1 engine on GPU 0 is dropped before the TP=N one starts).

    python scripts/tp_bench.py parity MODEL [--tp 2]
        bf16 greedy tokens and their logprobs (top 5) of TP=N against TP=1, next to TP=1's own spread (the same
        prompts one at a time against batched): TP=N should differ from TP=1 no more than TP=1 differs from itself.
    python scripts/tp_bench.py step MODEL [--tp 2 --batch 32 --context 8192]
        the decode step (engine.step() wall time, CUDA graphs, every rank's message included) of `batch` requests
        at `context` tokens: TP=N / TP=1 (the issue's target: <= 0.6 at TP=2 on Llama-3.1-8B's shape).
    python scripts/tp_bench.py capacity MODEL [--tp 2 --context 131072 --gpu-memory-gb 40 --host-kv-gb 100]
        sparse (topk 2048) + KV offload under a per-GPU memory cap (host_kv_memory is per rank): requests of
        `context` tokens keep arriving; the most running at once, and the decode step there (TP=2 should run
        twice TP=1's requests).

MODEL: a Hugging Face directory; benchmarks/model_dir.py writes Llama-3.1-8B's shape (random weights for
parity; --config-only for step and capacity, which load dummy weights). --json writes the rows.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import time

import torch

from sparseserve.bench.hardware import print_table
from sparseserve.bench.steps import StepLog
from sparseserve.engine.engine import LLMEngine
from sparseserve.sampling_params import SamplingParams


def engine(model: str, tp: int, log: StepLog | None = None, **kw) -> LLMEngine:
    gc.collect()  # the previous engine's memory must be back (engines hold reference cycles)
    torch.cuda.empty_cache()
    return LLMEngine.from_kwargs(log, model=model, dtype="bfloat16", tensor_parallel_size=tp, **kw)


def drop(e: LLMEngine) -> None:
    if hasattr(e.model_runner, "shutdown"):
        e.model_runner.shutdown()


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 32000, (n, length), generator=g).tolist()


def run_all(e: LLMEngine, reqs: list[list[int]], params: SamplingParams) -> list:
    for i, p in enumerate(reqs):
        e.add_request(str(i), p, params)
    done = {}
    while e.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in e.step() if o.finished})
    return [done[str(i)] for i in range(len(reqs))]


def compare(a: list, b: list) -> dict:
    """Greedy outputs a vs b: tokens equal up to the first divergence, and the largest logprob difference of the
    chosen token before it."""
    first, dlp, same = [], 0.0, 0
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), len(x.token_ids))
        first.append(n)
        same += n == len(x.token_ids)
        for i in range(n):
            t = x.token_ids[i]
            dlp = max(dlp, abs(x.logprobs[i][t].logprob - y.logprobs[i][t].logprob))
    return {
        "identical_seqs": f"{same}/{len(a)}",
        "first_divergence_min": min(first),
        "first_divergence_mean": sum(first) / len(first),
        "max_dlogprob": dlp,
    }


def parity(args) -> list[dict]:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=5)
    reqs = prompts(args.num_prompts, args.prompt_len)
    kw = dict(max_model_len=args.prompt_len + args.max_tokens + 64, max_num_seqs=args.num_prompts)
    e = engine(args.model, 1, **kw)
    tp1 = run_all(e, reqs, params)
    tp1_single = [run_all(e, [p], params)[0] for p in reqs]
    drop(e)
    e = None
    e = engine(args.model, args.tp, **kw)
    tpn = run_all(e, reqs, params)
    drop(e)
    return [
        {"compare": "TP=1 one at a time vs TP=1 batched (the spread)", **compare(tp1, tp1_single)},
        {"compare": f"TP={args.tp} batched vs TP=1 batched", **compare(tp1, tpn)},
    ]


def step(args) -> list[dict]:
    rows = []
    for tp in (1, args.tp):
        log = StepLog()
        e = engine(
            args.model,
            tp,
            log,
            load_format="dummy",
            max_model_len=args.context + args.steps + 64,
            max_num_seqs=args.batch,
            max_num_batched_tokens=16384,
        )
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
        for i, p in enumerate(prompts(args.batch, args.context)):
            e.add_request(str(i), p, params)
        times = []
        while e.has_unfinished_requests() and len(times) < args.steps:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            e.step()
            dt = time.perf_counter() - t0
            if log.last.pure_decode(args.batch):
                times.append(dt)
        drop(e)
        e = None
        times = sorted(times[3:])  # the first decode steps warm up
        rows.append(
            {
                "tp": tp,
                "batch": args.batch,
                "context": args.context,
                "steps": len(times),
                "step_ms_median": 1e3 * times[len(times) // 2],
                "step_ms_mean": 1e3 * sum(times) / len(times),
            }
        )
    rows[-1]["vs TP=1"] = rows[-1]["step_ms_median"] / rows[0]["step_ms_median"]
    return rows


def capacity(args) -> list[dict]:
    total = torch.cuda.get_device_properties(0).total_memory
    rows = []
    for tp, n in ((1, args.requests_tp1), (args.tp, args.requests)):
        log = StepLog()
        e = engine(
            args.model,
            tp,
            log,
            load_format="dummy",
            max_model_len=args.context + args.output_len,
            max_num_seqs=n,
            max_num_batched_tokens=16384,
            gpu_memory_utilization=args.gpu_memory_gb * 1e9 / total,
            sparse_policy="topk",
            sparse_budget=2048,
            sparse_reuse=args.reuse,
            kv_offload=True,
            host_kv_memory=int(args.host_kv_gb * 2**30),
        )
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        for i, p in enumerate(prompts(n, args.context)):
            e.add_request(str(i), p, params)
        most, since, decode = 0, 0, []
        t0 = time.perf_counter()
        # Until every request runs, or admissions stop: `plateau` decode steps without a new one running.
        while e.get_stats().num_waiting and since < args.plateau and e.has_unfinished_requests():
            ts = time.perf_counter()
            e.step()
            dt = time.perf_counter() - ts
            if log.last.pure_decode():
                decode.append(dt)
            running = e.get_stats().num_running
            since = 0 if running > most else since + 1
            most = max(most, running)
        stats = e.get_stats(sync=True)
        tail = sorted(decode[-args.plateau // 2 :]) or [float("nan")]
        rows.append(
            {
                "tp": tp,
                "requests": n,
                "max_running": most,
                "all_admitted": not stats.num_waiting,
                "preemptions": stats.num_preemptions,
                "decode_step_ms": 1e3 * tail[len(tail) // 2],
                "host_blocks": stats.offload_host_blocks,
                "device_blocks": stats.offload_device_blocks,
                "hbm_slots": stats.offload_hbm_slots,
                "seconds": time.perf_counter() - t0,
            }
        )
        e.abort_request([str(i) for i in range(n)])
        drop(e)
        e = None
    rows[-1]["vs TP=1"] = rows[-1]["max_running"] / max(rows[0]["max_running"], 1)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["parity", "step", "capacity"])
    p.add_argument("model")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=8, help="parity")
    p.add_argument("--prompt-len", type=int, default=1024, help="parity")
    p.add_argument("--max-tokens", type=int, default=64, help="parity")
    p.add_argument("--batch", type=int, default=32, help="step")
    p.add_argument("--context", type=int, default=None, help="step (8192), capacity (131072)")
    p.add_argument("--steps", type=int, default=40, help="step: decode steps timed")
    p.add_argument("--gpu-memory-gb", type=float, default=40.0, help="capacity: per GPU")
    p.add_argument("--host-kv-gb", type=float, default=100.0, help="capacity: host store per rank")
    p.add_argument("--requests-tp1", type=int, default=8, help="capacity: requests offered to TP=1")
    p.add_argument("--requests", type=int, default=16, help="capacity: requests offered to TP=N")
    p.add_argument("--output-len", type=int, default=4096, help="capacity: long enough that none finishes")
    p.add_argument("--plateau", type=int, default=48, help="capacity: decode steps without an admission = full")
    p.add_argument("--reuse", type=int, default=8, help="capacity: sparse_reuse")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if torch.cuda.device_count() < args.tp:
        raise SystemExit(f"needs {args.tp} GPUs, {torch.cuda.device_count()} visible")
    args.context = args.context or (8192 if args.what == "step" else 131072)
    rows = {"parity": parity, "step": step, "capacity": capacity}[args.what](args)
    print_table(rows, f"tensor parallelism: {args.what} ({torch.cuda.get_device_name()} x {args.tp})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "date": datetime.date.today().isoformat(),
                    "args": vars(args),
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
