"""The attention-backend interface every attention implementation plugs into, and its registry.

KV cache layout (DESIGN.md principle 3), one tensor a layer:
    kv_cache: [num_blocks, num_kv_heads, 2, block_size, head_dim]
one (token block, KV head) entry holds K then V of `block_size` tokens contiguously: a head block.
A request owns token blocks through its block table; slot = block_id * block_size + offset.

Batch layout of one step: tokens are flat [T]; the first `num_decodes` sequences are decodes
(one query token each), the rest prefill chunks. The query tokens of sequence b are
query_start_loc[b]:query_start_loc[b+1]; they are the last tokens of its context, so query i of
sequence b sits at position seq_lens[b] - q_len[b] + i and attends causally.

A backend is created from the registry by name, gets its per-step data in `prepare` (kept in
`AttentionMetadata.backend_meta`, its device copies through the step's upload), and names the inputs a CUDA
graph of the decode step reads (`graph_inputs`, `capture_metadata`), so engine/cuda_graph.py stays generic.
Every backend attends the prefill chunks of a step through its `prefill` object (attention/prefill.py: dense,
or SALE's sparse prefill), the one place where that choice is made.
"""
from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sparseserve.attention.prefill import DensePrefill, create_prefill
from sparseserve.kernels.paged_decode import paged_decode
from sparseserve.kvcache.staging import InputField, StepUpload
from sparseserve.registry import Registry


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # int64 [T]: each new token's slot in token blocks; -1 = padding, skipped
    query_start_loc: torch.Tensor  # int32 [B + 1]: cumulative query lengths
    seq_lens: torch.Tensor         # int32 [B]: context length including this step's tokens (0 = padding)
    block_tables: torch.Tensor     # int32 [B, max_blocks]: token block ids; entries past a sequence's end unused
    num_decodes: int               # sequences [0, num_decodes) have one query token each
    max_query_len: int             # host-side upper bounds, fixed while a CUDA graph replays
    max_seq_len: int
    backend_meta: Any = None       # the backend's own per-step data (AttentionBackend.prepare)
    prefill_meta: Any = None       # its prefill attention's per-step data (attention/prefill.py; None: dense)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()


class ScheduledSequence(Protocol):
    """What a backend may read of a scheduled sequence (engine/request.py Sequence)."""
    seq_id: int
    num_computed_tokens: int
    block_table: list[int]


# An observer sees every layer's attention after it ran: (layer, q, out, kv_cache, meta, scale). Probes and
# calibration measure through it (eager steps only: a CUDA graph replays without Python).
Observer = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], None]


_DENSE_PREFILL = DensePrefill()


def attend_paged(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 prefill: DensePrefill | None = None, layer: int = 0) -> torch.Tensor:
    """Causal attention of a mixed step: paged decode for the decodes (dense), the prefill chunks through
    `prefill` (a backend's prefill attention for layer `layer`; None: dense paged prefill)."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd > 0:  # decodes come first, one token each: token i belongs to sequence i
        paged_decode(q[:nd], kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, meta.max_seq_len,
                     out=out[:nd])
    if meta.num_seqs > nd:
        (_DENSE_PREFILL if prefill is None else prefill).attend(layer, q, kv_cache, meta, scale, out)
    return out


@dataclass(frozen=True)
class BackendContext:
    """What a backend is built from: the model's attention shape and the engine's limits."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    max_num_seqs: int
    max_model_len: int
    sparse: Any = None  # config.SparseConfig (sparse decode, sparse prefill)
    num_q_heads: int | None = None  # per-query-head settings (sparse prefill thresholds) need it
    profiler: Any = None  # sparseserve/profiler.py Profiler (None: no timing)


