"""`sparseserve bench accuracy`: RULER-style long-context accuracy of a model under attention policies.

    sparseserve bench accuracy [MODEL] --lengths 4096,16384 --num-samples 20 \\
        --tasks passkey,niah_single --policies dense topk:sparse_budget=1024 --device cuda

Generates the tasks of sparseserve/bench/tasks.py at the given lengths from --seed and the essays,
runs them through the engine with greedy decoding under each policy, scores exact match, prints a
table (task x length, one column per policy, dense first as the reference) and writes JSON. With
--probe-steps it also reports, per layer, how much of the true softmax mass the policy's attended
tokens cover and the relative error of its attention output against dense (attention_probe.py).
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparseserve.bench import tasks as T

# The one place where attention policies get their engine arguments. A policy given on the command
# line as "name:key=value,key=value" starts from this entry (or from nothing, for a new name) and
# overrides keys, so new policies and budgets need no change here.
POLICIES: dict[str, dict[str, Any]] = {
    "dense": {},
    # The smallest fixed budget that matched dense here, and topp at half its mean budget or less: 512
    # candidates by their key bounds, pruned to mass 0.9 on q.k (BENCHMARKS.md, accuracy of sparse decode).
    "topk512": {"sparse_policy": "topk", "sparse_budget": 512},
    "topp512_p90": {"sparse_policy": "topp", "sparse_budget": 512, "sparse_top_p": 0.9},
}


@dataclass
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


def parse_policy(spec: str) -> Policy:
    """"dense", "topk" or "topk:sparse_budget=1024,sparse_policy=topk" (a label plus engine args)."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"empty policy name in {spec!r}")
    if name not in POLICIES and not rest:
        raise ValueError(f"unknown policy {name!r}: known are {', '.join(POLICIES)}; "
                         f"or give engine arguments, e.g. {name}:sparse_policy=topk,sparse_budget=2048")
    args = dict(POLICIES.get(name, {}))
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"policy argument {item!r} in {spec!r} is not key=value")
        args[key.strip().replace("-", "_")] = _value(val.strip())
    label = name if not rest or name not in POLICIES else spec
    return Policy(label, args)


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="HF model directory (default: embedded model)")
    parser.add_argument("--lengths", default="4096,16384", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--num-samples", type=int, default=20, help="samples per task and length")
    parser.add_argument("--tasks", default=",".join(T.TASKS), help=f"comma-separated, from {', '.join(T.TASKS)}")
    parser.add_argument("--policies", nargs="+", default=["dense"],
                        help="attention policies: NAME or NAME:key=value,...; dense is always run first")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task samples")
    parser.add_argument("--data-dir", default=None, help="essay folder (default: ../shared/data/haystack)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="engine max_model_len (default: longest length + answer room)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="extra engine argument for every policy (repeatable), e.g. attention_backend=torch")
    parser.add_argument("--probe-steps", type=int, default=4,
                        help="decode steps per probed request for the attention report (0: no report)")
    parser.add_argument("--probe-samples", type=int, default=2, help="requests per task and length probed")
    parser.add_argument("--compare-hf", action="store_true",
                        help="also run the samples through transformers (greedy) and report token parity")
    parser.add_argument("--output", default=None, help="JSON results file (default: print only)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _engine_args(args: argparse.Namespace, max_len: int) -> dict[str, Any]:
    extra = {}
    for item in args.engine_arg:
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"--engine-arg {item!r} is not KEY=VALUE")
        extra[key.strip().replace("-", "_")] = _value(val.strip())
    return {"device": args.device, "dtype": args.dtype, "max_model_len": max_len, **extra}


def _release_memory() -> None:
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def run_policy(llm: Any, samples: list[T.TaskSample], use_tqdm: bool) -> list[dict]:
    """Greedy answers of all samples in one batch (the engine schedules them), scored by exact match."""
    from sparseserve import SamplingParams
    params = [SamplingParams(temperature=0.0, max_tokens=len(s.answer_ids) + 4) for s in samples]
    outs = llm.generate([s.prompt_ids for s in samples], params, use_tqdm=use_tqdm)
    rows = []
    for i, (s, o) in enumerate(zip(samples, outs)):
        text = o.outputs[0].text
        rows.append({"task": s.task, "length": s.length, "index": i, "answer": s.answer,
                     "output": text, "output_token_ids": list(o.outputs[0].token_ids),
                     "correct": T.is_correct(text, s.answer)})
    return rows


def mean_tokens_attended(llm: Any, samples: list[T.TaskSample]) -> float:
    """Mean tokens a decode query attended (sparse layers; the engine's selection counters), or the
    mean prompt length when nothing was sparse (dense)."""
    stats = llm.llm_engine.get_stats()
    if getattr(stats, "sparse_selections", 0):
        return stats.sparse_blocks_selected * llm.llm_engine.config.cache_config.block_size / stats.sparse_selections
    return sum(s.length for s in samples) / len(samples)


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


def hf_greedy(model: str | None, samples: list[T.TaskSample], device: str, dtype: str,
              eos_ids: set[int]) -> list[list[int]]:
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
                part = idx[j:j + rows]
                ids = torch.tensor([samples[i].prompt_ids for i in part], device=dev)
                steps = max(len(samples[i].answer_ids) + 4 for i in part)
                for i, row in zip(part, transformers_greedy(hf, ids, steps)):
                    # Cut as the engine does: at EOS (kept in the tokens), or at max_tokens.
                    row = row[:len(samples[i].answer_ids) + 4]
                    end = next((k for k, t in enumerate(row) if t in eos_ids), None)
                    out[i] = row if end is None else row[:end + 1]
    del hf
    _release_memory()
    return out  # type: ignore[return-value]


def accuracy_table(rows: list[dict]) -> dict[str, dict[str, float]]:
    """{task: {length: accuracy}} of one policy's rows."""
    acc: dict[str, dict[str, list[bool]]] = {}
    for r in rows:
        acc.setdefault(r["task"], {}).setdefault(str(r["length"]), []).append(r["correct"])
    return {t: {n: sum(v) / len(v) for n, v in d.items()} for t, d in acc.items()}


def format_table(results: dict[str, dict[str, dict[str, float]]], tasks: list[str], lengths: list[int],
                 ref: str = "dense") -> str:
    """Rows task x length, one column per policy (the reference first), accuracies in percent;
    other columns also show their difference to the reference."""
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
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict:
    from sparseserve import LLM
    from sparseserve.bench import attention_probe

    tasks = _csv(args.tasks)
    bad = [t for t in tasks if t not in T.TASKS]
    if bad:
        raise SystemExit(f"unknown task(s) {', '.join(bad)}: choose from {', '.join(T.TASKS)}")
    lengths = [int(x) for x in _csv(args.lengths)]
    policies = [parse_policy(s) for s in args.policies]
    if not any(p.name == "dense" for p in policies):
        policies.insert(0, Policy("dense", dict(POLICIES["dense"])))
    policies.sort(key=lambda p: p.name != "dense")  # the reference column first
    essays = T.load_essays(T.find_haystack_dir(args.data_dir))
    max_len = args.max_model_len or max(lengths) + 64

    samples: list[T.TaskSample] | None = None
    parity_out: dict | None = None
    eos_ids: set[int] | None = None
    tok: Any = None
    results: dict[str, dict] = {}
    rows_by_policy: dict[str, list[dict]] = {}
    probes: dict[str, dict] = {}
    timing: dict[str, float] = {}
    attended: dict[str, float] = {}
    model_desc = None
    for pol in policies:
        t0 = time.time()
        engine_args = {**_engine_args(args, max_len), **pol.engine_args}
        if args.probe_steps:
            engine_args["enforce_eager"] = True  # the probe wraps the attention backend in Python
        llm = LLM(model=args.model, **engine_args)
        if samples is None:  # built once, with the tokenizer of the model under test
            tok = llm.llm_engine.tokenizer
            builder = T.TaskBuilder(tok, essays, eos_id=tok.eos_token_id)
            samples = T.build_suite(builder, tasks, lengths, args.num_samples, args.seed)
            model_desc = str(llm.llm_engine.model_name)
        rows = run_policy(llm, samples, use_tqdm=not args.quiet)
        if eos_ids is None:
            eos_ids, tok = set(llm.llm_engine.eos_token_ids), llm.llm_engine.tokenizer
        rows_by_policy[pol.name] = rows
        results[pol.name] = accuracy_table(rows)
        attended[pol.name] = mean_tokens_attended(llm, samples)
        if args.probe_steps:
            probe_samples = [s for t in tasks for n in lengths
                             for s in [x for x in samples if x.task == t and x.length == n][:args.probe_samples]]
            probes[pol.name] = attention_probe.probe(llm, probe_samples, args.probe_steps)
        timing[pol.name] = round(time.time() - t0, 2)
        llm = None
        _release_memory()  # the next engine (or the transformers reference) gets the GPU memory

    if args.compare_hf:  # after the engines are gone: the reference needs the memory they held
        hf_ids = hf_greedy(args.model, samples, args.device, args.dtype, eos_ids)
        hf_rows = []
        for r, s, ids in zip(rows_by_policy["dense"], samples, hf_ids):
            text = tok.decode(ids, skip_special_tokens=True)
            hf_rows.append({**r, "output": text, "output_token_ids": ids, "correct": T.is_correct(text, s.answer)})
            r["hf_match"] = _same_tokens(r["output_token_ids"], ids, eos_ids)
        rows_by_policy["hf"] = hf_rows
        results["hf"] = accuracy_table(hf_rows)
        parity: dict[str, dict[str, list[bool]]] = {}
        for r in rows_by_policy["dense"]:
            parity.setdefault(r["task"], {}).setdefault(str(r["length"]), []).append(r["hf_match"])
        parity_out = {t: {n: sum(v) / len(v) for n, v in d.items()} for t, d in parity.items()}

    print(f"\nexact-match accuracy (%), model {model_desc}, {args.num_samples} samples per cell, seed {args.seed}")
    print(format_table(results, tasks, lengths))
    print("mean tokens attended per decode query: "
          + ", ".join(f"{name} {tokens:.0f}" for name, tokens in attended.items()))
    # With 10 samples a cell moves 10 points on one low-margin sample: agreement with dense, sample by
    # sample, tells a policy that tracks dense from one that drifts.
    agree = {name: sum(a["output_token_ids"] == b["output_token_ids"] for a, b in zip(rows_by_policy["dense"], rows))
             for name, rows in rows_by_policy.items() if name not in ("dense", "hf")}
    if agree:
        print(f"outputs equal to dense (of {len(samples)}): " + ", ".join(f"{n} {k}" for n, k in agree.items()))
    if parity_out is not None:
        n_same = sum(r["hf_match"] for r in rows_by_policy["dense"])
        print(f"\nparity with transformers (same greedy tokens): {n_same}/{len(samples)}")
    if probes:
        print("\nattention probe: softmax mass covered / relative output error vs dense, per layer")
        for name, rep in probes.items():
            print(attention_probe.format_report(name, rep))
    out = {"model": args.model or "embedded default", "model_name": model_desc, "seed": args.seed,
           "num_samples": args.num_samples, "tasks": tasks, "lengths": lengths,
           "policies": {p.name: p.engine_args for p in policies}, "accuracy": results,
           "probe": probes, "seconds": timing, "mean_tokens_attended": attended, "hf_parity": parity_out,
           "equal_to_dense": agree,
           "samples": {name: rows for name, rows in rows_by_policy.items()}}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out, indent=1))
        print(f"\nwrote {args.output}")
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(p)
    main(p.parse_args())
