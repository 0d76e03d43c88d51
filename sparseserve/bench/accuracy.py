"""`sparseserve bench accuracy`: long-context accuracy and perplexity of a model under attention policies.

    sparseserve bench accuracy smollm2 --suite completion --lengths 2048,4096,8128 --num-samples 50 \\
        --policies dense topk:sparse_budget=1024 topp:sparse_budget=1024,sparse_top_p=0.9 --output acc.json

Two task suites: `ruler` (workloads/tasks.py, "Question: ... Answer:", the format the embedded model was trained on)
and `completion` (workloads/completion_tasks.py: the prompt ends inside the answer's sentence, for small instruct
models such as SmolLM2-135M). Samples come from --seed and the essays; each policy runs them through its own engine
with greedy decoding (CUDA graphs as configured), one batch per length, scored by exact match. Per policy and length
it also reports:
  ppl       decode-step perplexity of the essays (bench/perplexity.py): --ppl-tokens targets after a prefix
            that fills the length, each scored by a decode step through the policy (0: off);
  tokens    mean tokens a decode query attended in the sparse layers (the engine's counters:
            sparse_blocks_selected / sparse_selections * block_size; the mean context where nothing was sparse);
  probe     with --probe-steps, per layer, the softmax mass the attended tokens cover and the attention output's
            relative error against dense (bench/attention_probe.py);
  paired    the accuracy difference to dense on the same prompts, sample by sample, with its 95% interval and
            the "within 1 point" verdict: mean >= -1 point, interval >= -2 (bench/paired.py). --samples N asks
            N samples per policy and length (spread over the tasks) instead of --num-samples per task.
It prints the accuracy table (task x length, dense first), the curve of accuracy and perplexity against mean
tokens attended per policy (also a PNG with --plot, needs matplotlib: the `bench` extra), and writes JSON.

A policy is NAME (a preset below) or NAME:key=value,... (engine arguments). A NAME that is a selection policy
(topk, topp) sets sparse_policy itself, so `topk:sparse_budget=1024` is topk at budget 1024; its label is then
the spec without the "sparse_" prefixes ("topk:budget=1024"), so several budgets can run side by side. A new
NAME with arguments is its own label (`topk768:sparse_policy=topk,sparse_budget=768` is "topk768").
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparseserve.bench import paired as PD
from sparseserve.workloads import completion_tasks as C
from sparseserve.workloads import tasks as T

# Presets: a policy given as "name:key=value,..." starts from its entry here (or from nothing, for a new name) and
# overrides keys, so new policies and budgets need no change here. The *_1024 ones are issue 16's settings on
# SmolLM2 (one eighth of an 8K context); streaming heads need a file: add streaming_heads=PATH.
TOPK1024 = {"sparse_policy": "topk", "sparse_budget": 1024}
POLICIES: dict[str, dict[str, Any]] = {
    # Explicit, not the engine's defaults: the reference of every paired difference stays dense if they turn sparse.
    "dense": {"sparse_policy": "dense", "sparse_prefill": "dense"},
    # The smallest fixed budget that matched dense on the trained test model, and topp at half its mean budget or
    # less: 512 candidates by their key bounds, pruned to mass 0.9 on q.k (docs/benchmarks/accuracy.md).
    "topk512": {"sparse_policy": "topk", "sparse_budget": 512},
    "topp512_p90": {"sparse_policy": "topp", "sparse_budget": 512, "sparse_top_p": 0.9},
    "topk1024": TOPK1024,
    "topk1024_r4": {**TOPK1024, "sparse_reuse": 4},
    "topk1024_lag": {**TOPK1024, "sparse_lag": 1},
    "topk1024_page16": {**TOPK1024, "logical_page_size": 16},
    "topk1024_page8": {**TOPK1024, "logical_page_size": 8},
}


@dataclass(frozen=True)
class Policy:
    name: str
    engine_args: dict[str, Any]


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _selection_policies() -> list[str]:
    from sparseserve.registry import SELECTION_POLICIES

    return SELECTION_POLICIES.names()


def parse_policy(spec: str) -> Policy:
    """ "dense", a preset, "topk:sparse_budget=1024" (a selection policy's name sets sparse_policy) or
    "label:sparse_policy=topk,sparse_budget=1024" (a new label plus engine arguments)."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"empty policy name in {spec!r}")
    selection = name in _selection_policies()
    if name not in POLICIES and not rest and not selection:
        raise ValueError(
            f"unknown policy {name!r}: known are {', '.join(POLICIES)} and the selection policies "
            f"{', '.join(_selection_policies())}; or give engine arguments, e.g. "
            f"{name}:sparse_policy=topk,sparse_budget=2048"
        )
    args = dict(POLICIES.get(name, {"sparse_policy": name} if selection else {}))
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"policy argument {item!r} in {spec!r} is not key=value")
        args[key.strip().replace("-", "_")] = _value(val.strip())
    if rest and (name in POLICIES or selection):  # the spec is the label, shortened: "topk:budget=1024"
        label = f"{name}:" + ",".join(x.strip().removeprefix("sparse_") for x in rest.split(",") if x.strip())
    else:
        label = name
    return Policy(label, args)


