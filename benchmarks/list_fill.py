"""Sparse decode attention over lists that fill part of their cap (adaptive budgets: a topp list flagged flat takes
half the cap, a pruned one a fraction): one layer's kernel time by fill, plain and TMA kernels (`config`), each
call in a CUDA graph, against the same tokens in full lists. Shapes: MHA 7B (32 / 32 heads, D=128) at 10K, GQA 8B
(32 / 8) at 128K and SmolLM2 (9 / 3, D=64) at 8K, batch B, bf16, random keys, random blocks of a shuffled cache.
Lists hold their entries first, then -1, as the engine's do.

    python -m benchmarks.list_fill [--batch 4] [--kernel-file OTHER/sparseserve/kernels/sparse_decode.py] [--json F]

--kernel-file: also times that file's kernels (another commit's `kernels/sparse_decode.py`) beside this tree's, in
the same process (`tree` column: "this" or "other"). --offload SHARE: also as under KV offload (`pool` column): the
listed blocks in HBM pool slots but SHARE of them read from a pinned host store over UVA (the pool's bypass reads),
the window from the cache.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
from collections.abc import Callable
from types import ModuleType

import torch

from sparseserve.bench.hardware import print_table
from sparseserve.kernels import sparse_decode

# Hq, Hkv, D, context
SHAPES = {"mha7b 10K": (32, 32, 128, 10000), "gqa8b 128K": (32, 8, 128, 131056), "smollm2 8K": (9, 3, 64, 8064)}
# (block size, tokens listed, cap in tokens): full lists of blocks of 32 and 16, then lists of blocks of 16 that
# fill half and a quarter of topp's cap
CASES = ((32, 2048, 2048), (16, 2048, 2048), (16, 2048, 4096), (16, 1024, 4096))
LOCAL = 1


def load_kernels(path: str) -> ModuleType:
    """Another tree's kernels/sparse_decode.py as a module of its own (its imports resolve in this tree)."""
    spec = importlib.util.spec_from_file_location("other_sparse_decode", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def inputs(batch: int, shape: tuple, case: tuple, device: str, dtype: torch.dtype, seed: int = 0) -> tuple:
    """(q, cache, tables, seq_lens, sel, slots): each (sequence, KV head) lists `listed` random distinct blocks
    before its window, sorted, then -1 up to the cap."""
    hq, hkv, d, ctx = shape
    bs, tokens, cap_tokens = case
    gen = torch.Generator(device=device).manual_seed(seed)
    nb = -(-ctx // bs)
    cache = torch.randn(batch * nb + 1, hkv, 2, bs, d, device=device, dtype=dtype, generator=gen)
    order = torch.randperm(batch * nb, device=device, generator=gen)
    tables = (order.to(torch.int32) + 1).view(batch, nb).contiguous()
    listed, cap = tokens // bs, cap_tokens // bs
    sel = torch.full((batch, hkv, cap), -1, dtype=torch.int32, device=device)
    for b in range(batch):
        for h in range(hkv):
            pick = torch.randperm(nb - LOCAL, device=device, generator=gen)[:listed]
            sel[b, h, : pick.numel()] = pick.sort().values.to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, device=device, dtype=dtype, generator=gen)
    return q, cache, tables, seq_lens, sel, slots


def offloaded(cache: torch.Tensor, tables: torch.Tensor, sel: torch.Tensor, host_share: float, seed: int = 0) -> tuple:
    """The kernels' offload view of the listed blocks: (pool slots, host rows, loc) as the HBM pool gives
    it, each listed block in a pool slot of its own, or (host_share of them) read from its host row; the host
    store pinned on a GPU (UVA)."""
    batch, hkv, cap = sel.shape
    gen = torch.Generator(device=sel.device).manual_seed(seed + 1)
    heads = torch.arange(hkv, device=sel.device)[None, :, None]
    blocks = tables.long().gather(1, sel.clamp_min(0).flatten(1).long()).view_as(sel)
    listed_kv = cache[blocks, heads].flatten(0, 2)  # [B * Hkv * cap, 2, bs, D]
    n = listed_kv.shape[0]
    loc = torch.randperm(n, device=sel.device, generator=gen)
    key = torch.randperm(n, device=sel.device, generator=gen)
    pool = torch.empty_like(listed_kv)
    pool[loc] = listed_kv
    host = torch.empty_like(listed_kv)
    host[key] = listed_kv
    if sel.is_cuda:
        from sparseserve.kvcache.host import pinned_zeros

        host = pinned_zeros(tuple(host.shape), host.dtype).copy_(host)
    loc = torch.where(torch.rand(n, device=sel.device, generator=gen) < host_share, -1 - key, loc)
    return pool, host, loc.view(batch, hkv, cap)


def measure(
    batch: int,
    shapes: dict[str, tuple],
    cases: tuple,
    kernels: dict[str, ModuleType],
    timer: Callable[[Callable[[], object]], float],
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    host_share: float | None = None,
) -> list[dict]:
    """A row per (shape, case, pool, tree, config): us a call (timer: ms of one call) and the error against the
    reference. host_share: also each case under KV offload (`offloaded`)."""
    rows = []
    for name, shape in shapes.items():
        for case in cases:
            q, cache, tables, seq_lens, sel, slots = inputs(batch, shape, case, device, dtype)
            scale = shape[2] ** -0.5
            ref = sparse_decode.sparse_decode_ref(q, cache, tables, seq_lens, sel, slots, LOCAL, scale).float()
            out = torch.empty_like(q)
            views = {"hbm": None} | ({} if host_share is None else {"pool": offloaded(cache, tables, sel, host_share)})
            for pool, view in views.items():
                for tree, mod in kernels.items():
                    configs = {"default": mod.default_config(cache, view), "plain": mod.FAST_CONFIG}
                    configs["tma"] = mod.TMA_CONFIG

                    def call(mod=mod, config=None, view=view) -> None:
                        mod.sparse_decode_triton(
                            q, cache, tables, seq_lens, sel, slots, LOCAL, scale, out=out, offload=view, config=config
                        )

                    for label, config in configs.items():
                        ms = timer(lambda config=config: call(config=config))
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        block, tokens, cap = case
                        case_row = dict(shape=name, block=block, tokens=tokens, cap=cap, pool=pool)
                        rows.append(case_row | dict(tree=tree, config=label, us=1e3 * ms, err=err))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--kernel-file", help="another tree's kernels/sparse_decode.py, timed beside this tree's")
    ap.add_argument("--offload", type=float, metavar="SHARE", help="also under KV offload, SHARE read from the host")
    ap.add_argument("--json", help="Write the rows here.")
    args = ap.parse_args()
    from benchmarks.sparse import graph_ms

    kernels = {"this": sparse_decode} | ({"other": load_kernels(args.kernel_file)} if args.kernel_file else {})
    rows = measure(args.batch, SHAPES, CASES, kernels, graph_ms, host_share=args.offload)
    when = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    print_table(rows, f"sparse decode by list fill, batch {args.batch} ({torch.cuda.get_device_name()}, {when})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
