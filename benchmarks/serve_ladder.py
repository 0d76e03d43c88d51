"""The serving ladder report: `scripts/gpu_serve_check.sh` results as one table per (outputs, load).

Reads every `serve_<config>_<load>_<outputs>.json` (`bench serve --output-json`) and `metrics_<same>.txt` (the
server's /metrics after the run) in a folder. load: ts<scale> (the Mooncake trace at that time scale) or
rate<r> (Poisson arrivals at r requests/s, LongBench's mix); outputs: out<len> (the trace's output lengths
capped at len), fix<len> (every request asks for len tokens), lbmax / lbmean (LongBench's output caps, or its
mean outputs). For each config it prints throughput, TTFT, TPOT, E2E and goodput with the ratio against dense
of the same group, each step's gain over the config before it in the ladder, the HBM hit
ratio, preemptions, prompt tokens computed per prompt token, working-set hold-backs and prefills ahead. Beside
them, the workload's bound: every prompt prefilled at the prefill MFU (prompt blocks shared with an earlier request
cost nothing: ideal prefix caching) plus decode at the HBM roofline with all requests in one batch, reading
every cached token (dense) or at most the sparse budget per request (sparse), and never before the last arrival;
and the lowest mean TTFT (the same prefills served shortest-remaining-first, the optimum for one GPU).
The bound needs the requests: the trace (--trace) for ts loads, the requests a run recorded (bench serve's
"workload") for rate loads (no prefix sharing). Writes ladder.json and ladder.png (mean TTFT, mean TPOT and
output throughput against the request rate).

    python -m benchmarks.serve_ladder OUT --model MODEL_DIR [--trace TRACE]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sparseserve.workloads.datasets import TRACE_BLOCK_TOKENS, TraceRequest, load_trace
from sparseserve.bench.hardware import print_table

LADDER = ("dense", "sparse", "offload", "ws", "layerseg")
_RESULT = re.compile(
    r"serve_(?P<config>\w+?)_(?P<load>ts[\d.]+|rate(?:[\d.]+|inf))_"
    r"(?P<outputs>(?:out|fix)\d+|lbmax|lbmean)\.json$"
)
# Ceilings used when the run did not measure its own (hardware.json): H100 SXM's, and the prefill MFU
# the engine measured at 32K (docs/benchmarks/engine.md).
DEFAULT_HARDWARE = {"hbm_bytes_per_s": 2.96e12, "matmul_flops": 775e12}
DEFAULT_PREFILL_MFU = 0.68


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2

    @classmethod
    def from_model_dir(cls, path: Path) -> ModelShape:
        from sparseserve.models.config import ArchConfig
        from sparseserve.models.loader import load_hf_config

        a = ArchConfig.from_hf(load_hf_config(path))
        return cls(
            a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size, a.vocab_size
        )

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies (all but the embedding table): attention, MLP, LM head."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.intermediate) + self.hidden * self.vocab

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def prefill_flops(self, new: int, cached: int) -> float:
        """GEMMs plus causal attention (QK and PV) of `new` tokens after `cached` ones."""
        attn = 4 * self.layers * self.heads * self.head_dim * new * (cached + new / 2)
        return 2 * self.matmul_params * new + attn


def ideal_cached_tokens(trace: list[TraceRequest]) -> list[int]:
    """Prompt tokens each request finds cached when every earlier request's full blocks stay cached (a trace hash
    id names a block and its whole prefix); at least one token is always computed."""
    seen: set[int] = set()
    out = []
    for r in trace:
        n = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            n += 1
        out.append(min(n * TRACE_BLOCK_TOKENS, r.input_length - 1))
        seen.update(r.hash_ids[: r.input_length // TRACE_BLOCK_TOKENS])
    return out


def mean_ttft_bound(arrivals: list[float], work_s: list[float]) -> float:
    """The lowest mean TTFT one GPU could give: each prompt's prefill (`work_s` seconds of GPU time, nothing else
    running) served shortest-remaining-first, which minimizes the mean time from arrival to completion."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
    left = list(work_s)
    done: dict[int, float] = {}
    t, k, ready = 0.0, 0, []
    while len(done) < len(arrivals):
        while k < len(order) and arrivals[order[k]] <= t:
            heapq.heappush(ready, (left[order[k]], order[k]))
            k += 1
        if not ready:
            t = arrivals[order[k]]
            continue
        rem, i = heapq.heappop(ready)
        next_arrival = arrivals[order[k]] if k < len(order) else float("inf")
        run = min(rem, next_arrival - t)
        t += run
        if run >= rem:
            done[i] = t
        else:
            left[i] = rem - run
            heapq.heappush(ready, (left[i], i))
    return sum(done[i] - arrivals[i] for i in done) / len(done)


