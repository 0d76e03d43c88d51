"""Attention-level report: how close a policy's attention is to dense, per layer, at decode steps.

The probe observes the engine's attention backend (`llm.llm_engine.model_runner.attn_backend`: an observer
the backend calls after every layer's attention, attention/backend.py). For each decode query it recomputes
dense attention in float32 over the request's whole context from the paged KV cache, and measures:

  mass:    the share of the dense softmax probability that falls on the tokens the policy attended
           (1 for dense; what a sparse policy drops is 1 - mass);
  rel_err: ||out - out_dense|| / ||out_dense|| of the attention output the backend returned (so the
           kernel's own rounding shows as the floor: about 1e-3 to 1e-2 in bf16 for dense);
  oracle_block: the mass of the best selection of as many blocks as the policy attended for that KV head
           (the blocks of largest dense mass averaged over the group): what a perfect block estimator could
           cover at the same budget, so mass < oracle_block is the estimator's loss, 1 - oracle_block the budget's;
  oracle_token: the mass of each query head's own top tokens, as many as the policy attended: the bound of
           any selection at that budget, per head and per token (no blocks, no sharing within the group).

Which tokens a policy attended: a sparse backend exposes `attended_blocks(layer_idx, meta)`, a bool
tensor [num_decodes, num_kv_heads, max_blocks] over the block table of the step just run (all query
heads of a KV group share one selection). Without that method the backend is dense: every block.
`probe` runs its requests through an engine of its own built with enforce_eager (a captured CUDA graph replays
without Python, so it would not call the observer). Not under KV offload (the device cache then holds only the
decode windows).
"""

from __future__ import annotations

from typing import Any

import torch

from sparseserve.workloads.tasks import TaskSample


