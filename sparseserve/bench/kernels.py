"""Attention kernel benchmark: paged Triton kernels against torch SDPA (flash) on the same shapes.

    python -m sparseserve.bench.kernels [--json out.json] [--sweep]

Decode rows report bandwidth (bytes of K+V+Q+O over the median time of triton.testing.do_bench),
prefill rows TFLOP/s of the causal attention; one line measures a large device-to-device copy, the
HBM ceiling. --sweep also times launch configurations of the decode and prefill kernels on the
headline shapes, to choose the defaults.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import math

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from sparseserve.bench.hardware import hbm_bandwidth
from sparseserve.kernels.paged_decode import DecodeConfig, default_decode_config, paged_decode_triton, split_plan
from sparseserve.kernels.paged_prefill import PrefillConfig, default_prefill_config, paged_prefill_triton

DTYPE = torch.bfloat16
# (batch, context, q heads, kv heads, head_dim, block_size); the first row is the headline target.
DECODE_SHAPES = [
    (8, 32768, 32, 8, 128, 32),
    (1, 131072, 32, 8, 128, 32),
    (32, 8192, 32, 8, 128, 32),
    (8, 32768, 32, 8, 128, 16),
    (8, 32768, 32, 8, 128, 64),
    (8, 32768, 32, 32, 128, 32),
    (64, 4096, 32, 8, 64, 32),
]
# (prefix already cached, chunk length, q heads, kv heads, head_dim, block_size)
PREFILL_SHAPES = [(0, 8192, 32, 8, 128, 32), (30720, 2048, 32, 8, 128, 32)]


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def paged_cache(batch: int, ctx: int, hkv: int, d: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random cache holding `batch` sequences of `ctx` tokens in shuffled, non-contiguous blocks."""
    per_seq = triton.cdiv(ctx, bs)
    cache = torch.randn(batch * per_seq, hkv, 2, bs, d, device="cuda", dtype=DTYPE)
    tables = torch.randperm(batch * per_seq, device="cuda", dtype=torch.int32).view(batch, per_seq)
    return cache, tables


