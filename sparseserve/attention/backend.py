"""The attention-backend interface every attention implementation plugs into.

KV cache layout (DESIGN.md principle 3), one tensor for the whole model:
    kv_cache: [num_layers, num_blocks, num_kv_heads, 2, block_size, head_dim]
A layer sees kv_cache[layer] = [num_blocks, num_kv_heads, 2, block_size, head_dim]; one
(token block, KV head) entry holds K then V of `block_size` tokens contiguously: a head block.
A request owns token blocks through its block table; slot = block_id * block_size + offset.

Batch layout of one step: tokens are flat [T]; the first `num_decodes` sequences are decodes
(one query token each), the rest prefill chunks. The query tokens of sequence b are
query_start_loc[b]:query_start_loc[b+1]; they are the last tokens of its context, so query i of
sequence b sits at position seq_lens[b] - q_len[b] + i and attends causally.
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # int64 [T]: where each new token's K/V goes; -1 = padding, skipped
    query_start_loc: torch.Tensor  # int32 [B + 1]: cumulative query lengths
    seq_lens: torch.Tensor         # int32 [B]: context length including this step's tokens (0 = padding)
    block_tables: torch.Tensor     # int32 [B, max_blocks]: token block ids; entries past a sequence's end unused
    num_decodes: int               # sequences [0, num_decodes) have one query token each
    max_query_len: int             # host-side upper bounds, fixed while a CUDA graph replays
    max_seq_len: int
    # int32 [B]: each sequence's slot (0..max_num_seqs-1) in per-sequence state buffers (sparse
    # selection reuse); None: row b uses slot b (kernel tests, benchmarks).
    state_slots: torch.Tensor | None = None
    # kv_offload (engine/runner.py prepare): slot_mapping and block_tables address the device block cache,
    # which holds only the working set (released table entries name its trash row); these address the
    # token blocks (host store rows, key-metadata rows, HBM pool keys). None: the same as the above.
    token_slot_mapping: torch.Tensor | None = None
    token_block_tables: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()

    def token_view(self) -> "AttentionMetadata":
        """The same step addressed by token block (layers whose device cache is indexed by token block)."""
        if self.token_slot_mapping is None:
            return self
        return dataclasses.replace(self, slot_mapping=self.token_slot_mapping, block_tables=self.token_block_tables,
                                   token_slot_mapping=None, token_block_tables=None)


class AttentionBackend(abc.ABC):
    """What the model calls once per layer: write the step's new K/V, then attend."""

    name = "base"

    @abc.abstractmethod
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: layer `layer_idx`'s cache. Returns [T, Hq, D].

        layer_idx lets per-layer policies (dense first layers, streaming heads) and probes act."""


class PagedAttentionBackend(AttentionBackend):
    """Dense paged attention, the same in every layer: store_kv then attend (torch or Triton)."""

    def forward(self, layer_idx, q, k, v, kv_cache, meta, scale):
        self.store_kv(k, v, kv_cache, meta.slot_mapping)
        return self.attend(q, kv_cache, meta, scale)

    @abc.abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        ...

    @abc.abstractmethod
    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        ...


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from sparseserve.attention.torch_ref import TorchBackend
        return TorchBackend()
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("attention_backend='triton' needs a CUDA device; use 'torch' on CPU")
        from sparseserve.attention.triton_backend import TritonBackend
        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r} (choose auto, triton or torch)")
