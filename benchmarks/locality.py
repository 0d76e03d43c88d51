"""Locality of sparse decode selections: how much of each decode step's block list the previous step already
listed, and how large the union of a request's lists over a window of steps is (its working set, what
working-set-aware batch control budgets; kvcache/working_set.py).

    python -m benchmarks.locality --model MODEL [--load-format dummy] [--prompt-len N] [--batch B]
                                         [--steps N] [--budget TOKENS] [--window 12] [--json out.json]

`--model 8b` is Llama-3.1-8B's shape with the embedded tokenizer (benchmarks/model_dir.py; use --load-format dummy),
`--model smollm2` the real SmolLM2-135M-Instruct (README). Prompts are essays (the haystack; without it the
built-in filler sentences), the same for random and real weights; every request decodes `--steps` tokens
greedily with the topk policy at `--budget`.

An observer of the sparse backend (attention/backend.py `observers`; the engine runs eagerly so it sees every
layer) reads, per decode row, sparse layer and KV head, the list S_t of blocks the HBM pool would be asked for:
the list entries outside the local window (sink blocks included, unless --no-sink). Per layer, averaged over
rows, heads and steps:
  overlap   |S_t & S_t-1| / |S_t|   the share of a list the previous step's list held (a pool holding the previous
                                    step's lists hits it; 1 - overlap of each list is loaded at R=1)
  jaccard   |S_t & S_t-1| / |S_t | S_t-1|
  union_w   |S_t-w+1 | ... | S_t| / mean |S|   a request's working set over w steps in lists (1: the lists never
                                    change; w: disjoint lists every step)
  listed    mean |S_t| in blocks
What they imply for the pool: each decoding request loads about (1 - overlap) x listed head blocks per (sparse
layer, KV head) and step when its previous lists are resident, and needs about union_w x listed of them resident
over a window; `implications` states both in head blocks and bytes per request.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import make_8b_dir
from sparseserve.bench.hardware import print_table
from sparseserve.kernels.sparse_decode import listed_rows


class SelectionLocality:
    """Observer of a SparseBackend's decode lists; statistics accumulate on the device (no sync per layer)."""

    def __init__(self, backend: Any, window: int, max_blocks: int, sink: bool = True) -> None:
        self.backend, self.window, self.sink = backend, window, sink
        st, p = backend.state, backend.params
        layers, _, hkv, _ = st.sel.shape
        dev = st.sel.device
        self.ring = torch.zeros(layers, window, st.num_slots, hkv, max_blocks, dtype=torch.bool, device=dev)
        self.steps = torch.zeros(layers, st.num_slots, dtype=torch.long, device=dev)
        self.owner: dict[int, int] = {}  # slot -> seq_id whose lists the ring holds
        # per layer: rows x heads counted, sums of overlap, jaccard, listed; union rows counted, sum of union_w
        self.sums = torch.zeros(layers, 6, dtype=torch.float64, device=dev)
        self.params = p

    def __enter__(self) -> "SelectionLocality":
        self.backend.observers.append(self.observe)
        return self

    def __exit__(self, *exc) -> None:
        self.backend.observers.remove(self.observe)

    def observe(self, layer: int, q, out, kv_cache, meta, scale) -> None:
        nd = meta.num_decodes
        if nd == 0 or not self.backend.is_sparse(layer, meta):
            return
        slots = meta.backend_meta.slots[:nd].long()
        self._follow_owners()
        sel = self.backend.state.sel[layer][slots]
        listed = listed_rows(sel, meta.seq_lens[:nd], self.params.local, self.params.block_size)
        if not self.sink:
            listed &= sel >= self.params.sink
        mb = self.ring.shape[-1]
        cur = torch.zeros(*sel.shape[:2], mb + 1, dtype=torch.bool, device=sel.device)
        cur.scatter_(-1, torch.where(listed, sel.long(), mb).clamp_max(mb), True)
        cur = cur[..., :mb]
        k = self.steps[layer, slots]  # [nd]
        w = self.window
        prev = self.ring[layer, (k - 1) % w, slots]
        size = cur.sum(-1).double()
        inter = (cur & prev).sum(-1).double()
        union = (cur | prev).sum(-1).double()
        ok = ((k >= 1)[:, None] & (size > 0)).double()
        s = self.sums[layer]
        s[0] += ok.sum()
        s[1] += (ok * inter / size.clamp_min(1)).sum()
        s[2] += (ok * inter / union.clamp_min(1)).sum()
        s[3] += (ok * size).sum()
        self.ring[layer, k % w, slots] = cur
        window = self.ring[layer, :, slots]  # [w, nd, H, MB]
        full = ((k + 1 >= w)[:, None] & (size > 0)).double()
        mean_size = window.sum(-1).double().mean(0)
        s[4] += full.sum()
        s[5] += (full * window.any(0).sum(-1).double() / mean_size.clamp_min(1)).sum()
        self.steps[layer, slots] += 1

    def _follow_owners(self) -> None:
        """A slot handed to another sequence starts its ring afresh."""
        for sid, slot in self.backend.state.held_slots().items():
            if self.owner.get(slot) != sid:
                self.owner[slot] = sid
                self.steps[:, slot] = 0
                self.ring[:, :, slot] = False

    def report(self) -> list[dict]:
        """Per sparse layer: overlap, jaccard, union_w (over `window` steps), listed blocks."""
        rows = []
        for layer, (n, ov, jac, size, nu, uw) in enumerate(self.sums.tolist()):
            if n == 0:
                continue
            rows.append(
                {
                    "layer": layer,
                    "overlap": ov / n,
                    "jaccard": jac / n,
                    f"union_{self.window}": uw / nu if nu else None,
                    "listed": size / n,
                }
            )
        return rows


