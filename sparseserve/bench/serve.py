"""`sparseserve bench serve`: load generator for any OpenAI-compatible server (SparseServe, vLLM, SGLang).

Streams completions over httpx, with Poisson arrivals at one or several rates (fixed lengths, or LongBench's
request mix: workloads/longbench.py) or a replayed Mooncake trace, and reports TTFT, TPOT, ITL and end-to-end
latency (mean, p50, p90, p99), request and token throughput, and goodput under SLOs. Prompts come from the
haystack essays (workloads/datasets.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from sparseserve.workloads import longbench
from sparseserve.workloads.datasets import PromptBuilder, haystack_corpus, load_trace
from sparseserve.config import parse_size


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    prompt_len: int  # intended length; the server's usage count is reported when it sends one
    output_len: int
    arrival_s: float  # seconds after the start of the run


@dataclass
class RequestResult:
    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _payload(args: argparse.Namespace, model: str, spec: RequestSpec, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], spec: RequestSpec) -> RequestResult:
    res = RequestResult(prompt_tokens=spec.prompt_len)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"])
                    return res
                if msg.get("usage"):
                    res.prompt_tokens = msg["usage"]["prompt_tokens"]
                    res.output_tokens = msg["usage"]["completion_tokens"]
                choice = (msg.get("choices") or [{}])[0]
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
        res.e2e = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks  # servers without usage: one token a chunk
        res.success = chunks > 0 or res.output_tokens > 0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(
    client: httpx.AsyncClient,
    url: str,
    bodies: list[dict[str, Any]],
    specs: list[RequestSpec],
    max_concurrency: int | None,
) -> tuple[list[RequestResult], float]:
    """Sends each request at its arrival time; returns the results and the wall time of the run."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(body: dict[str, Any], spec: RequestSpec) -> RequestResult:
        await asyncio.sleep(max(0.0, start + spec.arrival_s - time.perf_counter()))
        if gate is None:
            return await send_request(client, url, body, spec)
        async with gate:
            return await send_request(client, url, body, spec)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(b, s) for b, s in zip(bodies, specs)))
    return list(results), time.perf_counter() - start


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return list(np.cumsum(gaps) - gaps[0])  # the first request leaves at once


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}}