class AttentionProbe:
    def __init__(self, backend: Any) -> None:
        self.backend = backend
        # layer -> (mass, min mass, rel_err, oracle_block, oracle_token)
        self.records: dict[int, list[tuple[float, float, float, float, float]]] = {}

    def __enter__(self) -> "AttentionProbe":
        self.backend.observers.append(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        self.backend.observers.remove(self._observe)

    def _observe(
        self, layer_idx: int, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, meta: Any, scale: float
    ) -> None:
        if meta.num_decodes > 0:
            with torch.no_grad():
                self._measure(layer_idx, q, out, kv_cache, meta, scale)

    def _selection(self, layer_idx: int, meta: Any) -> torch.Tensor | None:
        fn = getattr(self.backend, "attended_blocks", None)
        return None if fn is None else fn(layer_idx, meta)

    def _measure(
        self, layer_idx: int, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, meta: Any, scale: float
    ) -> None:
        _, num_kv_heads, _, block_size, _ = kv_cache.shape
        num_q_heads = q.shape[1]
        group = num_q_heads // num_kv_heads
        selection = self._selection(layer_idx, meta)
        qsl = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        for b in range(meta.num_decodes):
            n = seq_lens[b]
            nb = -(-n // block_size)
            blocks = meta.block_tables[b, :nb].long()
            kv = kv_cache[blocks].float()  # [nb, Hkv, 2, bs, D]
            keys = kv[:, :, 0].permute(1, 0, 2, 3).reshape(num_kv_heads, nb * block_size, -1)[:, :n]
            vals = kv[:, :, 1].permute(1, 0, 2, 3).reshape(num_kv_heads, nb * block_size, -1)[:, :n]
            qb = q[qsl[b]].float().view(num_kv_heads, group, -1)  # query head h reads KV head h // group
            probs = torch.softmax(torch.einsum("hgd,hnd->hgn", qb, keys) * scale, dim=-1)
            dense = torch.einsum("hgn,hnd->hgd", probs, vals).reshape(num_q_heads, -1)
            if selection is None:
                mass = torch.ones(num_q_heads)
                oracle_block = oracle_token = 1.0
            else:
                sel = selection[b, :, :nb]  # [Hkv, nb]
                token_mask = sel.repeat_interleave(block_size, dim=-1)[:, :n]  # [Hkv, n]
                mass = (probs * token_mask[:, None, :].to(probs.dtype)).sum(-1).reshape(-1)
                oracle_block, oracle_token = _oracle_masses(probs, sel, block_size)
            got = out[qsl[b]].float().reshape(num_q_heads, -1)
            err = ((got - dense).norm() / dense.norm().clamp_min(1e-30)).item()
            self.records.setdefault(layer_idx, []).append(
                (mass.mean().item(), mass.min().item(), err, oracle_block, oracle_token)
            )

    def report(self) -> dict:
        """Per layer: mean and minimum mass (minimum over query heads and steps), mean and max error, and the
        mean oracle masses at the same budget."""
        layers = {}
        for layer in sorted(self.records):
            rec = self.records[layer]
            layers[str(layer)] = {
                "mass_mean": sum(r[0] for r in rec) / len(rec),
                "mass_min": min(r[1] for r in rec),
                "rel_err_mean": sum(r[2] for r in rec) / len(rec),
                "rel_err_max": max(r[2] for r in rec),
                "oracle_block_mean": sum(r[3] for r in rec) / len(rec),
                "oracle_token_mean": sum(r[4] for r in rec) / len(rec),
                "num_queries": len(rec),
            }
        return {"layers": layers}


def _oracle_masses(probs: torch.Tensor, sel: torch.Tensor, block_size: int) -> tuple[float, float]:
    """Mean over query heads of the mass of the best block selection (per KV head, as many blocks as `sel`
    holds, ranked by the group's mean block mass) and of each head's best token selection (as many tokens
    as those blocks hold, capped at the context). probs [Hkv, group, n]; sel bool [Hkv, nb]."""
    hkv, group, n = probs.shape
    nb = sel.shape[1]
    blocks = torch.nn.functional.pad(probs, (0, nb * block_size - n)).view(hkv, group, nb, block_size).sum(-1)
    counts = sel.sum(-1).tolist()
    best_blocks, best_tokens = [], []
    for h in range(hkv):
        k = int(counts[h])
        top = blocks[h].mean(0).topk(k).indices
        best_blocks.append(blocks[h][:, top].sum(-1))  # [group]
        best_tokens.append(probs[h].topk(min(k * block_size, n), dim=-1).values.sum(-1))
    return torch.cat(best_blocks).mean().item(), torch.cat(best_tokens).mean().item()


def probe(model: str | None, engine_args: dict, samples: list[TaskSample], steps: int) -> dict:
    """Runs `samples` for `steps` decode steps each (greedy, EOS ignored so every step happens) through an eager
    engine of `engine_args` with the probe installed, and returns its per-layer report."""
    from sparseserve import LLM, SamplingParams

    llm = LLM(model=model, **{**engine_args, "enforce_eager": True})
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    with AttentionProbe(llm.llm_engine.model_runner.attn_backend) as p:
        llm.generate([s.prompt_ids for s in samples], params, use_tqdm=False)
    rep = p.report()
    rep.update(num_requests=len(samples), decode_steps=steps)
    return rep


def format_report(name: str, rep: dict) -> str:
    lines = [
        f"[{name}] {rep.get('num_requests', '?')} requests x {rep.get('decode_steps', '?')} decode steps",
        f"{'layer':>6}{'mass mean':>11}{'mass min':>10}{'err mean':>10}{'err max':>10}"
        f"{'oracle blk':>12}{'oracle tok':>12}",
    ]
    for layer, r in rep["layers"].items():
        lines.append(
            f"{layer:>6}{r['mass_mean']:>11.4f}{r['mass_min']:>10.4f}"
            f"{r['rel_err_mean']:>10.2e}{r['rel_err_max']:>10.2e}"
            f"{r.get('oracle_block_mean', 1.0):>12.4f}{r.get('oracle_token_mean', 1.0):>12.4f}"
        )
    return "\n".join(lines)
