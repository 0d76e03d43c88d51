"""Sparse prefill end to end: TTFT of one long prompt, and task accuracy against the attention tiles computed;
dense and SALE variants side by side in one run, an engine per variant (its sparse_prefill options), one after
another on the same weights.

    python -m benchmarks.sparse_prefill_e2e ttft MODEL --load-format dummy --context 131072 \\
        --thresholds 0.01 0.1 --calibration prefill.json --output ttft.json
    python -m benchmarks.sparse_prefill_e2e accuracy [MODEL] --lengths 16384,32768 --num-samples 20 \\
        --thresholds 0.001 0.01 0.1 --calibration prefill.json --output accuracy.json

Variants: dense (the engine's dense prefill kernel), sale@T for each --thresholds T (one threshold for every
head), sale:FILE for each --calibration file (`sparseserve calibrate --prefill`); with
--streaming-heads FILE the sale variants also stream those heads. Chunks shorter than --min-len stay dense.
tiles = (query tile, key tile, KV head) tiles computed / the causally visible ones (dense: 1).

ttft: a prompt of CONTEXT - 1 random tokens (max_model_len CONTEXT), one output token, chunked prefill at the
    engine's max_num_batched_tokens. Each variant's engine warms up (on CUDA) and runs --repeats times, each run
    on fresh random tokens (so no run reuses another's cached prefix). Reports the median wall time of generate
    (the TTFT of an idle engine), the speedup over dense in the same run, and tiles.
accuracy: the accuracy harness's samples (workloads/tasks.py, greedy, exact match) under every variant: its table,
    and per variant the mean accuracy, its difference to dense, the outputs equal to dense's and tiles (the curve
    of accuracy against tiles computed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import free_memory
from sparseserve.bench import accuracy as A
from sparseserve.workloads import tasks as T
from sparseserve.config import SparseConfig


def variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(label, SparseConfig fields of its prefill attention), dense first."""
    sale = {"sparse_prefill": "sale", "sparse_prefill_min_len": args.min_len, "streaming_heads": args.streaming_heads}
    out = [("dense", {"sparse_prefill": "dense", "sparse_prefill_calibration": None})]
    out += [
        (f"sale@{t:g}", {**sale, "sparse_prefill_threshold": t, "sparse_prefill_calibration": None})
        for t in args.thresholds
    ]
    out += [(f"sale:{Path(f).name}", {**sale, "sparse_prefill_calibration": f}) for f in args.calibration]
    return out


