"""Issue 40: where a selection policy's decode layer spends its time, stage by stage, each stage in a CUDA graph
of its own: the scoring alone over launch variants (`ScoreConfig`), scoring and selection (as the engine calls
them), and for topp the candidates' block lse and the prune over variants (the lse's tile; the prune's sort or
rounds of `ways` thresholds; the first of each is the default; then as the engine runs flagged flat lists, whose
programs return at once), then the attention over the final lists (over launch variants: `ATTENTION_CONFIGS`). One
layer at Llama-3.1-8B's attention shape (32 query / 8 KV heads, D=128, bf16) over random keys and queries, batch B
at each context: attention is flat, so a topp list is flat (it takes half the cap, unpruned), as with the dummy
weights of `benchmarks.sparse --step`.

    python -m benchmarks.topp_parts --contexts 32768 131072 --batch 4 --policies topk:sparse_budget=2048 \\
        topp:sparse_budget=4096,sparse_top_p=0.99,logical_page_size=16 [--json out.json]

A spec is the accuracy benchmark's (`block_size=16` sets the cache's block size; default 32).
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Callable
from dataclasses import replace

import torch
import triton

from benchmarks.sparse import DTYPE, backend, graph_ms
from sparseserve.attention.selection import DecodeRows
from sparseserve.bench.hardware import print_table
from sparseserve.config import SparseConfig, policy_default
from sparseserve.kernels.block_score import ScoreConfig, block_scores_triton
from sparseserve.kernels.sparse_decode import FAST_CONFIG, TMA_CONFIG, SparseDecodeConfig, sparse_decode_triton
from sparseserve.kernels.topp_prune import block_lse_triton, prune_lists_triton

HQ, HKV, D = 32, 8, 128
LSE_TILES = (128, 64, 256)  # tokens a block-lse program reads (the default first)
# the prune's threshold search: a sort of the masses (the default up to SORT_MAX_CAP, first) or rounds of `ways`
PRUNE_SEARCHES = ({"sort": True}, {"sort": False, "ways": 4}, {"sort": False, "ways": 8}, {"sort": False, "ways": 16})

# the scoring launch: (metadata rows a tile, warps, pipeline stages, tiles a program); the default first
SCORE_CONFIGS = (
    ScoreConfig(),
    ScoreConfig(rows=256),
    ScoreConfig(num_warps=8),
    ScoreConfig(num_stages=3),
    ScoreConfig(tiles=4),
    ScoreConfig(tiles=8),
    ScoreConfig(rows=64, tiles=4),
    ScoreConfig(rows=256, num_warps=8, num_stages=3),
    ScoreConfig(rows=256, tiles=4),
    ScoreConfig(num_stages=3, tiles=4),
    ScoreConfig(num_stages=4, tiles=8),
    ScoreConfig(rows=64, num_warps=2, tiles=8),
    ScoreConfig(rows=512, num_warps=8),
    ScoreConfig(rows=256, num_warps=8, tiles=4),
)

# the attention's split kernel: the default (sparse_decode.default_config) first, then variants of
# each gather (plain: tile_n tokens a tile, whole blocks; TMA: a box a block)
ATTENTION_CONFIGS: tuple[tuple[str, SparseDecodeConfig | None], ...] = (
    ("default", None),
    ("plain", FAST_CONFIG),
    ("plain,tile_n=64", replace(FAST_CONFIG, tile_n=64)),
    ("plain,tile_n=256,tiles=2", replace(FAST_CONFIG, tile_n=256, tiles=2)),
    ("plain,tiles=2", replace(FAST_CONFIG, tiles=2)),
    ("plain,warps=8", replace(FAST_CONFIG, num_warps=8)),
    ("tma,warps=4", replace(TMA_CONFIG, num_warps=4)),
    ("tma,tiles=8", replace(TMA_CONFIG, tiles=8)),
)

Stage = tuple[str, str, Callable[[], object]]  # (stage, variant, call)


def layer_stages(
    spec: str, ctx: int, batch: int, device: str = "cuda", dtype: torch.dtype = DTYPE
) -> tuple[list[Stage], torch.Tensor]:
    """One sparse layer of the policy `spec` over random K/V: its stages in the order the engine runs them, each
    call leaving the inputs of the next (run them once in order before timing any), and the lists the attention
    reads (topp: the prune's output; the candidates stay, so every call prunes the same lists)."""
    from sparseserve.bench.accuracy import parse_policy

    args = dict(parse_policy(spec).engine_args)
    bs = int(args.pop("block_size", None) or policy_default(args.get("sparse_policy", "dense"), "block_size"))
    cfg = SparseConfig(**args, sparse_dense_layers=0, sparse_dense_context=0)
    per_seq = triton.cdiv(ctx, bs)
    cache = torch.randn(1, batch * per_seq, HKV, 2, bs, D, device=device, dtype=dtype)
    tables = torch.randperm(batch * per_seq, device=device).to(torch.int32).view(batch, per_seq)
    seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    q = torch.randn(batch, HQ, D, device=device, dtype=dtype)
    scale, out = D**-0.5, torch.empty_like(q)
    sp = backend(cfg, 1, HKV, D, bs, batch, cache, dtype=dtype)
    p, st, policy = sp.params, sp.state, sp.policy
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    rows = DecodeRows(seq_lens, tables, tables, slots, per_seq, scale)
    sel, cnt, km = st.sel[0], st.counter[0], sp.key_meta[0]
    score_kw = dict(
        max_blocks=per_seq, block_size=bs, cap=p.cap, reuse=p.kernel_args()["reuse"], short_dense=p.short_dense
    )
    stages: list[Stage] = [
        (
            "score",
            "rows={rows},warps={num_warps},stages={num_stages},tiles={tiles}".format(**vars(c)),
            lambda c=c: block_scores_triton(
                q, km.codes, km.scale, tables, seq_lens, slots, cnt, **score_kw, scale=scale, config=c
            ),
        )
        for c in SCORE_CONFIGS
    ]
    stages.append(("select", "default", lambda: policy.select(0, q, rows, st, km)))
    lists = sel
    if policy.prunes:
        lse: dict[int, torch.Tensor] = {}  # tile -> its block lse (the prune reads the default's)
        pruned = torch.full_like(sel[:batch], -1)
        shared = dict(reuse=p.kernel_args()["reuse"], short_dense=p.short_dense)
        # as the engine runs a flat list (flagged by the selection): every program returns at once
        flat = st.flat[0] if p.flat_share < 1.0 else None
        skipped = torch.full_like(pruned, -1)  # the flat variant's rows (as lagged topp's): sel stays whole

        def block_lse(**kw) -> torch.Tensor:
            return block_lse_triton(
                q, cache[0], tables, seq_lens, slots, sel, cnt, local=p.local, scale=scale, **shared, **kw
            )

        def prune(**kw) -> None:
            prune_lists_triton(
                lse[LSE_TILES[0]],
                seq_lens,
                slots,
                sel,
                cnt,
                st.stats,
                block_size=bs,
                sink=p.sink,
                local=p.local,
                top_p=p.top_p,
                per_head=p.per_head,
                **shared,
                **kw,
            )

        for t in LSE_TILES:

            def lse_tile(t: int = t) -> None:
                lse[t] = block_lse(tile_n=t)

            stages.append(("block lse", f"tile_n={t}", lse_tile))
        if flat is not None:
            stages.append(("block lse", "flat lists skipped", lambda: block_lse(flat=flat)))
        for search in PRUNE_SEARCHES:
            variant = "sort" if search["sort"] else f"ways={search['ways']}"
            stages.append(("prune", variant, lambda search=search: prune(out=pruned, **search)))
        if flat is not None:
            stages.append(("prune", "flat lists skipped", lambda: prune(out=skipped, flat=flat)))
        lists = pruned
    stages += [
        (
            "attention",
            name,
            lambda c=c: sparse_decode_triton(
                q, cache[0], tables, seq_lens, lists, slots, p.local, scale, out=out, config=c
            ).clone(),
        )
        for name, c in ATTENTION_CONFIGS
    ]
    return stages, lists


def measure(
    specs: list[str],
    contexts: list[int],
    batch: int,
    timer: Callable[[Callable[[], None]], float] = graph_ms,
    device: str = "cuda",
    dtype: torch.dtype = DTYPE,
) -> list[dict]:
    """A row a (context, policy, stage, variant): the stage's time in us (timer: ms of one call), or the error
    of a variant that does not build or run (the others go on)."""
    rows = []
    for ctx in contexts:
        for spec in specs:
            stages, _ = layer_stages(spec, ctx, batch, device, dtype)
            failed = {}
            for stage, variant, call in stages:  # each stage's inputs, as the engine's order leaves them
                try:
                    call()
                except Exception as e:  # a launch variant out of registers or shared memory: recorded
                    failed[(stage, variant)] = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            for stage, variant, call in stages:
                row = {"context": ctx, "policy": spec, "stage": stage, "variant": variant}
                if (stage, variant) in failed:
                    rows.append(row | {"error": failed[stage, variant]})
                    print(f"{ctx} {spec} {stage} {variant}: {failed[stage, variant]}", flush=True)
                    continue
                rows.append(row | {"us": 1e3 * timer(call)})
                print(f"{ctx} {spec} {stage} {variant}: {rows[-1]['us']:.1f} us", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", required=True, metavar="SPEC")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", help="Write the rows here.")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = measure(args.policies, args.contexts, args.batch)
    device = torch.cuda.get_device_name()
    print_table(rows, f"one sparse layer by stage, batch {args.batch} ({device})")
    if args.json:
        write_rows(args.json, device, rows)


def write_rows(path: str, device: str, rows: list[dict]) -> None:
    """The rows as JSON, with the device, the date (UTC) and torch's version."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with open(path, "w") as f:
        json.dump({"device": device, "date": date, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
