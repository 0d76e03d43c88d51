"""Prefill attention of every backend, the one place that decides how a chunk is attended
(docs/sparse_prefill.md, "Where the decision is made"):
  - sparse_prefill=dense (DensePrefill): kernels/paged_prefill.py;
  - sparse_prefill=sale (SalePrefill): per layer kernels/sale_select.py picks the tiles,
    kernels/sparse_prefill.py computes them. Chunks shorter than sparse_prefill_min_len get
    every tile; a step with none that long, or not prepared (memory profiling), runs dense.
Thresholds and streaming flags live on the device (no host sync in a layer); per-step data is
built once in `prepare` and travels as AttentionMetadata.prefill_meta.

Counters (device, read one step late): prefill_tiles_computed and prefill_tiles_dense, in
(query tile, key tile, KV head) units over layers; computed / dense is the share of dense
prefill attention's work done.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sparseserve.attention.selection import load_streaming_heads
from sparseserve.kernels.paged_prefill import paged_prefill
from sparseserve.kernels.sale_select import sale_select
from sparseserve.kernels.sparse_prefill import TileLayout, sparse_prefill, tile_classes, tile_geometry

if TYPE_CHECKING:
    from sparseserve.attention.backend import AttentionMetadata, BackendContext

THRESHOLDS_KEY = "sparse_prefill_thresholds"


class DensePrefill:
    """Dense causal attention of a step's prefill chunks (the interface SalePrefill implements)."""

    def prepare(self, scheduled: list, meta: AttentionMetadata) -> Any:
        """Per-step data for `attend` (AttentionMetadata.prefill_meta); rows follow `scheduled`,
        decodes first."""
        return None

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Writes the attention of the prefill rows [meta.num_decodes:] into out at their tokens;
        meta addresses this layer's cache (under KV offload: the step's device block cache)."""
        nd = meta.num_decodes  # query_start_loc: absolute token offsets into q and out
        paged_prefill(
            q,
            kv_cache,
            meta.block_tables[nd:],
            meta.seq_lens[nd:],
            meta.query_start_loc[nd:],
            scale,
            meta.max_query_len,
            out=out,
        )

    def counters(self) -> dict[str, torch.Tensor]:
        return {}


@dataclass
class SalePrefillStep:
    """One step's prefill rows, for SalePrefill.attend (built by its prepare)."""

    query_start_loc: torch.Tensor  # int32 [Bp + 1]: token offsets within q[num_decodes:]
    max_query_len: int  # host-side bounds of the prefill rows
    max_seq_len: int
    sparse: bool  # a row reaches min_len (else: dense)
    causal_tiles: torch.Tensor  # int64 []: causally visible tiles of a layer (x KV heads)
    forced_tiles: torch.Tensor  # int64 []: sink, local, diagonal (x KV heads)
    dense_rows: torch.Tensor | None = None  # bool [Bp]: rows below min_len (None: no such row)
    full_index: torch.Tensor | None = None  # int32 [Bp, n_q_tiles, n_k_tiles]: all middle tiles
    full_count: torch.Tensor | None = None  # int32 [Bp, n_q_tiles]


