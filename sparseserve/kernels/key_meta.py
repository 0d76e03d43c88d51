"""Key metadata of head blocks (docs/architecture.md, principle 6): per page of `page_size`
tokens, the per-channel min and max of the keys as int8 codes on a symmetric float32 scale.

One layer's metadata (allocated by kvcache/metadata.py): codes int8 [NB + 1, Hkv, 2 (min, max),
P, D], scale float32 [NB + 1, Hkv, P]; row NB is the trash row that tokens not ending a page
write, so the update has fixed shapes. The min rounds down and the max up, so the score stays an
upper bound of q.k over the page (looser by at most one code step, amax / 127, per channel).

store_kv_key_meta (sparse layers): store_kv plus the update of the pages the step's tokens end,
one kernel on the GPU, bit-identical to the reference under chunked prefill.
"""

from __future__ import annotations

import torch

from sparseserve.kernels.dispatch import tl, triton, use_triton
from sparseserve.kernels.flash_h2d import write_through_ref
from sparseserve.kernels.pdl import pdl_wait, use_pdl
from sparseserve.kernels.store_kv import store_kv_ref

# The floor of a page's largest |key|: an all-zero page gets codes 0 and a finite 127 / amax.
AMAX_FLOOR = 1e-30


def quantize_key_meta(kmin: torch.Tensor, kmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Page min/max [..., D] -> (int8 codes [..., 2, D], float32 scale [...]) with
    codes_min * scale <= kmin and codes_max * scale >= kmax. The trap: the kernel's float32 ops
    in its order, dividing tensor by tensor (torch on CUDA turns a division by a Python scalar
    into a multiplication by its reciprocal), so both agree bit for bit."""
    kmin, kmax = kmin.float(), kmax.float()
    amax = torch.maximum(kmin.abs(), kmax.abs()).amax(-1).clamp_min(AMAX_FLOOR)
    levels = torch.full_like(amax, 127.0)
    inv = (levels / amax)[..., None]
    codes = torch.stack([(kmin * inv).floor(), (kmax * inv).ceil()], -2).clamp(-127.0, 127.0)
    return codes.to(torch.int8), amax / levels


def page_end_tokens(slot_mapping: torch.Tensor, page_size: int) -> torch.Tensor:
    """True for the last token a step writes into each page (a sequence's new tokens are
    consecutive in the batch and in its slots)."""
    nxt = torch.cat([slot_mapping[1:], slot_mapping.new_full((1,), -1)])
    return (slot_mapping >= 0) & ((nxt != slot_mapping + 1) | ((slot_mapping + 1) % page_size == 0))


def update_key_meta_ref(
    kv_cache: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_size: int,
    meta_slots: torch.Tensor | None = None,
) -> None:
    """After store_kv: recompute min/max of every page this step wrote, from the cache itself.

    kv_cache: one layer [cache_blocks, Hkv, 2, block_size, D]; codes, scale: that layer's
    metadata (last row: trash). Only a page's tokens up to the page-end token are read, so a
    block's previous owner's keys never count. meta_slots (KV offload, the cache holds device
    blocks): the same tokens' slots in token blocks, which index the metadata; None: slot_mapping.
    """
    cache_blocks, _, _, block_size, _ = kv_cache.shape
    trash = scale.shape[0] - 1
    if slot_mapping.numel() == 0:
        return
    meta_slots = slot_mapping if meta_slots is None else meta_slots
    end = page_end_tokens(slot_mapping, page_size)
    slot = slot_mapping.clamp_min(0)
    src = torch.where(end, slot // block_size, 0)
    blk = torch.where(end, meta_slots.clamp_min(0) // block_size, trash)  # not a page end: trash
    off = slot % block_size
    page = off // page_size
    rows = page[:, None] * page_size + torch.arange(page_size, device=slot.device)  # [T, ps]
    keys = kv_cache[:, :, 0][src.clamp_max(cache_blocks - 1)]  # [T, Hkv, bs, D]
    idx = rows[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
    keys = keys.gather(2, idx)  # [T, Hkv, ps, D]
    valid = (rows <= off[:, None])[:, None, :, None]
    kmin = keys.masked_fill(~valid, float("inf")).amin(2)
    kmax = keys.masked_fill(~valid, float("-inf")).amax(2)
    page_codes, page_scale = quantize_key_meta(kmin, kmax)  # [T, Hkv, 2, D], [T, Hkv]
    codes[blk, :, :, page] = page_codes
    scale[blk, :, page] = page_scale


def rebuild_key_meta(kv_caches, codes: torch.Tensor, scale: torch.Tensor, page_size: int) -> None:
    """Metadata of every full block of every layer's cache ([NB, Hkv, 2, bs, D] each, a list or
    one tensor) into codes, scale [L, NB + 1, ...]; for benchmarks and tests that fill caches."""
    for layer, cache in enumerate(kv_caches):
        k = cache[:, :, 0]  # [NB, Hkv, bs, D]
        nb, hkv, bs, d = k.shape
        pages = k.reshape(nb, hkv, bs // page_size, page_size, d)
        # [NB, Hkv, P, 2, D], [NB, Hkv, P]
        page_codes, page_scale = quantize_key_meta(pages.amin(3), pages.amax(3))
        codes[layer, :nb] = page_codes.transpose(2, 3)
        scale[layer, :nb] = page_scale


def store_kv_key_meta_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_size: int,
    meta_slots: torch.Tensor | None = None,
    host_layer: torch.Tensor | None = None,
    num_write: int = 0,
    count: torch.Tensor | None = None,
    host_slots: torch.Tensor | None = None,
) -> None:
    """store_kv of k, v [T, Hkv, D] into kv_cache (one layer [NB, Hkv, 2, bs, D]), then the
    metadata of the pages they end. meta_slots: the tokens' slots in the blocks that index the
    metadata, where the cache is a device block cache (KV offload); None: slot_mapping.
    host_layer (KV offload): the host store's layer [R + 1, Hkv, 2, bs, D]; each block that one
    of the first num_write tokens (the decodes) completes is copied whole to the row of its host
    slot's block (host_slots, default meta_slots; flash_h2d.write_through_ref; count += blocks)."""
    store_kv_ref(k, v, kv_cache, slot_mapping)
    update_key_meta_ref(kv_cache, codes, scale, slot_mapping, page_size, meta_slots)
    if host_layer is not None and num_write > 0:
        dst = host_slots if host_slots is not None else slot_mapping if meta_slots is None else meta_slots
        dst = dst[:num_write]
        write_through_ref(kv_cache, host_layer, slot_mapping[:num_write], dst, count)