def parse_policies(specs: list[str]) -> list[Policy]:
    """The policies in run order: dense first (added when missing: it is every ratio's reference); labels unique."""
    policies = [parse_policy(s) for s in specs]
    seen: set[str] = set()
    for p in policies:
        if p.name in seen:
            raise ValueError(f"policy {p.name!r} is given twice")
        seen.add(p.name)
    if "dense" not in seen:
        policies.insert(0, parse_policy("dense"))
    policies.sort(key=lambda p: p.name != "dense")
    return policies


# -- task suites -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Suite:
    name: str
    tasks: tuple[str, ...]
    default_lengths: str
    build: Callable[[T.TaskBuilder, list[str], list[int], int, int], list[T.TaskSample]]
    score: Callable[[T.TaskSample, str], float]  # 1.0 for a right answer (partial credit where a task has it)
    max_tokens: Callable[[T.TaskSample], int]


SUITES = {
    "ruler": Suite(
        "ruler",
        T.TASKS,
        "4096,16384",
        T.build_suite,
        lambda s, text: float(T.is_correct(text, s.answer)),
        lambda s: len(s.answer_ids) + 4,
    ),
    # 8128 = SmolLM2's 8192-token context less the generation room of the longest answer (multi-value).
    "completion": Suite("completion", C.TASKS, "2048,4096,8128", C.build_suite, C.score, C.max_tokens),
}


NUM_SAMPLES = 20  # per task and length, when neither --num-samples nor --samples is given


def samples_per_task(num_samples: int | None, samples: int | None, num_tasks: int) -> int:
    """--num-samples, or --samples (per policy and length) spread over the tasks, rounded up."""
    if num_samples is not None and samples is not None:
        raise ValueError("give --num-samples (per task) or --samples (per policy and length), not both")
    if samples is not None:
        if samples < 1:
            raise ValueError(f"--samples must be >= 1, got {samples}")
        return math.ceil(samples / num_tasks)
    n = NUM_SAMPLES if num_samples is None else num_samples
    if n < 1:
        raise ValueError(f"--num-samples must be >= 1, got {n}")
    return n


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model directory, .gguf file or known name such as smollm2 (default: embedded model)",
    )
    parser.add_argument("--model", dest="model_option", default=None, help="same as MODEL")
    parser.add_argument(
        "--suite",
        default="ruler",
        choices=list(SUITES),
        help="ruler (Question/Answer, the embedded model's format) or completion (small instruct "
        "models: the prompt ends inside the answer's sentence)",
    )
    parser.add_argument(
        "--lengths",
        default=None,
        help="prompt lengths in tokens, comma-separated (default: ruler 4096,16384; completion 2048,4096,8128)",
    )
    parser.add_argument(
        "--num-samples", type=int, default=None, help=f"samples per task and length (default {NUM_SAMPLES})"
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples per policy and length, split evenly over the tasks (rounded up to a multiple of "
        "their number); instead of --num-samples",
    )
    parser.add_argument("--tasks", default=None, help="comma-separated (default: all of the suite's)")
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["dense"],
        help="attention policies: NAME or NAME:key=value,...; dense is always run first",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task samples and perplexity windows")
    parser.add_argument("--data-dir", default=None, help="essay folder (default: ../shared/data/haystack)")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="engine max_model_len (default: longest length + answer room)"
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra engine argument for every policy (repeatable), e.g. attention_backend=torch",
    )
    parser.add_argument(
        "--ppl-tokens",
        type=int,
        default=128,
        help="decode-step perplexity: tokens scored per essay window, after a prefix that fills "
        "the length (0: no perplexity)",
    )
    parser.add_argument(
        "--ppl-samples", type=int, default=None, help="essay windows per length (default: --num-samples)"
    )
    parser.add_argument(
        "--probe-steps",
        type=int,
        default=4,
        help="decode steps per probed request for the attention report (0: no report)",
    )
    parser.add_argument("--probe-samples", type=int, default=2, help="requests per task and length probed")
    parser.add_argument(
        "--compare-hf",
        action="store_true",
        help="also run the samples through transformers (greedy) and report token parity",
    )
    parser.add_argument("--output", default=None, help="JSON results file (default: print only)")
    parser.add_argument("--plot", default=None, help="PNG of the accuracy and perplexity curves (needs matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def parse_engine_args(items: list[str]) -> dict[str, Any]:
    """--engine-arg KEY=VALUE items (benchmarks' extra engine arguments) as keyword arguments."""
    extra = {}
    for item in items:
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"--engine-arg {item!r} is not KEY=VALUE")
        extra[key.strip().replace("-", "_")] = _value(val.strip())
    return extra


