"""Per-head thresholds of SALE's sparse prefill, calibrated offline (`sparseserve calibrate --prefill`): the file
`--sparse-prefill-calibration FILE` loads.

A dense engine prefills each calibration prompt (workloads/tasks.py prompts; --random-prompts for random tokens) as
one chunk. After every layer's attention an observer takes that layer's queries and KV cache and, for each query
head, tries thresholds start, start/2, start/4, ... (down to --min-threshold; below it the head gets 0, which keeps
every tile): the head's threshold is the first one at which its attention output is within --error-bound of dense
attention (relative L2 error over the prompt's queries). Each head is measured with the tiles its own threshold
selects, the other heads of its KV group selecting none: in the engine a KV group computes the union of its heads'
tiles, so a head's error there is at most what was measured. Heads of different KV groups are measured in the same
pass. A head's threshold over several prompts is the smallest of theirs.

Afterwards a second engine runs the prompts with the calibrated file loaded (sparse prefill on every chunk) and
reports the share of dense prefill's attention tiles it computes (`tile_fraction`).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

import torch

from sparseserve.attention.prefill import THRESHOLDS_KEY
from sparseserve.kernels.sale_select import sale_select
from sparseserve.kernels.sparse_prefill import TileLayout, sparse_prefill


def calibrate_layer(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: Any,
    scale: float,
    layout: TileLayout,
    start: float,
    min_threshold: float,
    error_bound: float,
) -> torch.Tensor:
    """float32 [Hq] (CPU): each query head's threshold on this prefill step (module docstring)."""
    hq, hkv = q.shape[1], kv_cache.shape[1]
    group = hq // hkv
    args = (
        q,
        kv_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        meta.max_query_len,
        meta.max_seq_len,
        layout,
    )
    ref = sparse_prefill(*args).float()  # every tile: the same kernel, so a selection keeping all has error 0
    ref_norm = ref.norm(dim=(0, 2)).clamp_min(torch.finfo(torch.float32).tiny)
    chosen = torch.zeros(hq)
    pending = torch.ones(hq, dtype=torch.bool)
    member = torch.arange(hq) % group
    t = start
    while t >= min_threshold and pending.any():
        for i in range(group):
            heads = pending & (member == i)
            if not heads.any():
                continue
            thr = torch.where(heads, t, float("inf")).to(q.device)
            _, index, count = sale_select(*args, thr)
            err = (sparse_prefill(*args, index, count).float() - ref).norm(dim=(0, 2)) / ref_norm
            ok = heads & (err.cpu() <= error_bound)
            chosen[ok] = t
            pending &= ~ok
        t /= 2
    return chosen


class PrefillCalibrator:
    """Observes a dense engine's attention backend; keeps each (layer, query head)'s threshold, the smallest over
    the single-sequence prefill steps seen."""

    def __init__(
        self,
        backend: Any,
        num_layers: int,
        num_q_heads: int,
        start: float,
        min_threshold: float,
        error_bound: float,
        layout: TileLayout = TileLayout(),
    ) -> None:
        self.backend, self.layout = backend, layout
        self.start, self.min_threshold, self.error_bound = start, min_threshold, error_bound
        self.thresholds = torch.full((num_layers, num_q_heads), float("inf"))
        self.steps = 0

    def __enter__(self) -> "PrefillCalibrator":
        self.backend.observers.append(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        self.backend.observers.remove(self._observe)

    @torch.no_grad()
    def _observe(self, layer, q, out, kv_cache, meta, scale) -> None:
        if meta.num_decodes or meta.num_seqs != 1:
            return
        thr = calibrate_layer(q, kv_cache, meta, scale, self.layout, self.start, self.min_threshold, self.error_bound)
        self.thresholds[layer] = torch.minimum(self.thresholds[layer], thr)
        self.steps += layer == 0


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--prefill (sparse prefill thresholds)")
    g.add_argument(
        "--error-bound",
        type=float,
        default=0.02,
        help="Largest relative L2 error of a head's prefill attention output against dense.",
    )
    g.add_argument("--start-threshold", type=float, default=1.0, help="First threshold tried; then halved.")
    g.add_argument(
        "--min-threshold",
        type=float,
        default=2.0**-20,
        help="Smallest threshold tried; a head that needs less gets 0 (every tile).",
    )
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="As the engine flag.")


def calibrate(args: argparse.Namespace, prompts_of: Any) -> dict:
    """Writes args.out; prompts_of(engine) -> token-id prompts."""
    from sparseserve import LLM, SamplingParams

    lengths = [int(x) for x in args.lengths.split(",") if x]
    layout = TileLayout()
    engine_args = dict(
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        enforce_eager=True,
        load_format=args.load_format,
        max_model_len=max(lengths) + 8,
        max_num_seqs=1,
        max_num_batched_tokens=max(lengths),
    )  # one chunk a prompt
    llm = LLM(args.model, **engine_args)
    engine = llm.llm_engine
    a = engine.model_runner.arch
    prompts = prompts_of(engine)
    once = SamplingParams(temperature=0.0, max_tokens=1)
    with PrefillCalibrator(
        engine.model_runner.attn_backend,
        a.num_layers,
        a.num_heads,
        args.start_threshold,
        args.min_threshold,
        args.error_bound,
        layout,
    ) as cal:
        llm.generate(prompts, once, use_tqdm=False)
    if cal.steps != len(prompts):
        raise RuntimeError(f"calibrated {cal.steps} prefill steps for {len(prompts)} prompts")
    thresholds = cal.thresholds
    out = {
        THRESHOLDS_KEY: thresholds.tolist(),
        "layout": vars(layout),
        "error_bound": args.error_bound,
        "start_threshold": args.start_threshold,
        "min_threshold": args.min_threshold,
        "model": engine.model_name,
        "num_layers": a.num_layers,
        "num_q_heads": a.num_heads,
        "num_kv_heads": a.num_kv_heads,
        "lengths": lengths,
        "num_prompts": len(prompts),
        "random_prompts": bool(args.random_prompts),
        "dtype": str(engine.model_runner.dtype),
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    # The file through the engine's own loader, then the tiles it saves on the calibration prompts.
    del llm, engine, cal
    _free_memory()
    llm = LLM(
        args.model, **engine_args, sparse_prefill="sale", sparse_prefill_calibration=str(path), sparse_prefill_min_len=0
    )
    llm.generate(prompts, once, use_tqdm=False)
    out["tile_fraction"] = tile_fraction(llm.llm_engine.get_stats(sync=True))
    path.write_text(json.dumps(out, indent=1))
    dense = int((thresholds == 0).sum())
    print(
        f"sparse prefill thresholds of {a.num_layers} layers x {a.num_heads} query heads -> {path}: median "
        f"{thresholds.median().item():.3g}, {dense} heads dense (0); tiles computed on the calibration prompts: "
        f"{out['tile_fraction']:.1%} of dense"
    )
    return out


def tile_fraction(stats: Any) -> float | None:
    """Tiles computed / causally visible tiles of the engine's sparse prefill so far (None: nothing counted)."""
    if not stats.prefill_tiles_dense:
        return None
    return stats.prefill_tiles_computed / stats.prefill_tiles_dense


def _free_memory() -> None:
    gc.collect()  # engines hold reference cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