def workload_bound(
    trace: list[TraceRequest], shape: ModelShape, hw: dict[str, float], mfu: float, read_cap: int | None
) -> dict[str, float]:
    """Seconds of the whole run at the bound, the output throughput that implies, and the mean TTFT bound
    (see the module doc)."""
    cached = ideal_cached_tokens(trace)
    work = [shape.prefill_flops(r.input_length - c, c) / (mfu * hw["matmul_flops"]) for r, c in zip(trace, cached)]
    prefill_s = sum(work)
    weights = shape.matmul_params * shape.dtype_bytes
    decode_s = 0.0
    for step in range(max(r.output_length for r in trace)):
        active = [r.input_length + step for r in trace if r.output_length > step]
        kv = sum(n if read_cap is None else min(n, read_cap) for n in active) * shape.kv_bytes_per_token
        decode_s += (weights + kv) / hw["hbm_bytes_per_s"]
    total = max(prefill_s + decode_s, trace[-1].arrival_s)
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": total,
        "mean_ttft_s": mean_ttft_bound([r.arrival_s for r in trace], work),
        "output_throughput": sum(r.output_length for r in trace) / total,
        "prompt_tokens": sum(r.input_length for r in trace),
        "computed_prompt_tokens": sum(r.input_length - c for r, c in zip(trace, cached)),
    }


def _outputs_key(outputs: str) -> tuple[int, str]:
    digits = re.sub(r"\D", "", outputs)
    return int(digits) if digits else 0, outputs


def _load_key(load: str) -> tuple[str, float]:
    return load[:2], _load_value(load)


def _load_value(load: str) -> float:
    return float(load.removeprefix("ts").removeprefix("rate"))


def _metric(metrics: dict[str, float], name: str) -> float | None:
    return metrics.get(f"sparseserve:{name}")