def summarize(results: list[RequestResult], duration: float, slo_ms: dict[str, float]) -> dict[str, Any]:
    """Latencies in milliseconds; throughputs per second of wall time; goodput counts the requests
    that met every given SLO (ttft, tpot, e2e)."""
    ok = [r for r in results if r.success]
    tpot = {id(r): (r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1}
    good = [
        r
        for r in ok
        if (
            r.ttft * 1e3 <= slo_ms.get("ttft", math.inf)
            and tpot.get(id(r), 0.0) * 1e3 <= slo_ms.get("tpot", math.inf)
            and r.e2e * 1e3 <= slo_ms.get("e2e", math.inf)
        )
    ]
    prompt_tokens, output_tokens = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "goodput": len(good) / duration if slo_ms else None,
        "slo_ms": slo_ms,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(list(tpot.values())),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2e_ms": _stats([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def plot(runs: list[dict[str, Any]], path: str | Path) -> None:
    """Latency and throughput against the offered request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [str(r["request_rate"]) for r in runs]  # categorical axis: "inf" sits after the finite rates
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        for q, style in (("p50", "-o"), ("p99", "--x")):
            lat.plot(rates, [r[key][q] for r in runs], style, label=f"{label} {q}")
    lat.set(xlabel="request rate (req/s)", ylabel="latency (ms)", yscale="log", title="Latency")
    lat.legend(fontsize=7)
    thr.plot(rates, [r["output_throughput"] for r in runs], "-o", label="output tok/s")
    thr.plot(rates, [r["total_token_throughput"] for r in runs], "-s", label="total tok/s")
    thr.set(xlabel="request rate (req/s)", ylabel="tokens/s", title="Throughput")
    thr.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def _calibrate_chars_per_token(client: httpx.AsyncClient, base: str, model: str) -> float:
    """Without a tokenizer: one probe through /v1/completions, its usage gives the ratio."""
    probe = haystack_corpus()[:1500]  # a few hundred tokens: fits any context
    r = await client.post(f"{base}/v1/completions", json={"model": model, "prompt": probe, "max_tokens": 1})
    r.raise_for_status()
    return len(probe) / r.json()["usage"]["prompt_tokens"]


def _specs(args: argparse.Namespace, builder: PromptBuilder, rate: float | None) -> list[RequestSpec]:
    if args.trace:
        trace = load_trace(args.trace, args.num_prompts, args.trace_time_scale, args.max_input_len, args.max_output_len)
        return [
            RequestSpec(
                builder.trace_prompt(list(t.hash_ids), t.input_length, args.seed),
                t.input_length,
                args.trace_output_len or t.output_length,
                t.arrival_s,
            )
            for t in trace
        ]
    arrivals = poisson_arrivals(args.num_prompts, rate, args.seed)
    if args.dataset == "longbench":  # the same requests at every rate; only the arrivals differ
        reqs = longbench.sample_requests(
            args.num_prompts,
            args.seed,
            args.longbench_tokenizer,
            args.max_input_len,
            args.longbench_output,
            args.trace_output_len,
        )
        return [
            RequestSpec(
                builder.prompt(r.full_len, f"{args.seed}:lb:{i}", keep=r.prompt_len), r.prompt_len, r.output_len, t
            )
            for i, (r, t) in enumerate(zip(reqs, arrivals))
        ]
    return [
        RequestSpec(builder.prompt(args.input_len, f"{args.seed}:{i}"), args.input_len, args.output_len, t)
        for i, t in enumerate(arrivals)
    ]


_CACHE_COUNTERS = (
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "host_prefix_cache_queries_total",
    "host_prefix_cache_hits_total",
)


async def _cache_counters(client: httpx.AsyncClient, base: str) -> dict[str, float] | None:
    """The server's cumulative prefix-cache counters from /metrics (SparseServe's names, or vLLM's), None when
    it exposes none."""
    from sparseserve.metrics import parse_metrics

    try:
        r = await client.get(f"{base}/metrics")
        r.raise_for_status()
        metrics = parse_metrics(r.text)
    except (httpx.HTTPError, ValueError):
        return None
    for ns in ("sparseserve", "vllm"):
        if f"{ns}:prefix_cache_queries_total" in metrics:
            return {name: metrics.get(f"{ns}:{name}", 0.0) for name in _CACHE_COUNTERS}
    return None


def cache_hit_rates(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """Prefix-cache hit rates of a run from the counters' deltas: tokens found / prompt tokens looked up (the
    device cache, the host tier for what it missed, and both together)."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in _CACHE_COUNTERS}
    q, hq = d["prefix_cache_queries_total"], d["host_prefix_cache_queries_total"]
    hits, host_hits = d["prefix_cache_hits_total"], d["host_prefix_cache_hits_total"]
    return {
        "queries": q,
        "hits": hits,
        "host_hits": host_hits,
        "hit_rate": hits / q if q else 0.0,
        "host_hit_rate": host_hits / hq if hq else 0.0,
        "total_hit_rate": (hits + host_hits) / q if q else 0.0,
    }


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    chat = args.endpoint.endswith("chat/completions")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        if args.tokenizer:
            from transformers import AutoTokenizer

            builder = PromptBuilder(AutoTokenizer.from_pretrained(args.tokenizer))
        else:
            builder = PromptBuilder(chars_per_token=await _calibrate_chars_per_token(client, base, model))
        runs = []
        for rate in [None] if args.trace else args.request_rate:
            specs = _specs(args, builder, rate)
            bodies = [_payload(args, model, s, chat) for s in specs]
            cache_before = await _cache_counters(client, base)
            results, duration = await run_load(client, base + args.endpoint, bodies, specs, args.max_concurrency)
            summary = {
                "request_rate": rate if rate is None or math.isfinite(rate) else "inf",
                **summarize(results, duration, dict(args.slo)),
                "prefix_cache": cache_hit_rates(cache_before, await _cache_counters(client, base)),
                # what was asked (arrival s, prompt tokens, output tokens): the report's workload bounds
                "workload": [[s.arrival_s, s.prompt_len, s.output_len] for s in specs],
            }
            if args.save_details:
                summary["requests"] = [asdict(r) for r in results]
            runs.append(summary)
            _print_summary(summary)
    return {
        "base_url": base,
        "endpoint": args.endpoint,
        "model": model,
        "trace": args.trace,
        "dataset": None if args.trace else args.dataset,
        "seed": args.seed,
        "exact_prompt_lengths": args.tokenizer is not None,
        "runs": runs,
    }


