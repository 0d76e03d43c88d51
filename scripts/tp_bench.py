"""Tensor parallelism on one host's GPUs: each measurement runs TP=1 and every TP=N of --tp (e.g. `--tp 2 4`) one
after another in one process (each engine is dropped before the next starts) and puts each TP=N against TP=1.

    python scripts/tp_bench.py parity MODEL [--tp 2 --dtypes bfloat16 float32]
        greedy tokens and their top-5 logprobs of TP=N against TP=1, next to TP=1's own spread (the same prompts one
        at a time against batched), per dtype: in bf16 TP=N should differ from TP=1 no more than TP=1 differs from
        itself; in float32 the tokens should be equal (tokens_equal).
    python scripts/tp_bench.py step MODEL [--tp 2 4 --batch 32 --context 8192]
        the decode step (engine.step() wall time, CUDA graphs, every rank's message included) of `batch` requests
        at `context` tokens: TP=N / TP=1 (the issue's targets on Llama-3.1-8B's shape: <= 0.6 at 2, <= 0.4 at 4).
    python scripts/tp_bench.py capacity MODEL [--tp 2 --context 131072 --gpu-memory-gb 40 --host-kv-gb 100]
        sparse (topk 2048) + KV offload + layer-segmented prefill, synchronous scheduling, under a per-GPU memory
        cap (host_kv_memory is per rank): requests filling a `context`-token window (prompt + output) keep
        arriving; the most running at once, and the decode step there (TP=2 should run twice TP=1's requests at no
        worse a step).
    python scripts/tp_bench.py message [--tp 2 4 --batch 32 --context 131072 --block-size 16]
        rank 0's step message over the gloo group (CPU, no model): its size and broadcast time for `batch` decodes
        at `context` tokens, carrying whole block tables (every step before) against a steady decode step's (the
        entries added since each sequence's last step, engine/parallel.py SentTables).
    python scripts/tp_bench.py serve-report OUT
        gpu_serve_check.sh's results in OUT (configs NAME and NAME_tpN of one load): throughput, TTFT, TPOT of
        each TP=N against TP=1 of the same config.

MODEL: a Hugging Face directory; benchmarks/model_dir.py writes Llama-3.1-8B's shape (random weights for
parity; --config-only for step and capacity, which load dummy weights). --json writes the rows, after each row
(a run stopped by a time limit keeps what it measured). --device cpu runs the same on CPU ranks (gloo; tests).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sparseserve.bench.hardware import print_table
from sparseserve.bench.steps import StepLog
from sparseserve.distributed.group import exit_if_end_stuck
from sparseserve.engine.engine import LLMEngine
from sparseserve.sampling_params import SamplingParams


def engine(args, tp: int, log: StepLog | None = None, **kw) -> LLMEngine:
    gc.collect()  # the previous engine's memory must be back (engines hold reference cycles)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    kw = {"dtype": args.dtype, **kw}
    return LLMEngine.from_kwargs(log, model=args.model, device=args.device, tensor_parallel_size=tp, **kw)


def drop(e: LLMEngine) -> None:
    if hasattr(e.model_runner, "shutdown"):
        e.model_runner.shutdown()


def sync(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def prompts(n: int, length: int, seed: int = 0, vocab: int = 32000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(100, vocab // 2), min(vocab, 32000), (n, length), generator=g).tolist()


def vocab_of(model: str) -> int:
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def run_all(e: LLMEngine, reqs: list[list[int]], params: SamplingParams) -> list:
    """Each request's whole output (the engine's steps return deltas: folded here)."""
    for i, p in enumerate(reqs):
        e.add_request(str(i), p, params)
    outs: dict[str, Any] = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.request_id in outs:
                outs[o.request_id].add(o)
            else:
                outs[o.request_id] = o
    return [outs[str(i)].outputs[0] for i in range(len(reqs))]


def compare(a: list, b: list) -> dict:
    """Greedy outputs a vs b: tokens equal up to the first divergence; before it, the largest logprob difference
    of the chosen token and of any token in both top-k lists, and the share of positions with the same top-k; at
    each divergence, the gap between a's two best logprobs there (a gap within the rounding of max_dlogprob is a
    near tie flipped by that rounding, not a different computation)."""
    first, dlp, dtop, same_top, positions, same, gaps = [], 0.0, 0.0, 0, 0, 0, []
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), len(x.token_ids))
        first.append(n)
        same += n == len(x.token_ids) == len(y.token_ids)
        if n < min(len(x.token_ids), len(y.token_ids)):
            best = sorted((lp.logprob for lp in x.logprobs[n].values()), reverse=True)
            gaps.append(best[0] - best[1] if len(best) > 1 else float("inf"))
        for i in range(n):
            lx, ly = x.logprobs[i], y.logprobs[i]
            t = x.token_ids[i]
            dlp = max(dlp, abs(lx[t].logprob - ly[t].logprob))
            dtop = max([dtop] + [abs(lx[k].logprob - ly[k].logprob) for k in lx.keys() & ly.keys()])
            same_top += lx.keys() == ly.keys()
            positions += 1
    return {
        "identical_seqs": f"{same}/{len(a)}",
        "tokens_equal": same == len(a),
        "first_divergence_min": min(first),
        "first_divergence_mean": sum(first) / len(first),
        "max_dlogprob": dlp,
        "max_dlogprob_topk": dtop,
        "same_topk_share": same_top / positions if positions else None,
        "divergence_gap_max": max(gaps) if gaps else None,
    }


def parity(args, emit: Callable[[dict], None]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=5)
    reqs = prompts(args.num_prompts, args.prompt_len, vocab=vocab_of(args.model))
    kw = dict(max_model_len=args.prompt_len + args.max_tokens + 64, max_num_seqs=args.num_prompts)
    for dtype in args.dtypes:
        e = engine(args, 1, **kw, dtype=dtype)
        tp1 = run_all(e, reqs, params)
        tp1_single = [run_all(e, [p], params)[0] for p in reqs]
        drop(e)
        e = None
        emit({"dtype": dtype, "compare": "TP=1 one at a time vs TP=1 batched (the spread)", **compare(tp1, tp1_single)})
        for tp in args.tp:
            e = engine(args, tp, **kw, dtype=dtype)
            tpn = run_all(e, reqs, params)
            drop(e)
            e = None
            emit({"dtype": dtype, "compare": f"TP={tp} batched vs TP=1 batched", **compare(tp1, tpn)})


def step(args, emit: Callable[[dict], None]) -> None:
    """Each scheduling mode's steady decode step at TP=1 then each TP=N, against its TP=1. sync: each
    step timed alone (the host's work on the critical path); async: steps back to back with async
    scheduling (the host schedules step N+1 while N runs), the time between two steps' ends."""
    for mode in args.modes:
        base = None
        for tp in [1, *args.tp]:
            log = StepLog()
            e = engine(
                args,
                tp,
                log,
                load_format="dummy",
                max_model_len=args.context + args.steps + 64,
                max_num_seqs=args.batch,
                max_num_batched_tokens=16384,
                async_scheduling=mode == "async",
            )
            params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
            for i, p in enumerate(prompts(args.batch, args.context, vocab=vocab_of(args.model))):
                e.add_request(str(i), p, params)
            times = []
            sync(args)
            t0 = time.perf_counter()
            while e.has_unfinished_requests() and len(times) < args.steps:
                if mode == "sync":
                    sync(args)
                    t0 = time.perf_counter()
                e.step()
                t1 = time.perf_counter()
                if log.last.pure_decode(args.batch):
                    times.append(t1 - t0)
                t0 = t1
            drop(e)
            e = None
            times = sorted(times[3:])  # the first decode steps warm up
            row = {
                "mode": mode,
                "tp": tp,
                "batch": args.batch,
                "context": args.context,
                "steps": len(times),
                "step_ms_median": 1e3 * times[len(times) // 2],
                "step_ms_mean": 1e3 * sum(times) / len(times),
            }
            base = base or row["step_ms_median"]
            emit({**row, "vs TP=1": row["step_ms_median"] / base})


def capacity(args, emit: Callable[[dict], None]) -> None:
    requests = args.requests or [args.requests_tp1 * tp for tp in args.tp]
    if len(requests) != len(args.tp):
        raise SystemExit(f"--requests: one count per --tp size ({args.tp}), got {requests}")
    cap = {}
    if args.device == "cuda" and args.gpu_memory_gb:
        cap = dict(gpu_memory_utilization=args.gpu_memory_gb * 1e9 / torch.cuda.get_device_properties(0).total_memory)
    base = None
    for tp, n in [(1, args.requests_tp1), *zip(args.tp, requests)]:
        log = StepLog()
        e = engine(
            args,
            tp,
            log,
            load_format="dummy",
            max_model_len=args.context,  # the model's window (Llama-3.1: 131072), the output inside it
            max_num_seqs=n,
            max_num_batched_tokens=16384,
            sparse_policy="topk",
            sparse_budget=args.sparse_budget,
            sparse_reuse=args.reuse,
            kv_offload=True,
            host_kv_memory=int(args.host_kv_gb * 1e9),
            # SparseServe mode's prefill: a layer's KV at a time on the device (a plain chunked prefill of a 128K
            # prompt holds every sparse layer's KV of it, 16 GB at TP=1, and leaves the pool one working set)
            layer_segmented_prefill=not args.chunked_prefill,
            async_scheduling=False,  # each decode step timed alone
            **cap,
        )
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        for i, p in enumerate(prompts(n, args.context - args.output_len, vocab=vocab_of(args.model))):
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
        row = {
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
        e.abort_request([str(i) for i in range(n)])
        drop(e)
        e = None
        base = base or row
        emit(
            {
                **row,
                "running vs TP=1": most / max(base["max_running"], 1),
                "step vs TP=1": row["decode_step_ms"] / base["decode_step_ms"],
            }
        )


# ---- serve-report: gpu_serve_check.sh's runs, TP=N against TP=1 -------------------------------------------------

_TP = re.compile(r"^(?P<name>.+?)(?:_tp(?P<tp>\d+))?$")


def message(args, emit: Callable[[dict], None]) -> None:
    from sparseserve.bench.tp_message import measure

    for tp in args.tp:
        for row in measure(tp, args.batch, args.context, args.block_size):
            emit({"tp": tp, **row})


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def serve_rows(folder: Path) -> list[dict[str, Any]]:
    """One row per run of a config at some TP (config NAME: TP=1, NAME_tpN: TP=N), ratios against TP=1 of the
    same config, outputs and load, and throughput against dense at the same TP (the 70B runs have no TP=1)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the checkout's benchmarks/
    from benchmarks.serve_ladder import load_runs

    runs = []
    for r in load_runs(folder):
        m = _TP.match(r["config"])
        runs.append({**r, "name": m["name"], "tp": int(m["tp"] or 1)})
    runs.sort(key=lambda r: (r["outputs"], r["load"], r["name"], r["tp"]))
    by = {(b["outputs"], b["load"], b["name"], b["tp"]): b["summary"] for b in runs}
    rows = []
    for r in runs:
        s = r["summary"]
        key = (r["outputs"], r["load"], r["name"])
        base, dense = by.get((*key, 1)), by.get((*key[:2], "dense", r["tp"]))
        rows.append(
            {
                "outputs": r["outputs"],
                "load": r["load"],
                "config": r["name"],
                "tp": r["tp"],
                "done": f"{s['completed']}/{s['completed'] + s['failed']}",
                "out tok/s": s["output_throughput"],
                "x TP=1": ratio(s["output_throughput"], base and base["output_throughput"]),
                "x dense": ratio(s["output_throughput"], dense and dense["output_throughput"]),
                "TTFT s": s["ttft_ms"]["mean"] / 1e3,
                "p99 TTFT s": s["ttft_ms"]["p99"] / 1e3,
                "TTFT / TP=1": ratio(s["ttft_ms"]["mean"], base and base["ttft_ms"]["mean"]),
                "TPOT ms": s["tpot_ms"]["mean"],
                "TPOT / TP=1": ratio(s["tpot_ms"]["mean"], base and base["tpot_ms"]["mean"]),
                "E2E s": s["e2e_ms"]["mean"] / 1e3,
                "goodput req/s": s["goodput"],
                "preempt": r["metrics"].get("sparseserve:num_preemptions_total"),
            }
        )
    return rows


def serve_report(args) -> None:
    rows = serve_rows(Path(args.model))
    if not rows:
        raise SystemExit(f"no serve_<config>_<load>_<outputs>.json in {args.model}")
    print_table(rows, "tensor parallelism: serving, TP=N against TP=1 of the same config and load")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": datetime.date.today().isoformat(), "rows": rows}, indent=1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["parity", "step", "capacity", "message", "serve-report"])
    p.add_argument("model", nargs="?", help="the model directory (serve-report: the results folder; message: none)")
    p.add_argument("--tp", type=int, nargs="+", default=[2], help="the TP sizes measured against TP=1")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", default="bfloat16", help="step, capacity")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], help="parity")
    p.add_argument("--num-prompts", type=int, default=8, help="parity")
    p.add_argument("--prompt-len", type=int, default=1024, help="parity")
    p.add_argument("--max-tokens", type=int, default=64, help="parity")
    p.add_argument("--batch", type=int, default=32, help="step, message")
    p.add_argument("--block-size", type=int, default=16, help="message")
    p.add_argument("--context", type=int, default=None, help="step (8192); capacity (131072: prompt + output)")
    p.add_argument("--steps", type=int, default=40, help="step: decode steps timed")
    p.add_argument("--modes", nargs="+", choices=["sync", "async"], default=["sync", "async"], help="step")
    p.add_argument("--gpu-memory-gb", type=float, default=40.0, help="capacity: per GPU (0: the engine's default)")
    p.add_argument("--host-kv-gb", type=float, default=100.0, help="capacity: host store per rank (GB)")
    p.add_argument("--requests-tp1", type=int, default=8, help="capacity: requests offered to TP=1")
    p.add_argument("--requests", type=int, nargs="+", default=None, help="capacity: to each TP=N (N x TP=1's)")
    p.add_argument("--output-len", type=int, default=4096, help="capacity: long enough that none finishes")
    p.add_argument("--plateau", type=int, default=48, help="capacity: decode steps without an admission = full")
    p.add_argument("--reuse", type=int, default=8, help="capacity: sparse_reuse")
    p.add_argument(
        "--chunked-prefill", action="store_true", help="capacity: plain chunked prefill (default: layer-segmented)"
    )
    p.add_argument("--sparse-budget", type=int, default=2048, help="capacity: tokens a sparse decode reads")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.context = args.context or (8192 if args.what == "step" else 131072)
    if args.model is None and args.what != "message":
        p.error(f"{args.what} needs a model directory")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.what == "serve-report":
        serve_report(args)
        return []
    if args.what == "message":
        args.device = "cpu"  # gloo between processes of this host, no model
    if args.device == "cuda" and torch.cuda.device_count() < max(args.tp):
        raise SystemExit(f"needs {max(args.tp)} GPUs, {torch.cuda.device_count()} visible")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            info = {"device": device, "date": datetime.date.today().isoformat(), "args": vars(args), "rows": rows}
            Path(args.json).write_text(json.dumps(info, indent=1))

    {"parity": parity, "step": step, "capacity": capacity, "message": message}[args.what](args, emit)
    print_table(rows, f"tensor parallelism: {args.what} ({device}, TP=1 and {args.tp})")
    return rows


if __name__ == "__main__":
    main()
    exit_if_end_stuck()  # an NCCL group whose end blocked: exit without its destructors (they abort)