def store_kv_key_meta(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_size: int,
    meta_slots: torch.Tensor | None = None,
    host_layer: torch.Tensor | None = None,
    num_write: int = 0,
    count: torch.Tensor | None = None,
    host_slots: torch.Tensor | None = None,
) -> None:
    """store_kv_key_meta_ref's contract."""
    fn = store_kv_key_meta_triton if use_triton(k) else store_kv_key_meta_ref
    fn(k, v, kv_cache, codes, scale, slot_mapping, page_size, meta_slots, host_layer, num_write, count, host_slots)


@triton.jit(do_not_specialize=["num_tokens", "num_write"])
def _store_kv_key_meta_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    codes_ptr,
    scale_ptr,
    slot_ptr,
    meta_slot_ptr,
    host_slot_ptr,
    num_tokens,
    host_ptr,
    count_ptr,
    num_write,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_ckv,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_sb,
    stride_sh,
    stride_hb,
    stride_hh,
    stride_hkv,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    WRITE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (token, KV head): stores the token's K and V; a page's last token this step also
    recomputes the page's codes and scale (bit-identical to quantize_key_meta). Rows this step
    writes (other programs store them) are read from k, the others from the cache. WRITE (KV
    offload): a decode token (t < num_write) that completes its block copies the head's block
    to the host row of its host slot over UVA (as flash_h2d.write_through)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)  # step inputs: read before pdl_wait (kernels/pdl.py)
    nxt = tl.load(slot_ptr + t + 1, mask=t + 1 < num_tokens, other=-1)
    mblk = tl.load(meta_slot_ptr + t) // BLOCK_SIZE
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < HEAD_DIM
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    page = off // PAGE
    rows = page * PAGE + tl.arange(0, PAGE)
    back = off - rows  # row r holds the token `back` slots before this one
    src = t - back
    earlier = (rows <= off) & (src >= 0)
    # A row is this step's when the token `back` places earlier in the batch has the slot
    # `back` places earlier (a sequence's tokens are consecutive in the batch and its slots).
    in_step = earlier & (tl.load(slot_ptr + src, mask=earlier, other=-1) == slot - back)
    pdl_wait(PDL)
    if slot < 0:
        return
    head_row = cache_ptr + blk * stride_cb + h * stride_ch
    k_src = k_ptr + h * stride_kh + dims
    tl.store(
        head_row + off * HEAD_DIM + dims,
        tl.load(k_src + t.to(tl.int64) * stride_kt, mask=dmask).to(cache_ptr.dtype.element_ty),
        mask=dmask,
    )
    tl.store(
        head_row + stride_ckv + off * HEAD_DIM + dims,
        tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + dims, mask=dmask).to(cache_ptr.dtype.element_ty),
        mask=dmask,
    )
    if (nxt == slot + 1) & ((slot + 1) % PAGE != 0):  # not the page's last token this step
        return
    mask = (rows <= off)[:, None] & dmask[None, :]
    from_k = in_step[:, None] & dmask[None, :]
    keys = tl.load(k_src[None, :] + (src.to(tl.int64) * stride_kt)[:, None], mask=from_k, other=0.0)
    keys = keys.to(cache_ptr.dtype.element_ty)  # as stored
    old = tl.load(head_row + rows[:, None] * HEAD_DIM + dims[None, :], mask=mask & ~from_k, other=0.0)
    keys = tl.where(from_k, keys, old).to(tl.float32)
    kmin = tl.min(tl.where(mask, keys, float("inf")), 0)
    kmax = tl.max(tl.where(mask, keys, float("-inf")), 0)
    amax = tl.max(tl.where(dmask, tl.maximum(tl.abs(kmin), tl.abs(kmax)), 0.0), 0)
    amax = tl.maximum(amax, AMAX_FLOOR)
    inv = tl.math.div_rn(127.0, amax)
    cmin = tl.minimum(tl.maximum(tl.math.floor(kmin * inv), -127.0), 127.0).to(tl.int8)
    cmax = tl.minimum(tl.maximum(tl.math.ceil(kmax * inv), -127.0), 127.0).to(tl.int8)
    dst = codes_ptr + mblk * stride_mb + h * stride_mh + page * HEAD_DIM + dims
    tl.store(dst, cmin, mask=dmask)
    tl.store(dst + stride_mm, cmax, mask=dmask)
    tl.store(scale_ptr + mblk * stride_sb + h * stride_sh + page, tl.math.div_rn(amax, 127.0))
    if WRITE:
        if (t < num_write) & ((slot + 1) % BLOCK_SIZE == 0):
            tl.debug_barrier()  # this token's row was stored above by other threads
            rows_all = tl.arange(0, BLOCK_SIZE)
            hblk = tl.load(host_slot_ptr + t) // BLOCK_SIZE
            src_kv = head_row + rows_all[:, None] * HEAD_DIM + dims[None, :]
            dst_kv = (
                host_ptr + hblk.to(tl.int64) * stride_hb + h * stride_hh + rows_all[:, None] * HEAD_DIM + dims[None, :]
            )
            m2 = dmask[None, :]  # broadcast over the block's rows
            tl.store(dst_kv, tl.load(src_kv, mask=m2), mask=m2)
            tl.store(dst_kv + stride_hkv, tl.load(src_kv + stride_ckv, mask=m2), mask=m2)
            if h == 0:
                tl.atomic_add(count_ptr, 1, sem="relaxed")


