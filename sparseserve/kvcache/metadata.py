"""Key metadata of head blocks: per-channel min and max of the keys, int8 on a per-page scale
(docs/architecture.md, principle 6; docs/sparse.md, "The backend as it is"). One pair of tensors:
    codes: int8    [layers, num_blocks + 1, num_kv_heads, 2 (min, max), pages_per_block, head_dim]
    scale: float32 [layers, num_blocks + 1, num_kv_heads, pages_per_block]
A page is `page_size` tokens of a block. Row `num_blocks` is a trash row that padding tokens
(slot -1) write, so the update has fixed shapes. Kept current by kernels/key_meta.py.
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


def allocate_key_meta(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    page_size: int,
    head_dim: int,
    device: torch.device,
) -> KeyMeta:
    # Zeros, not empty: scoring masks pages past a sequence's end, but NaN must never reach a dot.
    pages = block_size // page_size
    return KeyMeta(
        torch.zeros(num_layers, num_blocks + 1, num_kv_heads, 2, pages, head_dim, dtype=torch.int8, device=device),
        torch.zeros(num_layers, num_blocks + 1, num_kv_heads, pages, dtype=torch.float32, device=device),
    )
