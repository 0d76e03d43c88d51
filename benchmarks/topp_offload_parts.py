"""Issue 40: what KV offload adds to topp's decode layer, kernel by kernel, each in a CUDA graph of its own. One
layer at SmolLM2-135M's attention shape (9 query / 3 KV heads, D=64, blocks of 16, bf16) over random keys, topp's
defaults (cap 4096, p 0.99): the candidates' block lse and the prune, then the attention over the kept lists, once
with every block in the layer's cache (in place, as the engine runs topp in HBM) and once as the engine runs
them under prefetching reads (`offload_prefetch`): the lse looks each candidate up in the HBM pool and writes
the view, the prune writes the kept lists into their read rows with their view and counts what it found, and the
attention reads the listed blocks through that view. The pool holds every listed head block (at random slots, as
its hash spreads them), so both ways read the same numbers, keep the same lists and attend the same output
(checked), and the difference is the offload's own work. The query is scaled (`--sharpness`) so that the prune
keeps part of the candidates, as on a real model (at the default 5, about 2,000 of 4,096 tokens a list; SmolLM2 at
8K keeps 1,500-1,700).

    python -m benchmarks.topp_offload_parts --batches 8 16 32 [--json out.json]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.sparse import DTYPE, graph_ms
from benchmarks.topp_parts import write_rows
from sparseserve.attention.selection import SelectionParams
from sparseserve.bench.hardware import print_table
from sparseserve.config import SparseConfig
from sparseserve.kernels.pool_plan import ListLayout, ListLookup
from sparseserve.kernels.sparse_decode import sparse_decode_triton
from sparseserve.kernels.topp_prune import topp_prune_triton

HQ, HKV, D, BS = 9, 3, 64, 16
LAYERS, LAYER = 30, 5  # the pool's keys span every layer's (resident's size); the lists are this layer's


@dataclass
class Layer:
    """One layer's inputs, both ways. Rows 0..B-1 of `sel` are the read rows (the kept lists), B..2B-1 the write
    rows (the candidates, `cands`, restored before each in-place prune)."""

    q: torch.Tensor
    cache: torch.Tensor
    tables: torch.Tensor
    seq_lens: torch.Tensor
    sel: torch.Tensor
    cands: torch.Tensor
    counter: torch.Tensor
    stats: torch.Tensor
    pool: torch.Tensor
    host: torch.Tensor
    lookup: ListLookup
    view: torch.Tensor  # the candidates' view (the lse writes it)
    kept_view: torch.Tensor  # the kept lists' (the prune writes it)
    counts: torch.Tensor  # the kept entries the attention reads from the host, the keys the lse read there
    params: SelectionParams


def build(batch: int, ctx: int, sharpness: float, device: str = "cuda", dtype: torch.dtype = DTYPE) -> Layer:
    p = SelectionParams.from_config(SparseConfig(sparse_policy="topp"), BS, True)
    g = torch.Generator().manual_seed(batch)
    nb = -(-ctx // BS)
    assert nb > p.cap, "contexts within the cap are not pruned"
    num_blocks = batch * nb + 1
    cache = torch.randn(num_blocks, HKV, 2, BS, D, generator=g).to(device, dtype)
    tables = torch.randperm(batch * nb, generator=g).view(batch, nb).to(device, torch.int32)
    tokens = torch.randperm(batch * nb, generator=g).view(batch, nb).to(device, torch.int32)  # host rows

    def candidates() -> torch.Tensor:  # the sink, random blocks before the window (sorted), the window
        mid = torch.randperm(nb - p.local - p.sink, generator=g)[: p.cap - p.sink - p.local] + p.sink
        return torch.cat([torch.arange(p.sink), mid.sort().values, torch.arange(nb - p.local, nb)])

    cands = torch.stack([torch.stack([candidates() for _ in range(HKV)]) for _ in range(batch)]).to(device, torch.int32)
    sel = torch.cat([cands, cands]).contiguous()
    lay = ListLayout(LAYER, num_blocks, HKV, p.local, BS)
    resident = torch.full((LAYERS * (num_blocks + 1) * HKV + 1,), -1, dtype=torch.int64, device=device)
    keys = ((LAYER * (num_blocks + 1) + tokens.long()) * HKV)[..., None] + torch.arange(HKV, device=device)
    resident[keys.flatten()] = torch.randperm(keys.numel(), generator=g).to(device)
    pool = torch.empty(keys.numel() + 1, 2, BS, D, dtype=dtype, device=device)
    pool[resident[keys]] = cache[tables.long()]  # [B, nb, Hkv, 2, bs, D]: each listed head block
    view = [torch.full((batch, HKV, p.cap), -1, dtype=torch.int64, device=device) for _ in range(2)]
    return Layer(
        q=(torch.randn(batch, HQ, D, generator=g) * sharpness).to(device, dtype),
        cache=cache,
        tables=tables,
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
        sel=sel,
        cands=cands,
        counter=torch.zeros(2 * batch, HKV, dtype=torch.int32, device=device),
        stats=torch.zeros(2, dtype=torch.int64, device=device),
        pool=pool,
        host=torch.zeros(1, 2, BS, D, dtype=dtype, device=device),  # (nothing is read from the host)
        lookup=ListLookup(tokens, lay, resident, torch.zeros(2, dtype=torch.int64, device=device)),
        view=view[0],
        kept_view=view[1],
        counts=torch.zeros(2, dtype=torch.int64, device=device),
        params=p,
    )


def stages(x: Layer) -> tuple[dict[str, Callable[[], object]], torch.Tensor]:
    """The calls to time: the restore of the candidates alone (the in-place prune's inputs), the lse and prune
    in HBM (restore included) and offloaded, and the attention both ways (each after its own prune has run);
    and the attention's output."""
    p, batch = x.params, len(x.seq_lens)
    reads = torch.arange(batch, dtype=torch.int32, device=x.q.device)
    writes = reads + batch
    args = (x.q, x.cache, x.tables, x.seq_lens)
    common = dict(sink=p.sink, local=p.local, top_p=p.top_p, scale=D**-0.5)
    restore = lambda: x.sel[:batch].copy_(x.cands)  # noqa: E731

    def prune_hbm() -> None:
        restore()
        topp_prune_triton(*args, reads, x.sel, x.counter, x.stats, **common)

    def prune_offload() -> None:
        topp_prune_triton(
            *args, writes, x.sel, x.counter, x.stats, **common, offload=(x.pool, x.host, x.view),
            host_reads=x.counts[1:], out=x.sel, out_rows=reads, out_view=x.kept_view, host_attended=x.counts[:1],
            lookup=x.lookup,
        )  # fmt: skip

    out = torch.empty_like(x.q)
    kept = (x.pool, x.host, x.kept_view)
    calls = {
        "restore": restore,
        "lse + prune, HBM": prune_hbm,
        "attention, HBM": lambda: sparse_decode_triton(*args, x.sel, reads, p.local, D**-0.5, out=out),
        "lse + prune, offload": prune_offload,
        "attention, offload": lambda: sparse_decode_triton(
            *args, x.sel, reads, p.local, D**-0.5, out=out, offload=kept
        ),
    }
    return calls, out


def run_once(x: Layer) -> dict:
    """Every stage once in the engine's order; both ways' kept lists and attention outputs (to check they agree)."""
    (calls, out), batch = stages(x), len(x.seq_lens)
    calls["lse + prune, HBM"]()
    hbm_lists = x.sel[:batch].clone()
    calls["attention, HBM"]()
    hbm_out = out.clone()
    calls["lse + prune, offload"]()
    calls["attention, offload"]()
    return dict(hbm_lists=hbm_lists, lists=x.sel[:batch].clone(), hbm_out=hbm_out, out=out.clone())


def measure(
    batches: list[int], ctx: int, sharpness: float, timer: Callable = graph_ms, device: str = "cuda",
    dtype: torch.dtype = DTYPE,
) -> list[dict]:  # fmt: skip
    """A row a batch: the candidates the offloaded lse found in the pool and not, the tokens a kept list holds, each
    stage's time in us (timer: ms of one call) and the offload's extra a layer; raises where the two ways part
    (lists or output)."""
    rows = []
    for batch in batches:
        x = build(batch, ctx, sharpness, device, dtype)
        once = run_once(x)
        found, missing = x.lookup.stats.tolist()  # of one offloaded prune: every candidate is in the pool
        if not torch.equal(once["hbm_lists"], once["lists"]) or not torch.equal(once["hbm_out"], once["out"]):
            raise AssertionError(f"batch {batch}: the offloaded layer differs from the in-HBM one")
        us = {name: 1e3 * timer(call) for name, call in stages(x)[0].items()}
        hbm, off = us["lse + prune, HBM"] - us["restore"], us["lse + prune, offload"]
        row = {"batch": batch, "candidates_found": found, "missing": missing}
        row["kept_tokens"] = BS * float((once["lists"] >= 0).sum()) / (batch * HKV)
        row |= {"lse_prune_hbm_us": hbm, "lse_prune_offload_us": off, "attention_hbm_us": us["attention, HBM"]}
        row |= {"attention_offload_us": us["attention, offload"]}
        row["offload_extra_us"] = off - hbm + us["attention, offload"] - us["attention, HBM"]
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--context", type=int, default=8128)
    ap.add_argument("--sharpness", type=float, default=5.0, help="the query's scale (what the prune keeps)")
    ap.add_argument("--json", help="Write the rows here.")
    args = ap.parse_args()
    rows = measure(args.batches, args.context, args.sharpness)
    device = torch.cuda.get_device_name()
    print_table(rows, f"topp's layer, in HBM and offloaded (prefetching reads), us ({device})")
    if args.json:
        write_rows(args.json, device, rows)


if __name__ == "__main__":
    main()