class AttentionBackend(abc.ABC):
    """What the model calls once per layer: write the step's new K/V, then attend."""

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.observers: list[Observer] = []
        self._graph_qsl: torch.Tensor | None = None  # a captured decode step's query_start_loc: 0, 1, ..., B
        self.prefill: DensePrefill = create_prefill(ctx)  # how prefill chunks attend

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: layer `layer_idx`'s cache. Returns [T, Hq, D]."""
        out = self._forward(layer_idx, q, k, v, kv_cache, meta, scale)
        for observe in self.observers:
            observe(layer_idx, q, out, kv_cache, meta, scale)
        return out

    @abc.abstractmethod
    def _forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        ...

    # ---- lifecycle (the runner) -----------------------------------------------------------------------

    def block_bytes(self) -> int:
        """Device bytes the backend keeps per token block besides K/V (the runner sizes the cache with it)."""
        return 0

    def allocate(self, num_blocks: int) -> None:
        """The KV cache holds num_blocks token blocks (before that, e.g. the memory-profiling prefill, the
        backend attends densely)."""

    def prepare(self, scheduled: list[tuple[ScheduledSequence, int]], meta: AttentionMetadata,
                upload: StepUpload | None = None) -> None:
        """Per-step data of this backend into meta.backend_meta, of its prefill attention into
        meta.prefill_meta; rows follow `scheduled` (decodes first). upload: the step's (kvcache/staging.py;
        None: an eager one). Subclasses add their tensors to it first, then call this: it commits the upload."""
        if upload is not None:
            upload.commit()
        meta.prefill_meta = self.prefill.prepare(scheduled, meta)

    def release(self, seq_id: int, paused: bool = False) -> None:
        """A sequence finished or was preempted: per-sequence state it holds is free again (paused: it resumes
        later with everything it computed, KV offload's pause)."""

    def can_replay(self, meta: AttentionMetadata) -> bool:
        """Whether a prepared pure-decode step may replay a captured CUDA graph (a step with work outside the
        captured sequence of kernels runs eagerly)."""
        return True

    def counters(self) -> dict[str, torch.Tensor]:
        """Cumulative device counters (int64 scalars) for the engine's statistics, read without a sync."""
        return self.prefill.counters()

    # ---- CUDA graphs of the decode step ----------------------------------------------------------------

    def graph_inputs(self, max_batch: int, max_blocks: int) -> list[InputField]:
        """The per-step inputs a captured decode step reads besides token ids and positions (engine/cuda_graph.py
        lays them out in its static buffers; `prepare` and the runner fill them by name). Padding rows: slot -1,
        length 0, which every kernel skips."""
        self._graph_qsl = torch.arange(max_batch + 1, dtype=torch.int32, device=self.ctx.device)
        return [InputField("slot_mapping", torch.long, pad=-1), InputField("seq_lens", torch.int32),
                InputField("block_tables", torch.int32, width=max_blocks)]

    def capture_metadata(self, batch: int, inputs: dict[str, torch.Tensor]) -> AttentionMetadata:
        """The metadata of a pure-decode step of `batch` rows over the static inputs (`graph_inputs`' fields,
        `batch` rows each)."""
        return AttentionMetadata(inputs["slot_mapping"], self._graph_qsl[: batch + 1], inputs["seq_lens"],
                                 inputs["block_tables"], num_decodes=batch, max_query_len=1,
                                 max_seq_len=self.ctx.max_model_len)


ATTENTION_BACKENDS: Registry[type[AttentionBackend]] = Registry("attention backend",
                                                                builtins="sparseserve.attention.sparse")


@ATTENTION_BACKENDS.register("dense")
class PagedAttentionBackend(AttentionBackend):
    """Dense paged decode, the same in every layer: store_kv then attend (prefill chunks through `prefill`)."""

    def _forward(self, layer_idx, q, k, v, kv_cache, meta, scale):
        from sparseserve.kernels.store_kv import store_kv
        store_kv(k, v, kv_cache, meta.slot_mapping)
        return attend_paged(q, kv_cache, meta, scale, self.prefill, layer_idx)


def create_backend(name: str, ctx: BackendContext) -> AttentionBackend:
    return ATTENTION_BACKENDS.get(name)(ctx)