def _print_summary(s: dict[str, Any]) -> None:
    print(
        f"rate={s['request_rate']} completed={s['completed']} failed={s['failed']} "
        f"duration={s['duration_s']:.2f}s req/s={s['request_throughput']:.2f} "
        f"out tok/s={s['output_throughput']:.1f} goodput={s['goodput']}"
    )
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        print(f"  {key:8s} " + " ".join(f"{q}={v:.1f}" for q, v in s[key].items()))
    cache = s.get("prefix_cache")
    if cache is not None:
        print(
            f"  prefix cache hit rate {100 * cache['hit_rate']:.1f}% of {cache['queries']:.0f} prompt tokens "
            f"(host tier {100 * cache['host_hit_rate']:.1f}% of the rest; "
            f"together {100 * cache['total_hit_rate']:.1f}%)"
        )
    for e in s["errors"]:
        print(f"  error: {e}")


def _slo(text: str) -> tuple[str, float]:
    name, _, ms = text.partition(":")
    name = {"e2el": "e2e"}.get(name, name)  # vLLM's name of the end-to-end latency
    if name not in ("ttft", "tpot", "e2e") or not ms:
        raise argparse.ArgumentTypeError("SLOs look like ttft:500 tpot:50 e2e:10000 (milliseconds)")
    return name, float(ms)