def summarize(rows: list[dict], window: int) -> dict:
    """Means over the layers."""
    key = f"union_{window}"
    out: dict[str, Any] = {"layer": "mean"}
    for k in ("overlap", "jaccard", key, "listed"):
        vals = [r[k] for r in rows if r.get(k) is not None]
        out[k] = sum(vals) / len(vals) if vals else None
    return out


def measure(
    model: str,
    *,
    prompt_len: int,
    batch: int,
    steps: int,
    budget: int,
    window: int = 12,
    load_format: str = "auto",
    device: str = "auto",
    dtype: str = "auto",
    sink: bool = True,
    **engine_args,
) -> dict:
    """Runs `batch` essay prompts of `prompt_len` tokens through `steps` greedy decode steps (topk at `budget`,
    eager so the observer sees every layer) and returns the per-layer locality, the means and the implications."""
    from sparseserve.bench.accuracy import load_tokenizer
    from sparseserve.workloads.datasets import haystack_token_ids
    from sparseserve.engine.engine import LLMEngine
    from sparseserve.sampling_params import SamplingParams

    tok = load_tokenizer(model)
    try:
        prompts = [haystack_token_ids(tok, prompt_len, f"locality:{i}") for i in range(batch)]
    except FileNotFoundError as e:  # a plain clone: no essays
        from sparseserve.workloads.tasks import PASSKEY_FILLER

        print(f"note: {e}; the prompts are the built-in filler sentences instead", file=sys.stderr)
        ids = tok.encode(PASSKEY_FILLER, add_special_tokens=False)
        ids = ids * (prompt_len // len(ids) + batch + 1)
        prompts = [ids[i * 7 : i * 7 + prompt_len] for i in range(batch)]
    kw = dict(
        model=model,
        load_format=load_format,
        device=device,
        dtype=dtype,
        max_model_len=prompt_len + steps + 1,
        max_num_seqs=batch,
        sparse_policy="topk",
        sparse_budget=budget,
        enforce_eager=True,
        async_scheduling=False,  # unless engine_args ask (as measured)
    )
    engine = LLMEngine.from_kwargs(**{**kw, **engine_args})
    runner = engine.model_runner
    backend = runner.attn_backend
    bs = runner.block_size
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"l{i}", p, params)
    with SelectionLocality(backend, window, -(-(prompt_len + steps + 1) // bs), sink) as probe:
        while engine.has_unfinished_requests():
            engine.step()
    rows = probe.report()
    mean = summarize(rows, window)
    a = runner.arch
    lists = len(rows) * runner.num_kv_heads  # sparse layers x KV heads of this rank
    head_block = 2 * bs * a.head_dim * runner.dtype.itemsize
    union = mean[f"union_{window}"]
    implications = None
    if mean["listed"] is not None:
        per_step = (1 - mean["overlap"]) * mean["listed"] * lists
        ws = union * mean["listed"] * lists if union is not None else None
        implications = {
            "head_blocks_listed_per_request_step": mean["listed"] * lists,
            "new_head_blocks_per_request_step": per_step,
            "new_MB_per_request_step": per_step * head_block / 1e6,
            "working_set_head_blocks_per_request": ws,
            "working_set_GB_per_request": ws * head_block / 1e9 if ws is not None else None,
        }
    return {
        "model": model,
        "load_format": load_format,
        "prompt_len": prompt_len,
        "batch": batch,
        "steps": steps,
        "budget": budget,
        "block_size": bs,
        "window": window,
        "sink_counted": sink,
        "layers": rows,
        "mean": mean,
        "implications": implications,
    }


def _model_arg(model: str) -> str:
    if model != "8b":
        return model
        return str(make_8b_dir(Path(tempfile.mkdtemp(prefix="sparseserve-8b-"))))


def main(argv: list[str] | None = None) -> None:
    from sparseserve.bench.accuracy import parse_engine_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory, GGUF, smollm2, or 8b (Llama-3.1-8B shapes)")
    p.add_argument("--load-format", default="auto", help="auto, or dummy (random weights)")
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=48, help="decode steps (tokens) per request")
    p.add_argument("--budget", type=int, default=1024, help="topk sparse_budget in tokens")
    p.add_argument("--window", type=int, default=12, help="steps of the union (working_set_window)")
    p.add_argument("--no-sink", action="store_true", help="leave the sink blocks (always listed) out")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, else auto")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra engine argument (repeatable), e.g. sparse_reuse=4",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available() and args.device != "cpu"
    result = measure(
        _model_arg(args.model),
        prompt_len=args.prompt_len,
        batch=args.batch,
        steps=args.steps,
        budget=args.budget,
        window=args.window,
        load_format=args.load_format,
        device=args.device,
        dtype=args.dtype or ("bfloat16" if on_gpu else "auto"),
        sink=not args.no_sink,
        **parse_engine_args(args.engine_arg),
    )
    result["model"] = args.model
    result["date"] = datetime.date.today().isoformat()
    print_table(
        result["layers"] + [result["mean"]],
        f"{args.model} ({args.load_format}): topk {args.budget}, {args.prompt_len}-token essays, "
        f"{args.steps} decode steps x {args.batch}; listed = blocks a list asks the pool for",
    )
    if result["implications"]:
        print_table([result["implications"]], "per decoding request (all sparse layers and KV heads)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
