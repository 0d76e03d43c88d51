"""Streaming heads from a dense run (the --streaming-heads file): per (layer, KV head), the share of each decode
query's softmax mass on the sink blocks and the local window (the blocks a streaming head keeps), averaged over
the group's query heads. A head whose mass there stays at or above the threshold at every measured query is
proposed, in layers >= the dense layers, at most max_fraction of the sparse layers' heads (the highest minimum
mass first)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


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


def propose(
    mass: dict[int, list[torch.Tensor]], threshold: float, dense_layers: int, max_fraction: float
) -> tuple[dict[str, list[int]], dict[str, Any]]:
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


def calibrate(args: argparse.Namespace, prompts_of: Callable[[Any], list[list[int]]]) -> dict:
    """Writes args.out (the proposal under "streaming_heads", the format SparseBackend reads, and every head's
    mean and minimum mass); prompts_of(engine) -> token-id prompts."""
    from sparseserve import LLM, SamplingParams
    from sparseserve.bench.accuracy import model_context

    lengths = [int(x) for x in args.lengths.split(",") if x]
    max_len, context = max(lengths) + args.decode_steps + 8, model_context(args.model)
    if max_len > context:
        raise ValueError(
            f"prompts of {max(lengths)} tokens and {args.decode_steps} decode steps need "
            f"max_model_len={max_len}, more than the model's context ({context}): use --lengths "
            f"{context - args.decode_steps - 8} or less"
        )
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        enforce_eager=True,
        max_model_len=max_len,
    )
    engine = llm.llm_engine
    prompts = prompts_of(engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 1, ignore_eos=True)
    with SinkLocalProbe(engine.model_runner.attn_backend, args.sparse_sink_blocks, args.sparse_local_blocks) as probe:
        llm.generate(prompts, params, use_tqdm=False)
    heads, stats = propose(probe.mass, args.threshold, args.sparse_dense_layers, args.max_fraction)
    out = {
        "streaming_heads": heads,
        "threshold": args.threshold,
        "model": engine.model_name,
        "block_size": args.block_size,
        "sink_blocks": args.sparse_sink_blocks,
        "local_blocks": args.sparse_local_blocks,
        "lengths": lengths,
        "num_prompts": len(prompts),
        "sink_local_mass": stats,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    a = engine.model_runner.arch
    print(
        f"proposed {sum(map(len, heads.values()))} of {a.num_layers * a.num_kv_heads} (layer, KV head) pairs "
        f"as streaming heads -> {args.out}"
    )
    return out