def _count(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags; where vLLM's `bench serve` names one differently, its name is an alias."""
    p = parser.add_argument
    p("--base-url", default="http://127.0.0.1:8000", help="Server root (default: %(default)s).")
    p(
        "--endpoint",
        default="/v1/completions",
        choices=["/v1/completions", "/v1/chat/completions"],
        help="API to load (default: %(default)s).",
    )
    p("--model", default=None, help="Model name to request (default: the first of /v1/models).")
    p("--api-key", default=None, help="Sent as 'Authorization: Bearer KEY' (default: none).")
    p(
        "--tokenizer",
        default=None,
        help="Tokenizer dir for exact prompt lengths (default: calibrate the "
        "characters per token from the server's usage counts).",
    )
    p(
        "--request-rate",
        type=float,
        nargs="+",
        default=[math.inf],
        help="Poisson arrival rate(s) in requests/s; several run one after another; inf sends all at once "
        "(default: inf).",
    )
    p(
        "--num-prompts",
        type=int,
        default=100,
        help="Requests per rate, or trace records to replay (default: %(default)s).",
    )
    p(
        "--input-len",
        "--random-input-len",
        dest="input_len",
        type=_count,
        default=1024,
        help="Prompt tokens of each Poisson request; 1k, 4K work (default: %(default)s).",
    )
    p(
        "--output-len",
        "--random-output-len",
        dest="output_len",
        type=_count,
        default=128,
        help="max_tokens of each Poisson request (default: %(default)s).",
    )
    p(
        "--dataset",
        "--dataset-name",
        dest="dataset",
        default="random",
        choices=["random", "longbench"],
        help="Poisson requests: random (--input-len / --output-len) or longbench (LongBench v1's mix of datasets, "
        "prompt and output lengths; workloads/longbench.py) (default: %(default)s).",
    )
    p(
        "--longbench-tokenizer",
        default="llama3",
        choices=list(longbench.TOKENIZERS),
        help="longbench: prompt lengths in this tokenizer's counts (llama2: LWM-7B, Llama-2-7B) "
        "(default: %(default)s).",
    )
    p(
        "--longbench-output",
        default="max",
        choices=list(longbench.OUTPUTS),
        help="longbench: output lengths, the dataset's cap (max, with --ignore-eos) or a real model's mean "
        "(default: %(default)s).",
    )
    p("--trace", default=None, help="Replay a Mooncake trace (jsonl) instead of Poisson arrivals (default: none).")
    p(
        "--trace-time-scale",
        type=float,
        default=1.0,
        help="Multiplies trace inter-arrival times; 0.1 replays 10x faster (default: %(default)s).",
    )
    p(
        "--max-input-len",
        type=_count,
        default=None,
        help="Cap on trace and longbench prompt lengths (longbench cuts the prompt's middle; default: none).",
    )
    p("--max-output-len", type=_count, default=None, help="Cap on trace output lengths (default: none).")
    p(
        "--trace-output-len",
        type=_count,
        default=None,
        help="Every trace or longbench request asks for exactly this many tokens instead of its own output length, "
        "for a decode-heavy run of the same arrivals and prompts (default: the requests').",
    )
    p("--max-concurrency", type=int, default=None, help="At most this many requests in flight (default: no cap).")
    p("--temperature", type=float, default=0.0, help="Sampling temperature (default: %(default)s, greedy).")
    p(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Ask for exactly max_tokens tokens (vLLM/SGLang extension; default: on).",
    )
    p(
        "--slo",
        "--goodput",
        dest="slo",
        type=_slo,
        nargs="*",
        default=[],
        help="Goodput SLOs in ms, e.g. ttft:500 tpot:50 e2e:10000 (e2el works too; default: none, no goodput).",
    )
    p("--seed", type=int, default=0, help="Seed of prompts, arrivals and sampling (default: %(default)s).")
    p("--timeout", type=float, default=600.0, help="Per-request timeout in seconds (default: %(default)s).")
    p("--output-json", default=None, help="Write the results here (default: none; see --save-result).")
    p(
        "--save-result",
        action="store_true",
        help="Write the results to --result-dir/--result-filename when no --output-json is given (default: off).",
    )
    p("--result-dir", default=".", help="Folder of --save-result (default: the working directory).")
    p("--result-filename", default=None, help="File name of --save-result (default: serve-<endpoint>-<date>.json).")
    p(
        "--plot",
        default=None,
        help="Latency/throughput-vs-rate plot (PNG) when several rates run "
        "(default: next to the JSON results, if any).",
    )
    p(
        "--save-details",
        "--save-detailed",
        dest="save_details",
        action="store_true",
        help="Include per-request results in the JSON (default: off).",
    )


def output_path(args: argparse.Namespace) -> Path | None:
    """--output-json, else with --save-result the vLLM-style --result-dir / --result-filename."""
    if args.output_json:
        return Path(args.output_json)
    if not args.save_result:
        return None
    name = args.result_filename or (
        f"serve-{args.endpoint.strip('/').replace('/', '-')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    return Path(args.result_dir) / name


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.trace and args.dataset != "random":
        raise ValueError(f"--trace replays its own requests: leave out --dataset {args.dataset}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the report
    out = output_path(args)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(run_benchmark(args))
    if out is not None:
        out.write_text(json.dumps(report, indent=2))
        print(f"results: {out}")
    plot_path = args.plot or (out.with_suffix(".png") if out is not None else None)
    if plot_path and len(report["runs"]) > 1:
        plot(report["runs"], plot_path)
    return report
