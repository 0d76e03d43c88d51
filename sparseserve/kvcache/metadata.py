"""Key metadata of head blocks: per-channel min and max of the keys (DESIGN.md principle 6).

Layout, one tensor for the whole model, shaped like the KV cache's blocks:
    key_meta: [num_layers, num_blocks + 1, num_kv_heads, 2 (min, max), pages_per_block, head_dim]
A page is `page_size` consecutive tokens of a block (hierarchical paging: page_size < block_size;
otherwise one page per block). The extra block `num_blocks` is a trash row: padding tokens
(slot -1) write there, so the update has fixed shapes and never filters on the host.

Stored in the KV cache's dtype: the min and max of values already rounded to that dtype are exact,
and bf16 metadata halves what scoring reads (it reads every block's metadata each step).
"""
from __future__ import annotations

import torch


def allocate_key_meta(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, page_size: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Zeros, not empty: scoring masks pages past a sequence's end, but NaN garbage must never reach a dot.
    return torch.zeros(num_layers, num_blocks + 1, num_kv_heads, 2, block_size // page_size, head_dim,
                       dtype=dtype, device=device)


def page_end_tokens(slot_mapping: torch.Tensor, page_size: int) -> torch.Tensor:
    """True for the last token a step writes into each page. A sequence's new tokens are consecutive
    in the batch and in its slots, so a page ends where the next token is not the next slot of the
    same page (or at the batch's end)."""
    nxt = torch.cat([slot_mapping[1:], slot_mapping.new_full((1,), -1)])
    return (slot_mapping >= 0) & ((nxt != slot_mapping + 1) | ((slot_mapping + 1) % page_size == 0))


def update_key_meta_ref(kv_cache: torch.Tensor, key_meta: torch.Tensor, slot_mapping: torch.Tensor,
                        page_size: int, meta_slots: torch.Tensor | None = None) -> None:
    """After store_kv: recompute min/max of every page this step wrote, from the cache itself.

    kv_cache: one layer [cache_blocks, Hkv, 2, block_size, D]; key_meta: that layer's
    [num_blocks + 1, Hkv, 2, P, D] (row num_blocks: trash). A page's tokens up to the page-end token are
    valid (tokens are written in order), so stale keys of a block's previous owner are never folded in.
    meta_slots (kv_offload, where the cache holds device blocks): the same tokens' slots in token blocks,
    whose rows are updated; None: slot_mapping (the cache is indexed by token block).
    """
    cache_blocks, _, _, block_size, _ = kv_cache.shape
    trash = key_meta.shape[0] - 1
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
    key_meta[blk, :, 0, page] = kmin
    key_meta[blk, :, 1, page] = kmax


def rebuild_key_meta(kv_cache: torch.Tensor, key_meta: torch.Tensor, page_size: int) -> None:
    """Metadata of every full block from the cache (benchmarks that fill the cache directly)."""
    for layer in range(kv_cache.shape[0]):
        k = kv_cache[layer, :, :, 0]  # [NB, Hkv, bs, D]
        nb, hkv, bs, d = k.shape
        pages = k.reshape(nb, hkv, bs // page_size, page_size, d)
        key_meta[layer, :nb, :, 0] = pages.amin(3)
        key_meta[layer, :nb, :, 1] = pages.amax(3)