def load_runs(folder: Path) -> list[dict[str, Any]]:
    from sparseserve.metrics import parse_metrics

    runs = []
    for path in sorted(folder.glob("serve_*.json")):
        m = _RESULT.search(path.name)
        if m is None:
            continue
        report = json.loads(path.read_text())
        metrics_path = path.with_name(path.name.replace("serve_", "metrics_", 1)).with_suffix(".txt")
        metrics = parse_metrics(metrics_path.read_text()) if metrics_path.exists() else {}
        load = m["load"]
        runs.append(
            {
                "config": m["config"],
                "load": load,
                "outputs": m["outputs"],
                "scale": _load_value(load) if load.startswith("ts") else None,
                "rate": _load_value(load) if load.startswith("rate") else None,
                "summary": report["runs"][0],
                "metrics": metrics,
            }
        )
    return runs


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None where either is missing or b is 0 (a run without the baseline)."""
    return a / b if a is not None and b else None


def ladder_rows(runs: list[dict[str, Any]], bounds: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """One row per run, ordered (outputs, load, ladder step); ratios against dense of the same group."""
    order = {c: i for i, c in enumerate(LADDER)}  # a variant (ws_wait, layerseg_async) follows its ladder step
    runs = sorted(
        runs,
        key=lambda r: (
            _outputs_key(r["outputs"]),
            _load_key(r["load"]),
            order.get(r["config"].split("_")[0], len(LADDER)),
            r["config"],
        ),
    )
    rows: list[dict[str, Any]] = []
    for run in runs:
        s, m = run["summary"], run["metrics"]
        key = (run["outputs"], run["load"])
        group = [r for r in runs if (r["outputs"], r["load"]) == key]
        dense = next((r["summary"] for r in group if r["config"] == "dense"), None)
        prev = rows[-1] if rows and (rows[-1]["outputs"], rows[-1]["load"]) == key else None
        hits, loads = _metric(m, "offload_hbm_hits_total"), _metric(m, "offload_head_blocks_loaded_total")
        bypass = _metric(m, "offload_bypass_reads_total") or 0.0
        misses = _metric(m, "offload_hbm_misses_total")
        if misses is None and hits is not None:  # a server from before the counter: every miss loaded or bypassed
            misses = (loads or 0.0) + bypass
        computed = _metric(m, "prompt_tokens_total")
        row = {
            "outputs": run["outputs"],
            "load": run["load"],
            "config": run["config"],
            "done": f"{s['completed']}/{s['completed'] + s['failed']}",
            "out tok/s": s["output_throughput"],
            "x dense": ratio(s["output_throughput"], dense and dense["output_throughput"]),
            "step gain": ratio(s["output_throughput"], prev and prev["out tok/s"]),
            "TTFT s": s["ttft_ms"]["mean"] / 1e3,
            "TTFT x lower": ratio(dense and dense["ttft_ms"]["mean"], s["ttft_ms"]["mean"]),
            "p99 TTFT s": s["ttft_ms"]["p99"] / 1e3,
            "TPOT ms": s["tpot_ms"]["mean"],
            "TPOT / dense": ratio(s["tpot_ms"]["mean"], dense and dense["tpot_ms"]["mean"]),
            "E2E s": s["e2e_ms"]["mean"] / 1e3,
            "E2E x lower": ratio(dense and dense["e2e_ms"]["mean"], s["e2e_ms"]["mean"]),
            "goodput req/s": s["goodput"],
            "goodput x dense": ratio(s["goodput"], dense and dense["goodput"]),
            "hit ratio": hits / (hits + misses) if hits is not None and hits + misses else None,
            "preempt": _metric(m, "num_preemptions_total"),
            "computed/prompt": ratio(computed, s["total_input_tokens"]),
            "hold-backs": _metric(m, "working_set_hold_backs_total"),
            "prefills ahead": _metric(m, "working_set_prefill_aheads_total"),
        }
        if bounds is not None:
            bound = bounds["dense" if run["config"] == "dense" else "sparse"]
            row["of bound"] = s["output_throughput"] / bound
        rows.append(row)
    return rows


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Mean TTFT, mean TPOT and output throughput against the offered request rate (run["rate"]), one line per
    (config, outputs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    runs = [r for r in runs if r["rate"] is not None and math.isfinite(r["rate"])]  # inf: all at once
    keys = sorted(
        {(r["config"], r["outputs"]) for r in runs},
        key=lambda k: (_outputs_key(k[1]), LADDER.index(k[0]) if k[0] in LADDER else len(LADDER)),
    )
    for config, out in keys:
        pts = sorted(
            ((r["rate"], r["summary"]) for r in runs if (r["config"], r["outputs"]) == (config, out)),
            key=lambda p: p[0],
        )
        rates = [p[0] for p in pts]
        label = f"{config} ({out})"
        axes[0].plot(rates, [p[1]["ttft_ms"]["mean"] / 1e3 for p in pts], "-o", label=label)
        axes[1].plot(rates, [p[1]["tpot_ms"]["mean"] for p in pts], "-o", label=label)
        axes[2].plot(rates, [p[1]["output_throughput"] for p in pts], "-o", label=label)
    for ax, title, unit in zip(axes, ("mean TTFT", "mean TPOT", "output throughput"), ("s", "ms", "tokens/s")):
        ax.set(xlabel="request rate (req/s)", ylabel=unit, title=title)
    axes[0].set_yscale("log")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def group_requests(
    args: argparse.Namespace, outputs: str, load: str, group: list[dict[str, Any]]
) -> list[TraceRequest] | None:
    """The group's requests for its bound: the trace at the load's time scale (outputs capped or fixed as the runs
    asked), or what a run recorded; None when neither is at hand."""
    if load.startswith("ts"):
        if args.trace is None:
            return None
        n = _outputs_key(outputs)[0]
        trace = load_trace(args.trace, args.num_prompts, _load_value(load), args.max_input_len, n)
        return [replace(t, output_length=n) for t in trace] if outputs.startswith("fix") else trace
    asked = next((r["summary"]["workload"] for r in group if r["summary"].get("workload")), None)
    return None if asked is None else [TraceRequest(a, p, o, ()) for a, p, o in asked]


def _title(outputs: str, load: str) -> str:
    n = _outputs_key(outputs)[0]
    what = {
        "fix": f"outputs = {n}",
        "out": f"outputs <= {n}",
        "lbmax": "LongBench output caps",
        "lbmean": "LongBench mean outputs",
    }[outputs[:3] if outputs[:3] in ("fix", "out") else outputs]
    if load.startswith("ts"):
        return f"{what}, time scale {_load_value(load):g}"
    rate = _load_value(load)
    return f"{what}, " + (f"Poisson {rate:g} req/s" if math.isfinite(rate) else "all at once")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="where gpu_serve_check.sh wrote its results")
    p.add_argument("--trace", default=None, help="the trace the ts runs replayed (their bound)")
    p.add_argument("--model", type=Path, required=True, help="the model directory (its config.json: the bound)")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-input-len", type=int, default=32768)
    p.add_argument("--prefill-mfu", type=float, default=DEFAULT_PREFILL_MFU)
    p.add_argument("--sparse-budget", type=int, default=2048, help="tokens a sparse decode reads per request")
    args = p.parse_args(argv)
    runs = load_runs(args.folder)
    if not runs:
        raise SystemExit(f"no serve_<config>_<load>_<outputs>.json in {args.folder}")
    hw_path = args.folder / "hardware.json"
    hw = json.loads(hw_path.read_text()) if hw_path.exists() else DEFAULT_HARDWARE
    shape = ModelShape.from_model_dir(args.model)
    if args.trace is not None:  # a ts load's request rate: the trace's requests over its scaled arrival span
        span = max(t.arrival_s for t in load_trace(args.trace, args.num_prompts)) or 1.0
        for r in runs:
            if r["scale"] is not None:
                r["rate"] = args.num_prompts / (span * r["scale"])
    report: dict[str, Any] = {"hardware": hw, "prefill_mfu": args.prefill_mfu, "bounds": {}, "tables": {}}
    for out in sorted({r["outputs"] for r in runs}, key=_outputs_key):
        for load in sorted({r["load"] for r in runs if r["outputs"] == out}, key=_load_key):
            group = [r for r in runs if (r["outputs"], r["load"]) == (out, load)]
            key, title = f"{out}_{load}", _title(out, load)
            requests = group_requests(args, out, load, group)
            if requests is None:
                report["tables"][key] = rows = ladder_rows(group)
                print_table(rows, f"{title}: no bound (the runs' requests are not at hand)")
                continue
            bounds = {
                name: workload_bound(requests, shape, hw, args.prefill_mfu, cap)
                for name, cap in (("dense", None), ("sparse", args.sparse_budget))
            }
            report["bounds"][key] = bounds
            report["tables"][key] = rows = ladder_rows(group, {k: b["output_throughput"] for k, b in bounds.items()})
            print_table(
                rows,
                f"{title}: bound {bounds['dense']['output_throughput']:.0f}"
                f" out tok/s reading all KV, {bounds['sparse']['output_throughput']:.0f} reading "
                f"<= {args.sparse_budget} tokens (prefill {bounds['dense']['prefill_s']:.1f} s at MFU "
                f"{args.prefill_mfu}, decode {bounds['dense']['decode_s']:.1f} / "
                f"{bounds['sparse']['decode_s']:.1f} s); mean TTFT >= "
                f"{bounds['dense']['mean_ttft_s']:.2f} s",
            )
    (args.folder / "ladder.json").write_text(json.dumps(report, indent=1))
    plot(runs, args.folder / "ladder.png")
    print(f"\nwrote {args.folder / 'ladder.json'} and {args.folder / 'ladder.png'}")
    return report


if __name__ == "__main__":
    main()
