"""Key metadata of head blocks: per-channel min and max of the keys (DESIGN.md principle 6).

Layout, one pair of tensors for the whole model, shaped like the KV cache's blocks:
    codes: int8    [num_layers, num_blocks + 1, num_kv_heads, 2 (min, max), pages_per_block, head_dim]
    scale: float32 [num_layers, num_blocks + 1, num_kv_heads, pages_per_block]
A page is `page_size` consecutive tokens of a block (hierarchical paging: page_size < block_size;
otherwise one page per block). The extra block `num_blocks` is a trash row: padding tokens
(slot -1) write there, so the update has fixed shapes and never filters on the host.

int8 codes on a symmetric per-page scale: scoring reads every block's metadata each step and is
bound by HBM bandwidth, and int8 halves what it reads against bf16 (a head block of one page at
D = 128: 256 bytes of codes + 4 of scale instead of 512). The min is rounded down and the max up, so
codes * scale still bracket the keys and the score q+ . max + q- . min stays an upper bound of q.k over the page (up to float32
rounding); the bound only gets looser by at most one code step (amax / 127) per channel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The floor of a page's largest |key|: an all-zero page gets codes 0 and a finite 127 / amax.
AMAX_FLOOR = 1e-30


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


def quantize_key_meta(kmin: torch.Tensor, kmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Page min/max [..., D] -> (int8 codes [..., 2, D], float32 scale [...]), codes_min * scale <= kmin and
    codes_max * scale >= kmax. The same float32 operations, in the same order, as _store_kv_key_meta_kernel, with
    IEEE-rounded divisions of tensor by tensor (torch on CUDA turns a division by a Python scalar into a
    multiplication by its reciprocal), so the kernel and this reference agree bit for bit."""
    kmin, kmax = kmin.float(), kmax.float()
    amax = torch.maximum(kmin.abs(), kmax.abs()).amax(-1).clamp_min(AMAX_FLOOR)
    levels = torch.full_like(amax, 127.0)
    inv = (levels / amax)[..., None]
    codes = torch.stack([(kmin * inv).floor(), (kmax * inv).ceil()], -2).clamp(-127.0, 127.0)
    return codes.to(torch.int8), amax / levels


def page_end_tokens(slot_mapping: torch.Tensor, page_size: int) -> torch.Tensor:
    """True for the last token a step writes into each page. A sequence's new tokens are consecutive
    in the batch and in its slots, so a page ends where the next token is not the next slot of the
    same page (or at the batch's end)."""
    nxt = torch.cat([slot_mapping[1:], slot_mapping.new_full((1,), -1)])
    return (slot_mapping >= 0) & ((nxt != slot_mapping + 1) | ((slot_mapping + 1) % page_size == 0))


def update_key_meta_ref(kv_cache: torch.Tensor, key_meta: KeyMeta, slot_mapping: torch.Tensor,
                        page_size: int, meta_slots: torch.Tensor | None = None) -> None:
    """After store_kv: recompute min/max of every page this step wrote, from the cache itself.

    kv_cache: one layer [cache_blocks, Hkv, 2, block_size, D]; key_meta: that layer's (row num_blocks:
    trash). A page's tokens up to the page-end token are valid (tokens are written in order), so stale keys
    of a block's previous owner are never folded in. meta_slots (kv_offload, where the cache holds device
    blocks): the same tokens' slots in token blocks, whose rows are updated; None: slot_mapping (the cache
    is indexed by token block).
    """
    cache_blocks, _, _, block_size, _ = kv_cache.shape
    trash = key_meta.scale.shape[0] - 1
    if slot_mapping.numel() == 0:
        return
    meta_slots = slot_mapping if meta_slots is None else meta_slots
    end = page_end_tokens(slot_mapping, page_size)
    slot = slot_mapping.clamp_min(0)
    src = torch.where(end, slot // block_size, 0)
    blk = torch.where(end, meta_slots.clamp_min(0) // block_size, trash)  # all but page ends: the trash row
    off = slot % block_size
    page = off // page_size
    rows = page[:, None] * page_size + torch.arange(page_size, device=slot.device)  # [T, ps]
    keys = kv_cache[:, :, 0][src.clamp_max(cache_blocks - 1)]  # [T, Hkv, bs, D]
    keys = keys.gather(2, rows[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1]))  # [T, Hkv, ps, D]
    valid = (rows <= off[:, None])[:, None, :, None]
    kmin = keys.masked_fill(~valid, float("inf")).amin(2)
    kmax = keys.masked_fill(~valid, float("-inf")).amax(2)
    codes, scale = quantize_key_meta(kmin, kmax)  # [T, Hkv, 2, D], [T, Hkv]
    key_meta.codes[blk, :, :, page] = codes
    key_meta.scale[blk, :, page] = scale


def rebuild_key_meta(kv_cache: torch.Tensor, key_meta: KeyMeta, page_size: int) -> None:
    """Metadata of every full block from the cache (benchmarks that fill the cache directly)."""
    for layer in range(kv_cache.shape[0]):
        k = kv_cache[layer, :, :, 0]  # [NB, Hkv, bs, D]
        nb, hkv, bs, d = k.shape
        pages = k.reshape(nb, hkv, bs // page_size, page_size, d)
        codes, scale = quantize_key_meta(pages.amin(3), pages.amax(3))  # [NB, Hkv, P, 2, D], [NB, Hkv, P]
        key_meta.codes[layer, :nb] = codes.transpose(2, 3)
        key_meta.scale[layer, :nb] = scale
