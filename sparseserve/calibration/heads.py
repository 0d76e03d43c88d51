"""Offline calibration from a dense run: streaming heads (the --streaming-heads file), or with --prefill the
per-head thresholds of SALE's sparse prefill (the --sparse-prefill-calibration file; bench/prefill_calibration.py).

    python -m sparseserve.bench.calibrate [MODEL] --lengths 8192 --num-samples 4 --out heads.json
    python -m sparseserve.bench.calibrate [MODEL] --prefill --lengths 16384 --num-samples 2 --out prefill.json
    python -m sparseserve.bench.calibrate smollm2 --suite completion --lengths 8128 --out smollm2_heads.json

Streaming heads: runs long-context task prompts (bench/tasks.py, or bench/completion_tasks.py with --suite
completion; --random-prompts for random tokens) densely for a few
decode steps and measures, per (layer, KV head), the share of each decode query's softmax mass that
falls on the sink blocks and the local window (the blocks a streaming head keeps), averaged over the
query heads of the group. A head whose mass there stays at or above --threshold at every measured
query is proposed, in layers >= --dense-layers, at most --max-fraction of the sparse layers' heads
(those with the highest minimum mass first). The JSON holds the proposal under "streaming_heads"
(the format SparseBackend reads) and every head's mean and minimum mass.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from sparseserve.bench import prefill_calibration


class SinkLocalProbe:
    """Observes the backend; after each layer, for each decode query: mass on sink + local per KV head."""

    def __init__(self, backend: Any, sink_blocks: int, local_blocks: int) -> None:
        self.backend, self.sink, self.local = backend, sink_blocks, local_blocks
        self.mass: dict[int, list[torch.Tensor]] = {}  # layer -> [Hkv] per decode query

    def __enter__(self) -> "SinkLocalProbe":
        self.backend.observers.append(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        self.backend.observers.remove(self._observe)

    def _observe(self, layer_idx, q, out, kv_cache, meta, scale) -> None:
        for b in range(meta.num_decodes):  # calibration, not the decode step: a Python loop is fine
            self._measure(layer_idx, q[b], kv_cache, meta, b, scale)

    @torch.no_grad()
    def _measure(self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor, meta: Any, b: int, scale: float) -> None:
        _, hkv, _, bs, d = kv_cache.shape
        n = int(meta.seq_lens[b])
        nb = -(-n // bs)
        keys = kv_cache[meta.block_tables[b, :nb].long(), :, 0].float()  # [nb, Hkv, bs, D]
        keys = keys.permute(1, 0, 2, 3).reshape(hkv, nb * bs, d)[:, :n]
        qg = q.float().view(hkv, -1, d)
        probs = torch.softmax(torch.einsum("hgd,hnd->hgn", qg, keys) * scale, -1)
        pos = torch.arange(n, device=q.device)
        kept = (pos < self.sink * bs) | (pos >= max(nb - self.local, 0) * bs)
        self.mass.setdefault(layer, []).append((probs * kept).sum(-1).mean(-1).cpu())


def propose(mass: dict[int, list[torch.Tensor]], threshold: float, dense_layers: int,
            max_fraction: float) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """(streaming heads by layer, per-layer mean and min mass per KV head)."""
    stats, ranked = {}, []
    for layer in sorted(mass):
        m = torch.stack(mass[layer])  # [queries, Hkv]
        stats[str(layer)] = {"mean": m.mean(0).tolist(), "min": m.min(0).values.tolist()}
        if layer >= dense_layers:
            ranked += [(float(lo), layer, h) for h, lo in enumerate(m.min(0).values)]
    ranked.sort(reverse=True)
    heads: dict[str, list[int]] = {}
    for lo, layer, h in ranked[: int(max_fraction * len(ranked))]:
        if lo >= threshold:
            heads.setdefault(str(layer), []).append(h)
    return {k: sorted(v) for k, v in sorted(heads.items(), key=lambda kv: int(kv[0]))}, stats


# Retrieval prompts: a head that the needle's lookup needs must not look like a streaming head.
CALIBRATION_TASKS = {"ruler": "niah_single,variable_tracking",
                     "completion": "needle_multikey,needle_multivalue,extract_record"}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="Model directory, .gguf file or known name such as smollm2 (default: embedded model).")
    p.add_argument("--out", required=True, help="JSON file to write (streaming heads, or --prefill thresholds).")
    p.add_argument("--prefill", action="store_true",
                   help="Calibrate the per-head thresholds of sparse prefill (sparse_prefill=sale) instead.")
    p.add_argument("--lengths", default="8192", help="Prompt lengths in tokens, comma-separated.")
    p.add_argument("--num-samples", type=int, default=2, help="Prompts per task and length.")
    p.add_argument("--suite", default="ruler", choices=["ruler", "completion"],
                   help="Task suite of the prompts (bench/accuracy.py): completion for small instruct models.")
    p.add_argument("--tasks", default=None, help="Tasks of the suite (default: ruler niah_single,variable_tracking; "
                                                  "completion needle_multikey,needle_multivalue,extract_record).")
    p.add_argument("--random-prompts", action="store_true", help="Random token prompts instead of tasks.")
    p.add_argument("--decode-steps", type=int, default=8, help="Decode steps measured per prompt.")
    p.add_argument("--threshold", type=float, default=0.9, help="Minimum sink + local mass of a streaming head.")
    p.add_argument("--max-fraction", type=float, default=0.5, help="At most this share of sparse-layer heads.")
    p.add_argument("--sparse-sink-blocks", type=int, default=1, help="As the engine flag.")
    p.add_argument("--sparse-local-blocks", type=int, default=4, help="As the engine flag.")
    p.add_argument("--sparse-dense-layers", type=int, default=2, help="As the engine flag.")
    p.add_argument("--block-size", type=int, default=32, help="As the engine flag.")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu.")
    p.add_argument("--dtype", default="auto", help="Model dtype.")
    p.add_argument("--data-dir", default=None, help="Essay folder of the tasks.")
    p.add_argument("--seed", type=int, default=0)
    prefill_calibration.add_cli_args(p)


def calibration_prompts(engine: Any, args: argparse.Namespace) -> list[list[int]]:
    """Task prompts (bench/tasks.py) or random tokens, --num-samples of each length (and task)."""
    from sparseserve.bench import tasks as T

    lengths = [int(x) for x in args.lengths.split(",") if x]
    if args.random_prompts:
        g = torch.Generator().manual_seed(args.seed)
        vocab = engine.model_runner.arch.vocab_size
        return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths for _ in range(args.num_samples)]
    tok = engine.tokenizer
    builder = T.TaskBuilder(tok, T.load_essays(T.find_haystack_dir(args.data_dir)), eos_id=tok.eos_token_id)
    from sparseserve.bench.accuracy import SUITES

    tasks = args.tasks or CALIBRATION_TASKS[args.suite]
    samples = SUITES[args.suite].build(builder, [t for t in tasks.split(",") if t], lengths, args.num_samples,
                                       args.seed)
    return [s.prompt_ids for s in samples]


def main(args: argparse.Namespace) -> dict:
    from sparseserve import LLM, SamplingParams

    from sparseserve.bench.accuracy import model_context

    if args.prefill:
        return prefill_calibration.main(args, lambda engine: calibration_prompts(engine, args))
    lengths = [int(x) for x in args.lengths.split(",") if x]
    max_len, context = max(lengths) + args.decode_steps + 8, model_context(args.model)
    if max_len > context:
        raise ValueError(f"prompts of {max(lengths)} tokens and {args.decode_steps} decode steps need "
                         f"max_model_len={max_len}, more than the model's context ({context}): use --lengths "
                         f"{context - args.decode_steps - 8} or less")
    llm = LLM(args.model, device=args.device, dtype=args.dtype, block_size=args.block_size, enforce_eager=True,
              max_model_len=max_len)
    engine = llm.llm_engine
    prompts = calibration_prompts(engine, args)
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 1, ignore_eos=True)
    with SinkLocalProbe(engine.model_runner.attn_backend, args.sparse_sink_blocks, args.sparse_local_blocks) as probe:
        llm.generate(prompts, params, use_tqdm=False)
    heads, stats = propose(probe.mass, args.threshold, args.sparse_dense_layers, args.max_fraction)
    out = {"streaming_heads": heads, "threshold": args.threshold, "model": engine.model_name,
           "block_size": args.block_size, "sink_blocks": args.sparse_sink_blocks,
           "local_blocks": args.sparse_local_blocks, "lengths": lengths, "num_prompts": len(prompts),
           "sink_local_mass": stats}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    a = engine.model_runner.arch
    print(f"proposed {sum(map(len, heads.values()))} of {a.num_layers * a.num_kv_heads} (layer, KV head) pairs "
          f"as streaming heads -> {args.out}")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(ap)
    main(ap.parse_args())
