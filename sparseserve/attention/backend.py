"""The attention-backend interface, its registry and the dense backend (docs/architecture.md,
"attention/").

KV cache, one tensor a layer (principle 3): kv_cache [num_blocks, num_kv_heads, 2, block_size,
head_dim]; a (token block, KV head) entry is a head block, K then V. slot = block * block_size +
offset. A step's tokens are flat [T]: the first `num_decodes` sequences decode (one token each),
the rest are prefill chunks; sequence b's queries query_start_loc[b]:query_start_loc[b + 1] are
the last tokens of its context (query i at position seq_lens[b] - q_len[b] + i, causal).
Prefill chunks always attend through the backend's `prefill` (attention/prefill.py).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sparseserve.attention.prefill import DensePrefill, create_prefill
from sparseserve.kernels.paged_decode import paged_decode
from sparseserve.registry import Registry


@dataclass(frozen=True)
class InputField:
    """A per-row input of a captured decode step: dtype, width (0: one value a row, else a row of
    `width`), and the value of padding rows and of a row's entries beyond its width."""

    name: str
    dtype: torch.dtype
    width: int = 0
    pad: int = 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: each new token's slot in token blocks; -1: padding
    query_start_loc: torch.Tensor  # int32 [B + 1]: cumulative query lengths
    seq_lens: torch.Tensor  # int32 [B]: context length with this step's tokens (0: padding)
    block_tables: torch.Tensor  # int32 [B, max_blocks]: token block ids (past the end: unused)
    num_decodes: int  # sequences [0, num_decodes) have one query token each
    max_query_len: int  # host-side upper bounds, fixed while a CUDA graph replays
    max_seq_len: int
    backend_meta: Any = None  # the backend's own per-step data (AttentionBackend.prepare)
    prefill_meta: Any = None  # its prefill attention's per-step data (None: dense)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()


class ScheduledSequence(Protocol):
    """What a backend may read of a scheduled sequence (engine/request.py Sequence)."""

    seq_id: int
    num_computed_tokens: int
    block_table: list[int]


# An observer sees every layer's attention after it ran: (layer, q, out, kv_cache, meta, scale).
# Probes and calibration measure through it (eager steps only: a graph replays without Python).
Observer = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], None]


_DENSE_PREFILL = DensePrefill()


def attend_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    prefill: DensePrefill | None = None,
    layer: int = 0,
) -> torch.Tensor:
    """Causal attention of a mixed step: dense paged decode for the decodes, the prefill chunks
    through `prefill` (a backend's prefill attention for `layer`; None: dense)."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd > 0:  # decodes come first, one token each: token i belongs to sequence i
        paged_decode(
            q[:nd], kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, meta.max_seq_len, out=out[:nd]
        )
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
    offload_prefetch: bool = False  # KV offload's prefetching reads (config.EngineConfig.prefetches)


class AttentionBackend(abc.ABC):
    """What the model calls once per layer: write the step's new K/V, then attend."""

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.observers: list[Observer] = []
        self._graph_qsl: torch.Tensor | None = None  # a captured step's query_start_loc: 0..B
        self.prefill: DensePrefill = create_prefill(ctx)  # how prefill chunks attend

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: layer `layer_idx`'s. Returns [T, Hq, D]."""
        out = self._forward(layer_idx, q, k, v, kv_cache, meta, scale)
        for observe in self.observers:
            observe(layer_idx, q, out, kv_cache, meta, scale)
        return out

    @abc.abstractmethod
    def _forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...

    # ---- lifecycle (the runner) ------------------------------------------------------------------

    def block_bytes(self) -> int:
        """Device bytes kept per token block besides K/V (the runner sizes the cache with it)."""
        return 0

    def allocate(self, num_blocks: int) -> None:
        """The KV cache holds num_blocks token blocks (before that, e.g. the memory-profiling
        prefill, the backend attends densely)."""

    def step_inputs(self, scheduled: list[tuple[ScheduledSequence, int]], num_decodes: int) -> dict[str, torch.Tensor]:
        """This backend's host tensors of a step, by name (a `graph_inputs` name fills that
        static input; others ride along); rows follow `scheduled` (decodes first)."""
        return {}

    def prepare(
        self,
        scheduled: list[tuple[ScheduledSequence, int]],
        meta: AttentionMetadata,
        dev: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """The step's device data into meta.backend_meta and meta.prefill_meta; dev: the step's
        tensors on the device (the runner's and `step_inputs`'), by name."""
        meta.prefill_meta = self.prefill.prepare(scheduled, meta)

    def release(self, seq_id: int, paused: bool = False) -> None:
        """A sequence finished or was preempted: per-sequence state it holds is free again
        (paused: it resumes later with everything it computed, KV offload's pause)."""

    def can_replay(self, meta: AttentionMetadata) -> bool:
        """Whether a prepared pure-decode step may replay a captured CUDA graph (a step with work
        outside the captured sequence of kernels runs eagerly)."""
        return True

    def counters(self) -> dict[str, torch.Tensor]:
        """Cumulative device counters (int64 scalars) for statistics, read without a sync."""
        return self.prefill.counters()

    # ---- CUDA graphs of the decode step ----------------------------------------------------------

    def graph_inputs(self, max_batch: int, max_blocks: int) -> list[InputField]:
        """The per-step inputs a captured decode step reads besides token ids and positions
        (engine/cuda_graph.py lays them out in its static buffers; `prepare` and the runner fill
        them by name). Padding rows: slot -1, length 0, which every kernel skips."""
        self._graph_qsl = torch.arange(max_batch + 1, dtype=torch.int32, device=self.ctx.device)
        return [
            InputField("slot_mapping", torch.long, pad=-1),
            InputField("seq_lens", torch.int32),
            InputField("block_tables", torch.int32, width=max_blocks),
        ]

    def capture_metadata(self, batch: int, inputs: dict[str, torch.Tensor]) -> AttentionMetadata:
        """The metadata of a pure-decode step of `batch` rows over the static inputs
        (`graph_inputs`' fields, `batch` rows each)."""
        return AttentionMetadata(
            inputs["slot_mapping"],
            self._graph_qsl[: batch + 1],
            inputs["seq_lens"],
            inputs["block_tables"],
            num_decodes=batch,
            max_query_len=1,
            max_seq_len=self.ctx.max_model_len,
        )


ATTENTION_BACKENDS: Registry[type[AttentionBackend]] = Registry(
    "attention backend", builtins="sparseserve.attention.sparse"
)


@ATTENTION_BACKENDS.register("dense")
class PagedAttentionBackend(AttentionBackend):
    """Dense paged decode in every layer: store_kv then attend (prefill chunks: `prefill`)."""

    def _forward(self, layer_idx, q, k, v, kv_cache, meta, scale):
        from sparseserve.kernels.store_kv import store_kv

        store_kv(k, v, kv_cache, meta.slot_mapping)
        return attend_paged(q, kv_cache, meta, scale, self.prefill, layer_idx)


def create_backend(name: str, ctx: BackendContext) -> AttentionBackend:
    return ATTENTION_BACKENDS.get(name)(ctx)