def contiguous_kv(cache: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same K/V as [B, Hkv, L, D] tensors, the layout SDPA reads."""
    kv = cache[tables.long()]  # [B, blocks, Hkv, 2, bs, D]
    b, nblk, hkv, _, bs, d = kv.shape
    k = kv[:, :, :, 0].permute(0, 2, 1, 3, 4).reshape(b, hkv, nblk * bs, d).contiguous()
    v = kv[:, :, :, 1].permute(0, 2, 1, 3, 4).reshape(b, hkv, nblk * bs, d).contiguous()
    return k, v


def sdpa_flash(q, k, v, **kw):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return sdpa(q, k, v, enable_gqa=True, **kw)


def bench_copy() -> dict:
    nbytes = 1 << 30
    bps = hbm_bandwidth(nbytes)
    return {"kind": "copy", "name": "d2d copy 1 GiB", "ms": 2 * nbytes / bps * 1e3, "tbps": bps / 1e12}


@functools.lru_cache(maxsize=1)  # the config sweep reuses one shape's inputs
def decode_inputs(shape: tuple) -> tuple[torch.Tensor, ...]:
    batch, ctx, hq, hkv, d, bs = shape
    cache, tables = paged_cache(batch, ctx, hkv, d, bs)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    return cache, tables, seq_lens, torch.randn(batch, hq, d, device="cuda", dtype=DTYPE)


def bench_decode(shape: tuple, config: DecodeConfig | None = None, with_sdpa: bool = True) -> dict:
    batch, ctx, hq, hkv, d, bs = shape
    cache, tables, seq_lens, q = decode_inputs(shape)
    out = torch.empty_like(q)
    scale = d**-0.5
    nbytes = 2 * batch * hkv * ctx * d * DTYPE.itemsize + 2 * q.nbytes
    config = config or default_decode_config(q.dtype, d)
    ms = bench_ms(lambda: paged_decode_triton(q, cache, tables, seq_lens, scale, ctx, out=out, config=config))
    row = {
        "kind": "decode",
        "name": f"decode B={batch} L={ctx} Hq={hq} Hkv={hkv} D={d} bs={bs}",
        "ms": ms,
        "tbps": nbytes / ms / 1e9,
        "config": vars(config),
        "split_size_num_splits": split_plan(batch, hkv, ctx, q.device, config),
    }
    if with_sdpa:
        k, v = contiguous_kv(cache, tables)
        q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
        try:
            ref = sdpa_flash(q4, k, v, scale=scale).squeeze(2)
            paged_decode_triton(q, cache, tables, seq_lens, scale, ctx, out=out, config=config)
            row["rel_err_vs_sdpa"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            row["sdpa_ms"] = bench_ms(lambda: sdpa_flash(q4, k, v, scale=scale))
            row["sdpa_tbps"] = nbytes / row["sdpa_ms"] / 1e9
            row["ratio"] = row["tbps"] / row["sdpa_tbps"]
        except Exception as e:  # e.g. a torch build whose flash backend refuses enable_gqa
            row["sdpa_error"] = str(e).splitlines()[0][:200]
        del k, v
    return row


def bench_prefill(shape: tuple, config: PrefillConfig | None = None, with_sdpa: bool = True) -> dict:
    prefix, chunk, hq, hkv, d, bs = shape
    ctx = prefix + chunk
    cache, tables = paged_cache(1, ctx, hkv, d, bs)
    seq_lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
    qsl = torch.tensor([0, chunk], device="cuda", dtype=torch.int32)
    q = torch.randn(chunk, hq, d, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    scale = d**-0.5
    flops = 4 * d * hq * (chunk * prefix + chunk * (chunk + 1) / 2)
    ms = bench_ms(lambda: paged_prefill_triton(q, cache, tables, seq_lens, qsl, scale, chunk, out=out, config=config))
    row = {
        "kind": "prefill",
        "name": f"prefill chunk={chunk} prefix={prefix} Hq={hq} Hkv={hkv} D={d} bs={bs}",
        "ms": ms,
        "tflops": flops / ms / 1e9,
        "config": vars(config or default_prefill_config(q.dtype, d)),
    }
    if with_sdpa:
        k, v = contiguous_kv(cache, tables)
        q4 = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, chunk, D]
        # Queries are the last `chunk` positions: causal aligned to the bottom right of the score matrix.
        if prefix == 0:
            mask_kw = {"is_causal": True}
        else:
            from torch.nn.attention.bias import causal_lower_right

            mask_kw = {"attn_mask": causal_lower_right(chunk, ctx)}
        try:
            ref = sdpa_flash(q4, k, v, scale=scale, **mask_kw)[0].transpose(0, 1)
            row["rel_err_vs_sdpa"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            row["sdpa_ms"] = bench_ms(lambda: sdpa_flash(q4, k, v, scale=scale, **mask_kw))
            row["sdpa_tflops"] = flops / row["sdpa_ms"] / 1e9
            row["ratio"] = row["tflops"] / row["sdpa_tflops"]
        except Exception as e:  # SDPA's flash backend may refuse a mask variant
            row["sdpa_error"] = str(e).splitlines()[0][:200]
    return row


def sweep_decode(shape: tuple) -> list[dict]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for tile_n, warps, stages, per_sm in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (4, 8, 16, 32)):
        cfg = DecodeConfig(tile_n=tile_n, target_programs=per_sm * sms, num_warps=warps, num_stages=stages)
        try:
            rows.append(bench_decode(shape, cfg, with_sdpa=False))
        except Exception as e:  # out of shared memory or registers: record and go on
            rows.append({"kind": "decode", "config": vars(cfg), "error": str(e).splitlines()[0][:200]})
    return rows


def sweep_prefill(shape: tuple) -> list[dict]:
    rows = []
    for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
        cfg = PrefillConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        try:
            rows.append(bench_prefill(shape, cfg, with_sdpa=False))
        except Exception as e:
            rows.append({"kind": "prefill", "config": vars(cfg), "error": str(e).splitlines()[0][:200]})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'case':58s} {'ours':>8s} {'sdpa':>8s} {'unit':7s} {'ratio':>6s} {'rel_err':>8s}")
    for r in rows:
        unit = "tbps" if r["kind"] != "prefill" else "tflops"
        label = "TB/s" if unit == "tbps" else "TFLOP/s"
        sd = r.get(f"sdpa_{unit}")
        print(
            f"{r['name']:58s} {r[unit]:8.2f} {(f'{sd:8.2f}' if sd else 'n/a'):>8s} {label:7s} "
            f"{r.get('ratio', math.nan):6.1%} "
            f"{r.get('rel_err_vs_sdpa', math.nan):8.1e}"
        )


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--sweep", action="store_true", help="also time launch configurations")


def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rows": [],
    }
    if args.sweep:
        result["decode_sweep"] = sweep_decode(DECODE_SHAPES[0])
        result["prefill_sweep"] = sweep_prefill(PREFILL_SHAPES[0])
        for key, unit in (("decode_sweep", "tbps"), ("prefill_sweep", "tflops")):
            ok = sorted((r for r in result[key] if unit in r), key=lambda r: -r[unit])
            print(f"best of {key}:")
            for r in ok[:5]:
                print(f"  {r[unit]:7.2f} {unit}  {r['config']}")
    result["rows"].append(bench_copy())
    for shape in DECODE_SHAPES:
        result["rows"].append(bench_decode(shape))
        torch.cuda.empty_cache()
    for shape in PREFILL_SHAPES:
        result["rows"].append(bench_prefill(shape))
    print(f"{result['device']}  torch {result['torch']}  triton {result['triton']}  {result['date']}")
    print_table(result["rows"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(ap)
    main(ap.parse_args())