def store_kv_key_meta_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_size: int,
    meta_slots: torch.Tensor | None = None,
    host_layer: torch.Tensor | None = None,
    num_write: int = 0,
    count: torch.Tensor | None = None,
    host_slots: torch.Tensor | None = None,
) -> None:
    """One program per (token, KV head); page-end tokens update the metadata."""
    num_tokens = slot_mapping.numel()
    _, hkv, _, block_size, head_dim = kv_cache.shape
    assert codes.stride(-1) == 1 and codes.stride(-2) == head_dim and scale.stride(-1) == 1
    assert kv_cache.stride(4) == 1 and kv_cache.stride(3) == head_dim and k.stride(2) == 1 and v.stride(2) == 1
    assert k.shape == v.shape == (num_tokens, hkv, head_dim)
    write = host_layer is not None and num_write > 0
    if write:
        assert host_layer.shape[1:] == kv_cache.shape[1:] and host_layer.dtype == kv_cache.dtype
        assert host_layer.stride()[2:] == kv_cache.stride()[2:] and count is not None
    if num_tokens == 0:
        return
    meta_slots = slot_mapping if meta_slots is None else meta_slots
    host = host_layer if write else kv_cache
    pdl = use_pdl(kv_cache.device)
    _store_kv_key_meta_kernel[(num_tokens, hkv)](
        k,
        v,
        kv_cache,
        codes,
        scale,
        slot_mapping,
        meta_slots,
        meta_slots if host_slots is None else host_slots.contiguous(),
        num_tokens,
        host,
        count if write else scale,
        num_write if write else 0,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        codes.stride(0),
        codes.stride(1),
        codes.stride(2),
        scale.stride(0),
        scale.stride(1),
        host.stride(0),
        host.stride(1),
        host.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        PAGE=page_size,
        BLOCK_D=triton.next_power_of_2(head_dim),
        AMAX_FLOOR=AMAX_FLOOR,
        WRITE=write,
        num_warps=1,
        PDL=pdl,
        launch_pdl=pdl,
    )
