"""Key metadata of head blocks: per-channel min and max of the keys (DESIGN.md principle 6).

Layout, one pair of tensors for the whole model, shaped like the KV cache's blocks:
    codes: int8    [num_layers, num_blocks + 1, num_kv_heads, 2 (min, max), pages_per_block, head_dim]
    scale: float32 [num_layers, num_blocks + 1, num_kv_heads, pages_per_block]
A page is `page_size` consecutive tokens of a block (hierarchical paging: page_size < block_size;
otherwise one page per block). The extra block `num_blocks` is a trash row: padding tokens
(slot -1) write there, so the update has fixed shapes and never filters on the host.

int8 codes on a symmetric per-page scale: scoring reads every block's metadata each step and is
bound by HBM bandwidth, and int8 halves what it reads against bf16 (a head block of one page at
D = 128: 256 bytes of codes + 4 of scale instead of 512). How they are computed and kept current:
kernels/key_meta.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KeyMeta:
    codes: torch.Tensor  # int8 [..., num_blocks + 1, Hkv, 2 (min, max), P, D]
    scale: torch.Tensor  # float32 [..., num_blocks + 1, Hkv, P]: a page's keys lie in codes * scale

    def __getitem__(self, layer: int) -> KeyMeta:
        """One layer's metadata (of the whole model's)."""
        return KeyMeta(self.codes[layer], self.scale[layer])


def key_meta_block_bytes(num_kv_heads: int, pages: int, head_dim: int) -> int:
    """HBM bytes of one token block's metadata in one layer (what scoring reads per block)."""
    return num_kv_heads * pages * (2 * head_dim * torch.int8.itemsize + torch.float32.itemsize)


def allocate_key_meta(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, page_size: int,
                      head_dim: int, device: torch.device) -> KeyMeta:
    # Zeros, not empty: scoring masks pages past a sequence's end, but NaN garbage must never reach a dot.
    pages = block_size // page_size
    return KeyMeta(torch.zeros(num_layers, num_blocks + 1, num_kv_heads, 2, pages, head_dim, dtype=torch.int8,
                               device=device),
                   torch.zeros(num_layers, num_blocks + 1, num_kv_heads, pages, dtype=torch.float32, device=device))
