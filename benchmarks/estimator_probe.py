"""Which block estimator could prune without the candidates' keys (issue 40; docs/sparse.md, twenty-eighth session):
at decode steps of a dense engine, for each layer and KV head, how much of the dense softmax mass the top
blocks ranked by an estimator hold (its candidates' cover), against the block oracle at the same count, and
what a prune on the estimator's own block masses keeps (tokens, true mass) -- the prune that would let only the
kept blocks cross PCIe under KV offload. Estimators are summaries an engine could keep for every token (in HBM, or
pooled for the candidates: docs/offload.md); their bytes a token and KV head are listed beside (its K/V: 4 *
head_dim in bf16).

    python -m benchmarks.estimator_probe smollm2 --length 8128 --samples 3 --steps 3 --json /tmp/est.json

On two CPU cores 15 SmolLM2 prompts of 8K take about ten minutes; with `--device cuda` 50 take four. The figures
are the estimators' ranking and mass quality on that model's real attention, not the engine's kernels (the min /
max bounds are quantized as kernels/key_meta.py does; the other sketches are evaluated in float32).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from typing import Any, Callable

import torch

from sparseserve.bench.accuracy import SUITES, load_tokenizer
from sparseserve.kernels.key_meta import quantize_key_meta
from sparseserve.workloads import tasks as T

BLOCK = 16  # tokens a block (the accurate topp setting's blocks and pages)
SINK, LOCAL = 1, 4  # forced blocks, as the engine's defaults
CAPS = (1024, 2048, 4096)  # candidate tokens
TOP_P = 0.99


# ---- estimators: keys [H, n, D] float32, q [H, G, D] float32 (scale applied) -> est. block lse [H, G, nb] ----

Estimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _pages(keys: torch.Tensor, page: int) -> torch.Tensor:
    h, n, d = keys.shape
    pad = -n % page
    k = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=float("nan"))
    return k.view(h, -1, page, d)  # [H, np, page, D], NaN past the end


def quest(page: int) -> Estimator:
    """Upper bound of q.k per page from int8 min / max codes (kernels/key_meta.py), + log(tokens): as a mass."""

    def est(keys: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        p = _pages(keys, page)
        valid = ~p[..., 0].isnan()  # [H, np, page]
        kmin = torch.where(p.isnan(), torch.inf, p).amin(2)
        kmax = torch.where(p.isnan(), -torch.inf, p).amax(2)
        codes, scale = quantize_key_meta(kmin, kmax)  # [H, np, 2, D], [H, np]
        lo, hi = codes[:, :, 0].float() * scale[..., None], codes[:, :, 1].float() * scale[..., None]
        bound = torch.maximum(q[:, :, None] * lo[:, None], q[:, :, None] * hi[:, None]).sum(-1)  # [H, G, np]
        page_lse = bound + valid.sum(-1).clamp_min(1).float().log()[:, None]
        return _to_blocks(page_lse, BLOCK // page)

    return est


def centroid(var: bool) -> Estimator:
    """Mean key of each block (var: and a Gaussian's second-order term from the per-channel variance)."""

    def est(keys: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        p = _pages(keys, BLOCK)
        valid = ~p[..., 0].isnan()
        cnt = valid.sum(-1).clamp_min(1).float()  # [H, nb]
        z = torch.nan_to_num(p)
        mean = z.sum(2) / cnt[..., None]
        lse = torch.einsum("hgd,hbd->hgb", q, mean) + cnt.log()[:, None]
        if var:
            sq = (z * z).sum(2) / cnt[..., None] - mean * mean
            lse = lse + 0.5 * torch.einsum("hgd,hbd->hgb", q * q, sq.clamp_min(0))
        return lse

    return est


def token_sketch(approx: Callable[[torch.Tensor], torch.Tensor]) -> Estimator:
    """A per-token key approximation; the block's lse of q.k_approx over its tokens."""

    def est(keys: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        s = torch.einsum("hgd,hnd->hgn", q, approx(keys))
        return _block_lse(s)

    return est


def quantized(bits: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Symmetric per-token quantization to `bits` (1: sign times the mean |k|)."""

    def approx(keys: torch.Tensor) -> torch.Tensor:
        if bits == 1:
            return keys.sign() * keys.abs().mean(-1, keepdim=True)
        levels = 2 ** (bits - 1) - 1
        amax = keys.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        return (keys / amax * levels).round().clamp(-levels, levels) * amax / levels

    return approx


def low_rank(rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Projection on the top `rank` principal directions of the context's own keys (as a calibrated one would
    be: Loki), plus their mean."""

    def approx(keys: torch.Tensor) -> torch.Tensor:
        mean = keys.mean(1, keepdim=True)
        c = keys - mean
        _, _, v = torch.linalg.svd(c, full_matrices=False)  # [H, D, D]
        basis = v[:, :rank]  # [H, r, D]
        return torch.einsum("hnr,hrd->hnd", torch.einsum("hnd,hrd->hnr", c, basis), basis) + mean

    return approx


def channels(count: int) -> Estimator:
    """Double Sparsity's label channels: the `count` channels of largest mean |q_i k_i| (here from this query and
    the context: an upper bound of what a calibrated choice would reach), scaled to the full dot product."""

    def est(keys: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        contrib = (q.abs().mean(1)[:, None] * keys.abs()).mean(1)  # [H, D]
        idx = contrib.topk(count, dim=-1).indices  # [H, c]
        ks = keys.gather(2, idx[:, None].expand(-1, keys.shape[1], -1))
        qs = q.gather(2, idx[:, None].expand(-1, q.shape[1], -1))
        return _block_lse(torch.einsum("hgc,hnc->hgn", qs, ks))

    return est


def _block_lse(s: torch.Tensor) -> torch.Tensor:
    h, g, n = s.shape
    pad = -n % BLOCK
    s = torch.nn.functional.pad(s, (0, pad), value=-torch.inf).view(h, g, -1, BLOCK)
    return torch.logsumexp(s, -1)


def _to_blocks(page_lse: torch.Tensor, per: int) -> torch.Tensor:
    h, g, npg = page_lse.shape
    pad = -npg % per
    x = torch.nn.functional.pad(page_lse, (0, pad), value=-torch.inf).view(h, g, -1, per)
    return torch.logsumexp(x, -1)


def _bytes(d: int) -> dict[str, float]:
    """Bytes a token and KV head each summary keeps in HBM (bf16 floats, int8 codes, one float32 scale)."""
    return {
        "quest p16": (2 * d + 4) / 16,
        "quest p8": (2 * d + 4) / 8,
        "centroid": 2 * d / 16,
        "centroid+var": 4 * d / 16,
        "sign (1 bit)": d / 8 + 2,
        "int2": d / 4 + 2,
        "int3": 3 * d / 8 + 2,
        "int4": d / 2 + 2,
        "rank 8": 16,
        "rank 16": 32,
        "channels 8": 16,
        "channels 16": 32,
    }


ESTIMATORS: dict[str, Estimator] = {
    "quest p16": quest(16),
    "quest p8": quest(8),
    "centroid": centroid(False),
    "centroid+var": centroid(True),
    "sign (1 bit)": token_sketch(quantized(1)),
    "int2": token_sketch(quantized(2)),
    "int3": token_sketch(quantized(3)),
    "int4": token_sketch(quantized(4)),
    "rank 8": token_sketch(low_rank(8)),
    "rank 16": token_sketch(low_rank(16)),
    "channels 8": channels(8),
    "channels 16": channels(16),
}


# The offloaded design's pairs (docs/offload.md): candidates ranked by the first name's estimate (the key metadata,
# as today), pruned on the second's (a sketch pooled for the candidates) -- label -> (ranker, pruner)
DESIGNS: dict[str, tuple[str, str]] = {
    "min/max p16 -> int4": ("quest p16", "int4"),
    "min/max p16 -> int3": ("quest p16", "int3"),
}


# ---- the observer ----


class Study:
    """Per (estimator, metric) the values over layer-head-queries; layers below `first_layer` (dense) skipped."""

    def __init__(self, first_layer: int) -> None:
        self.first_layer = first_layer
        self.values: dict[str, list[float]] = defaultdict(list)
        self.head_dim = 0
        self.num_prompts = 0
        self.num_queries = 0  # decode queries observed (one a sequence a decode step)

    def observe(
        self, layer_idx: int, q: torch.Tensor, out: Any, kv_cache: torch.Tensor, meta: Any, scale: float
    ) -> None:
        if meta.num_decodes == 0 or layer_idx < self.first_layer:
            return
        if layer_idx == self.first_layer:
            self.num_queries += meta.num_decodes
        with torch.no_grad():
            self._measure(q, kv_cache, meta, scale)

    def _measure(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: Any, scale: float) -> None:
        _, hkv, _, bs, d = kv_cache.shape
        self.head_dim = d
        qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        for b in range(meta.num_decodes):
            n = lens[b]
            blocks = meta.block_tables[b, : -(-n // bs)].long()
            keys = kv_cache[blocks][:, :, 0].float().permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n]
            qb = q[qsl[b]].float().view(hkv, -1, d) * scale
            probs = torch.softmax(torch.einsum("hgd,hnd->hgn", qb, keys), -1).mean(1)  # [H, n]: the group's mean
            mass = torch.nn.functional.pad(probs, (0, -n % BLOCK)).view(hkv, -1, BLOCK).sum(-1)  # [H, nb]
            nb = mass.shape[1]
            forced = torch.zeros(nb, dtype=torch.bool, device=mass.device)
            forced[:SINK] = True
            forced[-LOCAL:] = True
            self._record("oracle", mass, mass, forced, n)
            weights = {}
            for name, est in ESTIMATORS.items():
                lse = est(keys, qb)  # [H, G, nb]
                weights[name] = weight = torch.softmax(lse, -1).mean(1)  # the group's mean estimated block mass
                self._record(name, weight, mass, forced, n)
            for name, (ranker, pruner) in DESIGNS.items():
                self._record_design(name, weights[ranker], weights[pruner], mass, forced, n)

    def _record(self, name: str, weight: torch.Tensor, mass: torch.Tensor, forced: torch.Tensor, n: int) -> None:
        w = torch.where(forced, torch.inf, weight)
        order = w.argsort(-1, descending=True)  # forced first, then by estimated mass
        ranked_mass = mass.gather(1, order)
        cum = ranked_mass.cumsum(-1)
        nb = mass.shape[1]
        for cap in CAPS:
            k = min(cap // BLOCK, nb)
            cover = cum[:, k - 1]
            self.values[f"{name}|cover {cap}"] += cover.tolist()
            # the exact prune (today's topp): forced entries, then the candidates by their true mass, until they
            # reach p of the list's mass
            fk = int(forced.sum())
            exact = torch.cat([ranked_mass[:, :fk], ranked_mass[:, fk:k].sort(-1, descending=True).values], -1)
            xcum = exact.cumsum(-1)
            keep = ((xcum < TOP_P * cover[:, None]).sum(-1) + 1).clamp(min(fk, k), k)
            self.values[f"{name}|exact prune {cap} tokens"] += (keep * BLOCK).clamp_max(n).tolist()
            self.values[f"{name}|exact prune {cap} mass"] += xcum.gather(1, (keep - 1)[:, None])[:, 0].tolist()
            # the key-free prune: candidates kept by the estimator's own masses until they reach p of the estimate
            ew = weight.gather(1, order)[:, :k]
            ecum = ew.cumsum(-1)
            ekeep = ((ecum < TOP_P * ew.sum(-1, keepdim=True)).sum(-1) + 1).clamp(min(fk, k), k)
            self.values[f"{name}|est prune {cap} tokens"] += (ekeep * BLOCK).clamp_max(n).tolist()
            self.values[f"{name}|est prune {cap} mass"] += cum.gather(1, (ekeep - 1)[:, None])[:, 0].tolist()

    def _record_design(
        self, name: str, rank: torch.Tensor, prune: torch.Tensor, mass: torch.Tensor, forced: torch.Tensor, n: int
    ) -> None:
        """Candidates: the cap's top blocks by `rank` (forced first); kept: forced, then the candidates by `prune`'s
        masses until those reach p of the candidates' (the prune's own estimate, as the key-free prune)."""
        order = torch.where(forced, torch.inf, rank).argsort(-1, descending=True)
        fk, nb = int(forced.sum()), mass.shape[1]
        for cap in CAPS[1:]:
            k = min(cap // BLOCK, nb)
            cand = order[:, :k]
            pw, pm = prune.gather(1, cand), mass.gather(1, cand)
            rest = pw[:, fk:].argsort(-1, descending=True) + fk
            idx = torch.cat([torch.arange(fk, device=rest.device).expand(rest.shape[0], fk), rest], -1)
            pw, pm = pw.gather(1, idx), pm.gather(1, idx)
            keep = ((pw.cumsum(-1) < TOP_P * pw.sum(-1, keepdim=True)).sum(-1) + 1).clamp(min(fk, k), k)
            self.values[f"{name}|pruned {cap} tokens"] += (keep * BLOCK).clamp_max(n).tolist()
            self.values[f"{name}|pruned {cap} mass"] += pm.cumsum(-1).gather(1, (keep - 1)[:, None])[:, 0].tolist()

    def report(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = defaultdict(dict)
        for key, vals in self.values.items():
            name, metric = key.split("|")
            t = torch.tensor(vals, dtype=torch.float64)
            out[name][metric] = t.mean().item()
            if metric.startswith("cover") or metric.endswith("mass"):
                out[name][metric + " p10"] = t.quantile(0.1).item()
                out[name][metric + " min"] = t.min().item()
                out[name][metric + " under 0.8"] = (t < 0.8).double().mean().item()
        return dict(out)


def run(model: str | None, length: int, samples: int, steps: int, seed: int = 0, device: str = "cpu") -> Study:
    """`samples` completion prompts a task of `length` tokens through a dense eager engine (the observer needs
    eager layers), `steps` decode steps each (EOS ignored); the study of every decode query."""
    from sparseserve import LLM, SamplingParams

    suite = SUITES["completion"]
    tok = load_tokenizer(model)
    builder = T.TaskBuilder(tok, T.load_essays(T.find_haystack_dir(None)), eos_id=tok.eos_token_id)
    prompts = suite.build(builder, list(suite.tasks), [length], samples, seed)
    llm = LLM(
        model=model,
        device=device,
        dtype="float32" if device == "cpu" else "bfloat16",
        max_model_len=length + steps + 8,
        enforce_eager=True,
        async_scheduling=False,
    )
    study = Study(llm.llm_engine.config.sparse_config.sparse_dense_layers)
    backend = llm.llm_engine.model_runner.attn_backend
    backend.observers.append(study.observe)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)  # the first from the prefill
    llm.generate([s.prompt_ids for s in prompts], params, use_tqdm=False)
    backend.observers.remove(study.observe)
    study.num_prompts = len(prompts)
    return study


def format_report(study: Study) -> str:
    rep, sizes = study.report(), _bytes(study.head_dim)
    lines = [
        f"{study.num_prompts} prompts, {study.num_queries} decode queries; layers >= {study.first_layer}; blocks of "
        f"{BLOCK}; p {TOP_P}; bytes a token and KV head (its K/V: {4 * study.head_dim})",
        f"{'estimator':<14}{'B/tok':>6}" + "".join(f"{'cover ' + str(c) + ' mean/p10':>22}" for c in CAPS),
    ]
    singles = {name: r for name, r in rep.items() if name not in DESIGNS}
    for name, r in singles.items():
        row = f"{name:<14}{sizes.get(name, math.nan):>6.1f}"
        lines.append(row + "".join(f"{r[f'cover {c}']:>16.4f}/{r[f'cover {c} p10']:.3f}" for c in CAPS))
    lines.append("prunes at p: mass mean / min / share of head-steps under 0.8 @ tokens kept")
    lines.append(f"{'estimator':<14}" + "".join(f"{k + ' ' + str(c):>30}" for c in CAPS[1:] for k in ("exact", "est")))
    for name, r in singles.items():
        row = f"{name:<14}"
        for c in CAPS[1:]:
            for kind in ("exact", "est"):
                m = f"{kind} prune {c} mass"
                tokens = r[f"{kind} prune {c} tokens"]
                row += f"{r[m]:>10.4f}/{r[m + ' min']:.3f}/{r[m + ' under 0.8']:.3f}@{tokens:<5.0f}"
        lines.append(row)
    lines.append("candidates by one estimate, pruned on another's masses: mass mean / min / under 0.8 @ tokens kept")
    for name in DESIGNS:
        r, row = rep[name], f"{name:<22}"
        for c in CAPS[1:]:
            m = f"pruned {c} mass"
            row += f"{r[m]:>10.4f}/{r[m + ' min']:.3f}/{r[m + ' under 0.8']:.3f}@{r[f'pruned {c} tokens']:<5.0f}"
        lines.append(row)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2", help="a model directory, a .gguf, smollm2 or embedded")
    ap.add_argument("--length", type=int, default=8128)
    ap.add_argument("--samples", type=int, default=3, help="prompts a task (completion suite)")
    ap.add_argument("--steps", type=int, default=3, help="decode steps a prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = None if args.model == "embedded" else args.model
    study = run(model, args.length, args.samples, args.steps, args.seed, args.device)
    print(format_report(study))
    if args.json:
        with open(args.json, "w") as f:
            out = {"args": vars(args), "bytes_per_token_head": _bytes(study.head_dim), "report": study.report()}
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
