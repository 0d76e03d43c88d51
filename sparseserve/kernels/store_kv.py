"""store_kv: a step's new K/V into the paged cache (one layer [NB, Hkv, 2, block_size, D])."""

from __future__ import annotations

import torch

from sparseserve.kernels.dispatch import tl, triton, use_triton
from sparseserve.kernels.pdl import pdl_wait, use_pdl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_ckv,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per token: all KV heads of token t go to slot_mapping[t].

    A slot of -1 (CUDA-graph padding) returns at once, so padded rows touch no memory.
    """
    pdl_wait(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    src_k = k_ptr + t.to(tl.int64) * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = v_ptr + t.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    # The cache is contiguous in (block_size, head_dim): token `off` of a head block is row `off`.
    dst = cache_ptr + blk * stride_cb + heads[:, None] * stride_ch + off * HEAD_DIM + dims[None, :]
    tl.store(dst, tl.load(src_k, mask=mask).to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, tl.load(src_v, mask=mask).to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] into kv_cache [NB, Hkv, 2, block_size, D] at slot_mapping (-1: skip)."""
    block_size = kv_cache.shape[3]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blk, off = slots // block_size, slots % block_size
    # Advanced indices separated by a slice put the token dim first: [n, Hkv, D].
    kv_cache[blk, :, 0, off] = k[valid].to(kv_cache.dtype)
    kv_cache[blk, :, 1, off] = v[valid].to(kv_cache.dtype)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """store_kv_ref's contract."""
    (store_kv_triton if use_triton(k) else store_kv_ref)(k, v, kv_cache, slot_mapping)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    block_size = kv_cache.shape[3]
    assert kv_cache.shape[1] == num_kv_heads and kv_cache.shape[4] == head_dim
    assert kv_cache.stride(4) == 1 and kv_cache.stride(3) == head_dim, "head blocks must be contiguous"
    assert k.stride(2) == 1 and v.stride(2) == 1
    if num_tokens == 0:
        return
    pdl = use_pdl(k.device)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