class SalePrefill(DensePrefill):
    """SALE's sparse prefill (module docstring)."""

    def __init__(
        self,
        thresholds: torch.Tensor,
        streaming: torch.Tensor,
        min_len: int,
        device: torch.device,
        layout: TileLayout = TileLayout(),
    ) -> None:
        """thresholds: float [layers, query heads] (>= 0); streaming: bool [layers, KV heads]
        (host tensors)."""
        self.layout = layout
        self.min_len = min_len
        self.thresholds = thresholds.to(device, torch.float32)
        self.num_kv_heads = streaming.shape[1]
        # Per layer its streaming flags on the device, or None where no head streams.
        self.streaming = [s.to(device) if s.any() else None for s in streaming.bool()]
        self.stats = torch.zeros(2, dtype=torch.int64, device=device)  # tiles computed, tiles dense

    def counters(self) -> dict[str, torch.Tensor]:
        return {"prefill_tiles_computed": self.stats[0], "prefill_tiles_dense": self.stats[1]}

    def prepare(self, scheduled: list, meta: AttentionMetadata) -> SalePrefillStep | None:
        nd = meta.num_decodes
        rows = scheduled[nd:]
        if not rows:
            return None
        lens = [seq.num_computed_tokens + n for seq, n in rows]
        max_q, max_s = max(n for _, n in rows), max(lens)
        sparse = max_s >= self.min_len
        layout = self.layout
        seq_lens, qsl = meta.seq_lens[nd:], meta.query_start_loc[nd:] - nd
        n_qt, n_kt = layout.num_q_tiles(max_q), layout.num_k_tiles(max_s)
        forced, middle = tile_classes(seq_lens, qsl, n_qt, n_kt, layout)
        hkv = self.num_kv_heads
        step = SalePrefillStep(qsl, max_q, max_s, sparse, (forced | middle).sum() * hkv, forced.sum() * hkv)
        if sparse and min(lens) < self.min_len:  # these rows keep every tile
            _, s_end, _, _ = tile_geometry(seq_lens, qsl, n_qt, layout)
            step.dense_rows = seq_lens < self.min_len
            step.full_index = (s_end[..., None] + torch.arange(n_kt, device=s_end.device)).to(torch.int32)
            step.full_count = middle.sum(-1, dtype=torch.int32)
        return step

    def attend(self, layer, q, kv_cache, meta, scale, out) -> None:
        step: SalePrefillStep | None = meta.prefill_meta
        if step is None or not step.sparse:
            super().attend(layer, q, kv_cache, meta, scale, out)
            if step is not None:
                self.stats += step.causal_tiles
            return
        nd = meta.num_decodes  # decodes first, one token each: prefill tokens are q[nd:]
        args = (
            q[nd:],
            kv_cache,
            meta.block_tables[nd:],
            meta.seq_lens[nd:],
            step.query_start_loc,
            scale,
            step.max_query_len,
            step.max_seq_len,
            self.layout,
        )
        _, index, count = sale_select(*args, self.thresholds[layer], self.streaming[layer])
        if step.dense_rows is not None:
            index = torch.where(step.dense_rows[:, None, None, None], step.full_index[:, None], index)
            count = torch.where(step.dense_rows[:, None, None], step.full_count[:, None], count)
        sparse_prefill(*args, index, count, out=out[nd:])
        self.stats[0] += step.forced_tiles + count.sum()
        self.stats[1] += step.causal_tiles


def load_prefill_thresholds(
    path: str, num_layers: int, num_q_heads: int, layout: TileLayout = TileLayout()
) -> torch.Tensor:
    """float32 [num_layers, num_q_heads] from {"sparse_prefill_thresholds": [[per query head] per
    layer], ...} (`sparseserve calibrate --prefill`), checked: the model's shape, finite values
    >= 0, the engine's tile layout."""
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"could not read sparse prefill thresholds from {path}: {e}") from e
    rows = spec.get(THRESHOLDS_KEY) if isinstance(spec, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise ValueError(f'{path}: expected {{"{THRESHOLDS_KEY}": [[threshold per query head] per layer]}}')
    widths = sorted({len(r) for r in rows})
    if len(rows) != num_layers or widths != [num_q_heads]:
        got = f"{len(rows)} x {'/'.join(map(str, widths)) or 0}"
        raise ValueError(
            f"{path}: thresholds of shape {got} (layers x query heads); the model has {num_layers} x {num_q_heads}"
        )
    bad = [
        (i, h, v)
        for i, r in enumerate(rows)
        for h, v in enumerate(r)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
    ]
    if bad:
        i, h, v = bad[0]
        raise ValueError(
            f"{path}: thresholds must be finite numbers >= 0; layer {i}, head {h} is {v!r} ({len(bad)} bad values)"
        )
    got = spec.get("layout")
    if got is not None and got != vars(layout):
        raise ValueError(f"{path} was calibrated for the tile layout {got}; the engine uses {vars(layout)}")
    return torch.tensor(rows, dtype=torch.float32)


def create_prefill(ctx: BackendContext) -> DensePrefill:
    """The prefill attention of an engine (ctx.sparse: config.SparseConfig, or None: dense)."""
    cfg = ctx.sparse
    if cfg is None or cfg.sparse_prefill == "dense":
        return DensePrefill()
    if not ctx.num_q_heads:
        raise ValueError("sparse prefill needs the model's number of query heads (BackendContext.num_q_heads)")
    if cfg.sparse_prefill_calibration is not None:
        thr = load_prefill_thresholds(cfg.sparse_prefill_calibration, ctx.num_layers, ctx.num_q_heads)
    else:
        thr = torch.full((ctx.num_layers, ctx.num_q_heads), cfg.sparse_prefill_threshold)
    streaming = load_streaming_heads(cfg.streaming_heads, ctx.num_layers, ctx.num_kv_heads)
    return SalePrefill(thr, streaming, cfg.sparse_prefill_min_len, ctx.device)