def _engine_args(args: argparse.Namespace, max_len: int) -> dict[str, Any]:
    """The engines' common arguments: synchronous scheduling unless --engine-arg asks (greedy answers are the same
    either way; the harness's figures, teacher-forced perplexity included, were measured so)."""
    kw = {"device": args.device, "dtype": args.dtype, "max_model_len": max_len, "async_scheduling": False}
    return kw | parse_engine_args(args.engine_arg)


def _release_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def model_context(model: str | None) -> int:
    """The model's context (max_position_embeddings), read from its config without loading weights."""
    from sparseserve.models.config import ArchConfig
    from sparseserve.models.loader import load_hf_config, resolve_model_dir

    return ArchConfig.from_hf(load_hf_config(resolve_model_dir(model))).max_position_embeddings


def load_tokenizer(model: str | None, tokenizer: str | None = None) -> Any:
    """The tokenizer the engine will use (LLMEngine loads it the same way), so samples exist before any engine."""
    from sparseserve.models.loader import load_tokenizer as load_model_tokenizer
    from sparseserve.models.loader import resolve_model_dir

    return load_model_tokenizer(tokenizer or resolve_model_dir(model))


# -- running one policy --------------------------------------------------------------------------------------
def run_policy(
    llm: Any, samples: list[T.TaskSample], suite: Suite = SUITES["ruler"], use_tqdm: bool = False
) -> list[dict]:
    """Greedy answers of all samples in one batch (the engine schedules them), scored by the suite ("correct":
    1.0 or 0.0, a share for partial-credit tasks)."""
    from sparseserve import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=suite.max_tokens(s)) for s in samples]
    outs = llm.generate([s.prompt_ids for s in samples], params, use_tqdm=use_tqdm)
    rows = []
    for i, (s, o) in enumerate(zip(samples, outs)):
        text = o.outputs[0].text
        row = {
            "task": s.task,
            "length": s.length,
            "index": i,
            "answer": s.answer,
            "output": text,
            "output_token_ids": list(o.outputs[0].token_ids),
            "correct": suite.score(s, text),
        }
        if "depth" in s.meta:
            row["depth"] = s.meta["depth"]
        rows.append(row)
    return rows


def selection_counters(llm: Any) -> tuple[int, int]:
    """(sparse_blocks_selected, sparse_selections) so far, synced (benchmarks only)."""
    stats = llm.llm_engine.get_stats(sync=True)
    return stats.sparse_blocks_selected, stats.sparse_selections


def prefill_tiles(llm: Any) -> tuple[int, int]:
    """(prefill_tiles_computed, prefill_tiles_dense) so far, synced: sparse prefill's share of dense's tiles."""
    stats = llm.llm_engine.get_stats(sync=True)
    return stats.prefill_tiles_computed, stats.prefill_tiles_dense