class Tiles:
    """Tiles computed / causally visible tiles of an engine's sparse prefill since mark() (1.0: none counted, the
    dense prefill)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.mark()

    def _read(self) -> tuple[int, int]:
        return A.prefill_tiles(self.llm)

    def mark(self) -> None:
        self.start = self._read()

    def fraction(self) -> float:
        computed, dense = (b - a for a, b in zip(self.start, self._read()))
        return computed / dense if dense else 1.0


def _engine(args: argparse.Namespace, max_model_len: int, variant: dict[str, Any]) -> Any:
    """The variant's engine, after the previous one's memory is back (the caller dropped it)."""
    from sparseserve import LLM

    free_memory()
    kw = A._engine_args(args, max_model_len)
    return LLM(model=args.model, load_format=args.load_format, **kw, **variant)


def _meta(args: argparse.Namespace, llm: Any) -> dict:
    dev = llm.llm_engine.model_runner.device
    return {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model or "embedded default",
        "model_name": llm.llm_engine.model_name,
        "engine_args": args.engine_arg,
        "min_len": args.min_len,
        "streaming_heads": args.streaming_heads,
    }


def _write(args: argparse.Namespace, out: dict) -> None:
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.output}")


def run_ttft(args: argparse.Namespace) -> dict:
    from sparseserve import SamplingParams

    n = args.context - 1
    once = SamplingParams(temperature=0.0, max_tokens=1)
    runs = iter(range(1 << 30))
    vs = variants(args)
    times: dict[str, list[float]] = {label: [] for label, _ in vs}
    tiles: dict[str, list[float]] = {label: [] for label, _ in vs}
    meta: dict = {}
    for label, kw in vs:
        llm = _engine(args, args.context, kw)
        vocab = llm.llm_engine.model_runner.arch.vocab_size

        def prompt(length: int) -> list[int]:
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + next(runs))
            return torch.randint(10, vocab, (length,), generator=g).tolist()

        chunk = llm.llm_engine.config.scheduler_config.max_num_batched_tokens
        if llm.llm_engine.model_runner.device.type == "cuda":  # the torch references need no warm-up
            # a sparse chunk in every variant: its Triton kernels compile here
            llm.generate([prompt(min(n, args.min_len + 2 * chunk))], once, use_tqdm=False)
        for r in range(args.repeats):
            counter = Tiles(llm)
            ids = prompt(n)
            t0 = time.perf_counter()
            llm.generate([ids], once, use_tqdm=False)
            times[label].append(time.perf_counter() - t0)
            tiles[label].append(counter.fraction())
            print(f"repeat {r} {label:24s} {times[label][-1]:8.3f} s  tiles {tiles[label][-1]:.1%}", flush=True)
        meta = _meta(args, llm)
        del llm, counter
    dense = statistics.median(times["dense"])
    rows = {
        label: {
            "ttft_s": times[label],
            "median_s": statistics.median(times[label]),
            "speedup_vs_dense": dense / statistics.median(times[label]),
            "tile_fraction": statistics.mean(tiles[label]),
            "config": kw,
        }
        for label, kw in vs
    }
    print(f"\nTTFT of one {n}-token prompt (median of {args.repeats}), chunks of {chunk} tokens")
    print(f"{'variant':26s} {'TTFT s':>9s} {'min s':>9s} {'vs dense':>9s} {'tiles':>7s}")
    for label, r in rows.items():
        print(
            f"{label:26s} {r['median_s']:9.3f} {min(r['ttft_s']):9.3f} {r['speedup_vs_dense']:8.2f}x "
            f"{r['tile_fraction']:7.1%}"
        )
    out = {
        **meta,
        "mode": "ttft",
        "context": args.context,
        "prompt_tokens": n,
        "chunk_tokens": chunk,
        "repeats": args.repeats,
        "variants": rows,
    }
    _write(args, out)
    return out


def run_accuracy(args: argparse.Namespace) -> dict:
    tasks, lengths = A._csv(args.tasks), [int(x) for x in A._csv(args.lengths)]
    tok = A.load_tokenizer(args.model, A.parse_engine_args(args.engine_arg).get("tokenizer"))
    builder = T.TaskBuilder(tok, T.load_essays(T.find_haystack_dir(args.data_dir)), eos_id=tok.eos_token_id)
    samples = T.build_suite(builder, tasks, lengths, args.num_samples, args.seed)
    results, rows_by, curve, meta = {}, {}, {}, {}
    for label, kw in variants(args):
        t0 = time.time()
        llm = _engine(args, max(lengths) + 64, kw)
        counter = Tiles(llm)
        rows = A.run_policy(llm, samples, use_tqdm=not args.quiet)
        rows_by[label], results[label] = rows, A.accuracy_table(rows)
        mean = sum(r["correct"] for r in rows) / len(rows)
        equal = sum(a["output_token_ids"] == b["output_token_ids"] for a, b in zip(rows_by["dense"], rows))
        curve[label] = {
            "tile_fraction": counter.fraction(),
            "mean_accuracy": mean,
            "delta_vs_dense": mean - curve["dense"]["mean_accuracy"] if curve else 0.0,
            "equal_to_dense": equal,
            "seconds": round(time.time() - t0, 2),
            "config": kw,
        }
        meta = _meta(args, llm)
        del llm, counter
    print(f"\nexact-match accuracy (%), {args.num_samples} samples per cell, seed {args.seed}")
    print(A.format_table(results, tasks, lengths))
    print(f"\n{'variant':26s} {'tiles':>7s} {'accuracy':>9s} {'vs dense':>9s} {'= dense':>8s}")
    for label, c in curve.items():
        print(
            f"{label:26s} {c['tile_fraction']:7.1%} {100 * c['mean_accuracy']:8.1f}% "
            f"{100 * c['delta_vs_dense']:+8.1f} {c['equal_to_dense']:5d}/{len(samples)}"
        )
    out = {
        **meta,
        "mode": "accuracy",
        "tasks": tasks,
        "lengths": lengths,
        "num_samples": args.num_samples,
        "seed": args.seed,
        "accuracy": results,
        "curve": curve,
        "samples": rows_by,
    }
    _write(args, out)
    return out


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mode", choices=["ttft", "accuracy"])
    parser.add_argument("model", nargs="?", default=None, help="HF model directory (default: embedded model)")
    parser.add_argument("--thresholds", type=float, nargs="*", default=[0.01], help="sale@T variants")
    parser.add_argument("--calibration", nargs="*", default=[], help="sale:FILE variants (calibration files)")
    parser.add_argument("--streaming-heads", default=None, help="streaming-heads file for the sale variants")
    parser.add_argument(
        "--min-len",
        type=int,
        default=SparseConfig.sparse_prefill_min_len,
        help="sparse_prefill_min_len of the sale variants",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine argument (repeatable), e.g. max_num_batched_tokens=16384",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="JSON results file")
    g = parser.add_argument_group("ttft")
    g.add_argument("--context", type=int, default=131072, help="max_model_len; the prompt is one token shorter")
    g.add_argument("--repeats", type=int, default=3, help="timed runs of every variant")
    g = parser.add_argument_group("accuracy")
    g.add_argument("--lengths", default="16384,32768", help="prompt lengths in tokens, comma-separated")
    g.add_argument("--num-samples", type=int, default=20, help="samples per task and length")
    g.add_argument("--tasks", default=",".join(T.TASKS), help=f"comma-separated, from {', '.join(T.TASKS)}")
    g.add_argument("--data-dir", default=None, help="essay folder (default: ../shared/data/haystack)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def main(args: argparse.Namespace) -> dict:
    return run_ttft(args) if args.mode == "ttft" else run_accuracy(args)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(ap)
    main(ap.parse_args())
