"""The GPU attention backend: Triton kernels for store_kv, paged decode and paged prefill."""
from __future__ import annotations

import torch

from sparseserve.attention.backend import AttentionMetadata, PagedAttentionBackend
from sparseserve.kernels.paged_decode import paged_decode
from sparseserve.kernels.paged_prefill import paged_prefill
from sparseserve.kernels.store_kv import store_kv


class TritonBackend(PagedAttentionBackend):
    """Same answers as TorchBackend (torch_ref.py). Launches depend only on tensor shapes and the
    host-side bounds in `meta`, never on device values, so a decode step can be graph-captured."""

    name = "triton"

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        store_kv(k, v, kv_cache, slot_mapping)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd > 0:
            # Decodes come first, one token each: token i belongs to sequence i.
            paged_decode(q[:nd], kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                         meta.max_seq_len, out=out[:nd])
        if meta.num_seqs > nd:
            # query_start_loc holds absolute token offsets, so the prefill part indexes q and out as is.
            paged_prefill(q, kv_cache, meta.block_tables[nd:], meta.seq_lens[nd:], meta.query_start_loc[nd:],
                          scale, meta.max_query_len, out=out)
        return out