def tokens_attended(before: tuple[int, int], after: tuple[int, int], block_size: int, mean_context: float) -> float:
    """Mean tokens a decode query attended in the sparse layers between two counter snapshots; `mean_context`
    when no selection was made (dense, or contexts within the budget)."""
    blocks, selections = after[0] - before[0], after[1] - before[1]
    return blocks * block_size / selections if selections else mean_context


def mean_tokens_attended(llm: Any, samples: list[T.TaskSample]) -> float:
    """Over the engine's whole life (see `tokens_attended` for a span of it)."""
    return tokens_attended(
        (0, 0),
        selection_counters(llm),
        llm.llm_engine.config.cache_config.block_size,
        sum(s.length for s in samples) / len(samples),
    )


def _same_tokens(a: list[int], b: list[int], eos_ids: set[int]) -> bool:
    """Equal greedy outputs, ignoring whether a trailing EOS is reported."""
    strip = lambda x: x[:-1] if x and x[-1] in eos_ids else x  # noqa: E731
    return strip(list(a)) == strip(list(b))


def transformers_greedy(model: Any, ids: Any, steps: int) -> list[list[int]]:
    """Batched greedy decoding with transformers' KV cache: equal-length prompts, no padding (so SDPA
    stays on its causal path). The reference of parity checks and of the training script's evaluation."""
    import torch

    with torch.no_grad():
        res = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        past, nxt = res.past_key_values, res.logits[:, -1].argmax(-1)
        gen = [nxt]
        for _ in range(steps - 1):
            res = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past, nxt = res.past_key_values, res.logits[:, -1].argmax(-1)
            gen.append(nxt)
    return torch.stack(gen, 1).tolist()


def hf_greedy(
    model: str | None,
    samples: list[T.TaskSample],
    device: str,
    dtype: str,
    eos_ids: set[int],
    max_tokens: Callable[[T.TaskSample], int] = SUITES["ruler"].max_tokens,
) -> list[list[int]]:
    """Greedy tokens of transformers' implementation for every sample: the parity reference.
    Samples of one (task, length) have equal prompt lengths, so they batch without padding."""
    import torch
    from transformers import AutoModelForCausalLM

    from sparseserve.models.loader import resolve_model_dir

    path = resolve_model_dir(model)
    dev = "cuda" if device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    kw = {} if dtype == "auto" else {"dtype": getattr(torch, aliases.get(dtype, dtype))}
    if not kw:
        kw["dtype"] = "auto"
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", **kw).to(dev).eval()
    # Without a 16-bit dtype SDPA has no flash kernel and may materialise [heads, L, L] scores.
    budget = (1 << 19) if hf.dtype in (torch.bfloat16, torch.float16) else 0
    out: list[list[int] | None] = [None] * len(samples)
    groups: dict[tuple[str, int], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault((s.task, s.length), []).append(i)
    with torch.no_grad():
        for idx in groups.values():
            rows = max(1, budget // samples[idx[0]].length)
            for j in range(0, len(idx), rows):
                part = idx[j : j + rows]
                ids = torch.tensor([samples[i].prompt_ids for i in part], device=dev)
                steps = max(max_tokens(samples[i]) for i in part)
                for i, row in zip(part, transformers_greedy(hf, ids, steps)):
                    # Cut as the engine does: at EOS (kept in the tokens), or at max_tokens.
                    row = row[: max_tokens(samples[i])]
                    end = next((k for k, t in enumerate(row) if t in eos_ids), None)
                    out[i] = row if end is None else row[: end + 1]
    del hf
    _release_memory()
    return out  # type: ignore[return-value]


# -- reports -----------------------------------------------------------------------------------------------------
def accuracy_table(rows: list[dict]) -> dict[str, dict[str, float]]:
    """{task: {length: accuracy}} of one policy's rows (the mean score)."""
    acc: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        acc.setdefault(r["task"], {}).setdefault(str(r["length"]), []).append(r["correct"])
    return {t: {n: sum(v) / len(v) for n, v in d.items()} for t, d in acc.items()}


def depth_table(rows: list[dict], task: str = "needle_depth") -> dict[str, dict[str, float]]:
    """{length: {depth: accuracy}} of one policy's rows of the depth-sweep task."""
    acc: dict[str, dict[str, list[bool]]] = {}
    for r in rows:
        if r["task"] == task:
            acc.setdefault(str(r["length"]), {}).setdefault(f"{r['depth']:.1f}", []).append(r["correct"])
    return {n: {d: sum(v) / len(v) for d, v in sorted(x.items())} for n, x in acc.items()}


def format_depths(depths: dict[str, dict[str, dict[str, float]]]) -> str:
    """Rows policy x length, one column per depth."""
    cols = sorted({d for by_len in depths.values() for x in by_len.values() for d in x}, key=float)
    w = max([8] + [len(f"{p} @{n}") + 2 for p, by_len in depths.items() for n in by_len])
    lines = [f"{'policy @ length':<{w}}" + "".join(f"{d:>6}" for d in cols)]
    for p, by_len in depths.items():
        for n, x in by_len.items():
            lines.append(
                f"{p + ' @' + n:<{w}}" + "".join(f"{100 * x[d]:>6.0f}" if d in x else f"{'-':>6}" for d in cols)
            )
    return "\n".join(lines)


def format_table(
    results: dict[str, dict[str, dict[str, float]]],
    tasks: list[str],
    lengths: list[int],
    ref: str = "dense",
    extra_rows: dict[str, dict[str, dict[str, str]]] | None = None,
) -> str:
    """Rows task x length, one column per policy (the reference first), accuracies in percent;
    other columns also show their difference to the reference. `extra_rows`: {row name: {length: {policy:
    cell}}} printed below (perplexity, tokens attended)."""
    names = [ref] + [p for p in results if p != ref] if ref in results else list(results)
    width = max(12, *(len(n) + 2 for n in names))
    lines = [f"{'task':<20}{'length':>8}" + "".join(f"{n:>{width}}" for n in names)]
    for t in tasks:
        for n in lengths:
            cells = []
            base = results.get(ref, {}).get(t, {}).get(str(n))
            for p in names:
                a = results[p].get(t, {}).get(str(n))
                cell = "-" if a is None else f"{100 * a:.1f}"
                if a is not None and base is not None and p != ref:
                    cell += f" ({100 * (a - base):+.0f})"
                cells.append(f"{cell:>{width}}")
            lines.append(f"{t:<20}{n:>8}" + "".join(cells))
    for row, by_len in (extra_rows or {}).items():
        for n in lengths:
            cells = [f"{by_len.get(str(n), {}).get(p, '-'):>{width}}" for p in names]
            lines.append(f"{row:<20}{n:>8}" + "".join(cells))
    return "\n".join(lines)


def curve(
    results: dict[str, dict], ppl: dict[str, dict], attended: dict[str, dict], lengths: list[int], ref: str = "dense"
) -> list[dict]:
    """One point per (policy, length): mean accuracy over the tasks, perplexity and their differences to the
    reference against mean tokens attended (the tasks' decode queries)."""
    points = []
    for pol, table in results.items():
        for n in lengths:
            accs = [d[str(n)] for d in table.values() if str(n) in d]
            base = [d[str(n)] for d in results.get(ref, {}).values() if str(n) in d]
            p = ppl.get(pol, {}).get(str(n), {}).get("ppl")
            pb = ppl.get(ref, {}).get(str(n), {}).get("ppl")
            acc = sum(accs) / len(accs) if accs else None
            points.append(
                {
                    "policy": pol,
                    "length": n,
                    "tokens_attended": attended.get(pol, {}).get(str(n)),
                    "accuracy": acc,
                    "accuracy_vs_dense": None if acc is None or not base else acc - sum(base) / len(base),
                    "ppl": p,
                    "ppl_ratio": p / pb if p is not None and pb else None,
                }
            )
    return points


def format_curve(points: list[dict]) -> str:
    w = max([8] + [len(c["policy"]) + 2 for c in points])
    lines = [f"{'policy':<{w}}{'length':>7}{'tokens':>9}{'accuracy':>10}{'vs dense':>9}{'ppl':>9}{'ppl/dense':>10}"]
    for c in points:
        f = lambda v, fmt: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)  # noqa
        lines.append(
            f"{c['policy']:<{w}}{c['length']:>7}{f(c['tokens_attended'], '.0f'):>9}"
            f"{f(None if c['accuracy'] is None else 100 * c['accuracy'], '.1f'):>10}"
            f"{f(None if c['accuracy_vs_dense'] is None else 100 * c['accuracy_vs_dense'], '+.1f'):>9}"
            f"{f(c['ppl'], '.3f'):>9}{f(c['ppl_ratio'], '.4f'):>10}"
        )
    return "\n".join(lines)


def plot_curve(points: list[dict], path: str) -> bool:
    """Accuracy and perplexity ratio against mean tokens attended, one marker series per length; False (and
    nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for n in sorted({c["length"] for c in points}):
        pts = [c for c in points if c["length"] == n and c["tokens_attended"]]
        for ax, key, scale in ((axes[0], "accuracy", 100), (axes[1], "ppl_ratio", 1)):
            xy = [(c["tokens_attended"], c[key] * scale, c["policy"]) for c in pts if c[key] is not None]
            if not xy:
                continue
            ax.scatter([x for x, _, _ in xy], [y for _, y, _ in xy], label=f"{n} tokens")
            for x, y, name in xy:
                ax.annotate(name.split(":")[0] if len(name) > 24 else name, (x, y), fontsize=7)
    axes[0].set(xscale="log", xlabel="mean tokens attended per decode query", ylabel="accuracy (%, mean over tasks)")
    axes[1].set(xscale="log", xlabel="mean tokens attended per decode query", ylabel="perplexity / dense")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -- the harness -----------------------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> dict:
    from sparseserve import LLM
    from sparseserve.bench import attention_probe
    from sparseserve.bench import perplexity as P
    from sparseserve.config import EngineConfig

    model = args.model
    option = getattr(args, "model_option", None)
    if option is not None:
        if model not in (None, option):
            raise ValueError(f"two models given: {model!r} and --model {option!r}")
        model = option
    suite = SUITES[args.suite]
    tasks = _csv(args.tasks) if args.tasks else list(suite.tasks)
    bad = [t for t in tasks if t not in suite.tasks]
    if bad:
        raise ValueError(
            f"unknown task(s) {', '.join(bad)} in suite {suite.name}: choose from {', '.join(suite.tasks)}"
        )
    lengths = [int(x) for x in _csv(args.lengths or suite.default_lengths)]
    per_task = samples_per_task(args.num_samples, getattr(args, "samples", None), len(tasks))
    policies = parse_policies(args.policies)
    essays = T.load_essays(T.find_haystack_dir(args.data_dir))
    extra = _engine_args(args, 0)
    tok = load_tokenizer(model, extra.get("tokenizer"))
    builder = T.TaskBuilder(tok, essays, eos_id=tok.eos_token_id)
    # Run order: one batch per length (rows, the reference's outputs and every policy's rows line up with this).
    samples = sorted(suite.build(builder, tasks, lengths, per_task, args.seed), key=lambda s: s.length)
    room = max(suite.max_tokens(s) for s in samples) + 1
    max_len = args.max_model_len or max(lengths) + room
    context = model_context(model)
    if max_len > context:
        raise ValueError(
            f"prompts of {max(lengths)} tokens plus {room} tokens of answer room need "
            f"max_model_len={max_len}, more than the model's context ({context}): the longest prompt "
            f"that fits is {context - room} tokens"
        )
    ppl_samples = per_task if args.ppl_samples is None else args.ppl_samples
    windows = {}
    if args.ppl_tokens and ppl_samples:
        for n in lengths:
            if n <= args.ppl_tokens + 1:
                raise ValueError(f"--ppl-tokens {args.ppl_tokens} leaves no prefix at length {n}")
            windows[n] = P.essay_windows(builder, n - args.ppl_tokens, args.ppl_tokens, ppl_samples, args.seed)

    results: dict[str, dict] = {}
    rows_by_policy: dict[str, list[dict]] = {}
    ppl: dict[str, dict[str, dict]] = {}
    attended: dict[str, dict[str, float]] = {}
    attended_ppl: dict[str, dict[str, float]] = {}
    probes: dict[str, dict] = {}
    tiles: dict[str, dict[str, float]] = {}  # policy -> length -> sparse prefill's tiles / dense's
    timing: dict[str, float] = {}
    eos_ids: set[int] = set()
    model_desc = None
    for pol in policies:  # every policy's options checked before the first engine starts (a run takes minutes)
        EngineConfig.from_kwargs(model=model, **{**_engine_args(args, max_len), **pol.engine_args})
        heads = pol.engine_args.get("streaming_heads")
        if heads and not Path(heads).is_file():
            raise ValueError(f"policy {pol.name}: streaming_heads file {heads!r} does not exist")
    for pol in policies:
        t0 = time.time()
        engine_kw = {**_engine_args(args, max_len), **pol.engine_args}
        forcing = P.TeacherForcing() if windows else None  # the engine's profiler: perplexity's targets
        llm = LLM(model=model, profiler=forcing, **engine_kw)
        engine = llm.llm_engine
        model_desc, eos_ids = str(engine.model_name), set(engine.eos_token_ids)
        bs = engine.config.cache_config.block_size
        rows: list[dict] = []
        attended[pol.name], attended_ppl[pol.name], ppl[pol.name] = {}, {}, {}
        for n in sorted(set(lengths)):  # one batch per length: the counters give each length's tokens attended
            group = [s for s in samples if s.length == n]
            before, tiles0 = selection_counters(llm), prefill_tiles(llm)
            part = run_policy(llm, group, suite, use_tqdm=not args.quiet)
            attended[pol.name][str(n)] = tokens_attended(before, selection_counters(llm), bs, n)
            computed, dense_tiles = (a - b for a, b in zip(prefill_tiles(llm), tiles0))
            if dense_tiles:
                tiles.setdefault(pol.name, {})[str(n)] = computed / dense_tiles
            rows += part
            if n in windows:
                before = selection_counters(llm)
                lps = P.forced_logprobs(llm, forcing, windows[n])
                ppl[pol.name][str(n)] = P.summarize(lps)
                attended_ppl[pol.name][str(n)] = tokens_attended(
                    before, selection_counters(llm), bs, n - args.ppl_tokens / 2
                )
        for i, r in enumerate(rows):
            r["index"] = i
        rows_by_policy[pol.name] = rows
        results[pol.name] = accuracy_table(rows)
        offload = engine.config.offload_config.kv_offload
        llm = engine = None
        _release_memory()  # the next engine (or the transformers reference) gets the GPU memory
        if args.probe_steps:
            if offload:
                print(f"[{pol.name}] no attention probe under KV offload (the device cache holds only the windows)")
            else:
                probe_samples = [
                    s
                    for t in tasks
                    for n in lengths
                    for s in [x for x in samples if x.task == t and x.length == n][: args.probe_samples]
                ]
                probes[pol.name] = attention_probe.probe(model, engine_kw, probe_samples, args.probe_steps)
                _release_memory()
        timing[pol.name] = round(time.time() - t0, 2)
        mean = sum(r["correct"] for r in rows) / max(len(rows), 1)
        print(f"[{pol.name}] mean accuracy {100 * mean:.1f}% over {len(rows)} samples, {timing[pol.name]:.0f} s")
        if args.output:  # what is done so far survives an interrupted run
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(
                json.dumps(
                    {
                        "partial": True,
                        "accuracy": results,
                        "perplexity": ppl,
                        "mean_tokens_attended": attended,
                        "seconds": timing,
                        "samples": rows_by_policy,
                    },
                    indent=1,
                )
            )

    parity_out = None
    if args.compare_hf:  # after the engines are gone: the reference needs the memory they held
        hf_ids = hf_greedy(model, samples, args.device, args.dtype, eos_ids, suite.max_tokens)
        hf_rows = []
        for r, s, ids in zip(rows_by_policy["dense"], samples, hf_ids):
            text = tok.decode(ids, skip_special_tokens=True)
            hf_rows.append({**r, "output": text, "output_token_ids": ids, "correct": suite.score(s, text)})
            r["hf_match"] = _same_tokens(r["output_token_ids"], ids, eos_ids)
        rows_by_policy["hf"] = hf_rows
        results["hf"] = accuracy_table(hf_rows)
        parity: dict[str, dict[str, list[bool]]] = {}
        for r in rows_by_policy["dense"]:
            parity.setdefault(r["task"], {}).setdefault(str(r["length"]), []).append(r["hf_match"])
        parity_out = {t: {n: sum(v) / len(v) for n, v in d.items()} for t, d in parity.items()}

    extra_rows: dict[str, dict[str, dict[str, str]]] = {"tokens attended": {}}
    for name, by_len in attended.items():
        for n, v in by_len.items():
            extra_rows["tokens attended"].setdefault(n, {})[name] = f"{v:.0f}"
    if tiles:
        extra_rows["prefill tiles"] = {}
        for name, by_len in tiles.items():
            for n, v in by_len.items():
                extra_rows["prefill tiles"].setdefault(n, {})[name] = f"{100 * v:.1f}%"
    if windows:
        extra_rows["perplexity"] = {}
        for name, by_len in ppl.items():
            for n, v in by_len.items():
                base = ppl["dense"][n]["ppl"]
                cell = f"{v['ppl']:.3f}" + ("" if name == "dense" else f" (x{v['ppl'] / base:.3f})")
                extra_rows["perplexity"].setdefault(n, {})[name] = cell
    print(
        f"\nexact-match accuracy (%), suite {suite.name}, model {model_desc}, {per_task} samples per cell, "
        f"seed {args.seed}; tokens attended: mean per decode query in the sparse layers"
        + (f"; perplexity: {args.ppl_tokens} decode-step tokens x {ppl_samples} essay windows" if windows else "")
    )
    print(format_table(results, tasks, lengths, extra_rows=extra_rows))
    depths = {name: depth_table(rows) for name, rows in rows_by_policy.items() if name != "hf"}
    if any(depths.values()):
        print("\nneedle_depth accuracy (%) by the needle's depth in the context")
        print(format_depths(depths))
    # With few samples a cell moves many points on one low-margin sample: agreement with dense, sample by
    # sample, tells a policy that tracks dense from one that drifts.
    agree = {
        name: sum(a["output_token_ids"] == b["output_token_ids"] for a, b in zip(rows_by_policy["dense"], rows))
        for name, rows in rows_by_policy.items()
        if name not in ("dense", "hf")
    }
    if agree:
        print(f"outputs equal to dense (of {len(samples)}): " + ", ".join(f"{n} {k}" for n, k in agree.items()))
    if parity_out is not None:
        n_same = sum(r["hf_match"] for r in rows_by_policy["dense"])
        print(f"\nparity with transformers (same greedy tokens): {n_same}/{len(samples)}")
    points = curve({k: v for k, v in results.items() if k != "hf"}, ppl, attended, lengths)
    print("\naccuracy (mean over tasks) and perplexity against mean tokens attended")
    print(format_curve(points))
    paired = PD.paired_report({k: v for k, v in rows_by_policy.items() if k != "hf"}, lengths, ppl, attended)
    if paired:
        print("\npaired difference to dense on the same prompts, in points (within 1 point: mean >= -1 and the")
        print(f"interval's lower end >= -2); {PD.METHOD}")
        print(PD.format_paired(paired))
    if args.plot:
        print(f"wrote {args.plot}" if plot_curve(points, args.plot) else "no plot: matplotlib is not installed")
    print(
        "seconds per policy (engine start, tasks, perplexity, probe): "
        + ", ".join(f"{n} {t:.0f}" for n, t in timing.items())
    )
    if probes:
        print("\nattention probe: softmax mass covered / relative output error vs dense, per layer")
        for name, rep in probes.items():
            print(attention_probe.format_report(name, rep))
    out = {
        "model": model or "embedded default",
        "model_name": model_desc,
        "suite": suite.name,
        "seed": args.seed,
        "num_samples": per_task,
        "samples_per_policy": per_task * len(tasks),  # per length
        "tasks": tasks,
        "lengths": lengths,
        "policies": {p.name: p.engine_args for p in policies},
        "accuracy": results,
        "depth_accuracy": depths,
        "perplexity": ppl,
        "ppl_tokens": args.ppl_tokens,
        "ppl_samples": ppl_samples if windows else 0,
        "mean_tokens_attended": attended,
        "prefill_tiles_computed": tiles,
        "mean_tokens_attended_ppl": attended_ppl,
        "curve": points,
        "paired": paired,
        "paired_method": PD.METHOD,
        "probe": probes,
        "seconds": timing,
        "hf_parity": parity_out,
        "equal_to_dense": agree,
        "samples": {name: rows for name, rows in rows_by_policy.items()},
    }
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out, indent=1))
        print(f"\nwrote {args.output}")
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(p)
    main(p.parse_args())
