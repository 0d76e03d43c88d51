"""Sparse paged decode: one query token per sequence over its list of selected blocks.

Each (sequence, KV head) attends the listed blocks (sel[slot, kvh], logical indices, -1 padded)
before the current local window, plus that window (the last `local` blocks). Kernel 1 runs a
grid of (sequence, KV head, split) programs sized for the cap + local entries; its splits share
the row's listed entries and window, each serving the whole GQA group and writing a partial
output and its log-sum-exp; kernel 2 merges. Padding and in-window entries load nothing. With
TMA (compute capability 9+) a twin of kernel 1 gathers, its splits over the cap's entries.

Under KV offload, `offload` = (pool slots [N, 2, bs, D], host rows [R, 2, bs, D], loc: int64
[B, Hkv, cap]): a listed block comes from pool slot `loc` where loc >= 0, else from host row
-(loc + 1) over UVA (bypass); the window still comes from kv_cache. With `view_by_slot` loc is
indexed by the lists' rows (as sel), not the batch rows (lagged reads, kvcache/offload.py).
Design notes: docs/sparse.md, "Kernel notes".
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

from sparseserve.kernels.dispatch import tl, triton, use_triton
from sparseserve.kernels.paged_decode import MERGE_TILE, merge_splits, softmax_update
from sparseserve.kernels.pdl import pdl_wait, use_pdl

LOG2E = 1.4426950408889634


# ---- references ----


def listed_rows(sel_rows: torch.Tensor, seq_lens: torch.Tensor, local: int, block_size: int) -> torch.Tensor:
    """bool [B, Hkv, cap]: entries the kernel attends outside the local window (full blocks)."""
    nb = (seq_lens.long() + block_size - 1) // block_size
    return (sel_rows >= 0) & (sel_rows < (nb - local).clamp_min(0)[:, None, None])


def attended_blocks(
    sel_rows: torch.Tensor, seq_lens: torch.Tensor, local: int, block_size: int, max_blocks: int
) -> torch.Tensor:
    """bool [B, Hkv, MB]: the blocks the sparse kernel attends given lists sel_rows [B, Hkv, cap]:
    listed blocks before the current local window, plus that window."""
    nb = (seq_lens.long() + block_size - 1) // block_size
    local_start = (nb - local).clamp_min(0)
    j = torch.arange(max_blocks, device=seq_lens.device)[None]
    window = (j >= local_start[:, None]) & (j < nb[:, None])
    listed = (sel_rows >= 0) & (sel_rows < local_start[:, None, None])
    idx = torch.where(listed, sel_rows.long(), max_blocks).clamp_max(max_blocks)
    mask = torch.zeros(*sel_rows.shape[:2], max_blocks + 1, dtype=torch.bool, device=sel_rows.device)
    mask.scatter_(-1, idx, True)
    return mask[..., :max_blocks] | window[:, None]


def read_listed_ref(offload: tuple) -> torch.Tensor:
    """[B, Hkv, cap, 2, bs, D]: each entry's head block from pool slot loc, or from host row
    -(loc + 1) where loc < 0 (unlisted entries read something masked later)."""
    pool_slots, host_flat, loc = offload
    from_pool = pool_slots[loc.clamp_min(0)]
    from_host = host_flat[(-1 - loc).clamp(0, host_flat.shape[0] - 1).to(host_flat.device)].to(pool_slots.device)
    return torch.where((loc >= 0)[..., None, None, None], from_pool, from_host)


def offload_context_ref(
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sel_rows: torch.Tensor,
    local: int,
    offload: tuple,
) -> torch.Tensor:
    """float32 [B, MB, Hkv, 2, bs, D]: each context as a decode may read it under offload: the
    local window from kv_cache, listed blocks through the pool view, zeros elsewhere."""
    batch, num_kv_heads, _ = sel_rows.shape
    block_size = kv_cache.shape[3]
    mb, dev = _max_blocks(seq_lens, block_size), sel_rows.device
    nb = (seq_lens.long() + block_size - 1) // block_size
    j = torch.arange(mb, device=dev)[None]
    window = (j >= (nb - local).clamp_min(0)[:, None]) & (j < nb[:, None])  # [B, MB]
    kv = kv_cache[block_tables[:, :mb].long()].float()
    kv = torch.where(window[:, :, None, None, None, None], kv, 0.0)  # only the window from the cache
    flat = torch.cat([kv.reshape(-1, *kv.shape[3:]), kv.new_zeros(1, *kv.shape[3:])])  # + trash row
    listed = listed_rows(sel_rows, seq_lens, local, block_size)
    b = torch.arange(batch, device=dev)[:, None, None]
    h = torch.arange(num_kv_heads, device=dev)[None, :, None]
    dst = torch.where(listed, (b * mb + sel_rows.long().clamp(0, mb - 1)) * num_kv_heads + h, flat.shape[0] - 1)
    flat[dst.reshape(-1)] = read_listed_ref(offload).reshape(-1, *kv.shape[3:]).float()
    return flat[:-1].view_as(kv)


def attend_blocks_ref(
    q: torch.Tensor, kv: torch.Tensor, seq_lens: torch.Tensor, blocks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of q [B, Hq, D] over the blocks marked in blocks [B, Hkv, MB] of
    kv [B, MB, Hkv, 2, bs, D]."""
    batch, num_q_heads, head_dim = q.shape
    _, mb, num_kv_heads, _, block_size, _ = kv.shape
    ctx = mb * block_size
    k = kv[:, :, :, 0].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, ctx, head_dim)
    v = kv[:, :, :, 1].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, ctx, head_dim)
    in_context = torch.arange(ctx, device=q.device) < seq_lens[:, None]
    visible = blocks.repeat_interleave(block_size, -1) & in_context[:, None]
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    s = torch.einsum("bhgd,bhkd->bhgk", qg, k) * scale
    v = v.masked_fill(~visible[..., None], 0.0)  # unwritten memory may be NaN
    probs = torch.softmax(s.masked_fill(~visible[:, :, None], float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bhgk,bhkd->bhgd", probs, v).reshape(batch, num_q_heads, head_dim).to(q.dtype)


def _max_blocks(seq_lens: torch.Tensor, block_size: int) -> int:
    return max(1, -(-int(seq_lens.max()) // block_size)) if seq_lens.numel() else 1


def sparse_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sel: torch.Tensor,
    slots: torch.Tensor,
    local: int,
    scale: float,
    out: torch.Tensor | None = None,
    offload: tuple | None = None,
    view_by_slot: bool = False,
) -> torch.Tensor:
    """Attention of decode queries q [B, Hq, D] over the blocks their lists sel[slots]
    ([S, Hkv, cap], one layer's) name plus the local window, in float32; fills (or returns)
    out [B, Hq, D]. Under offload, bit-identical to the same data without it."""
    block_size = kv_cache.shape[3]
    sel_rows = sel[slots.long()]
    mb = _max_blocks(seq_lens, block_size)
    blocks = attended_blocks(sel_rows, seq_lens, local, block_size, mb)  # [B, Hkv, MB]
    if offload is None:
        kv = kv_cache[block_tables[:, :mb].long()].float()  # [B, MB, Hkv, 2, bs, D]
    else:
        if view_by_slot:
            pool_slots, host_flat, loc = offload
            offload = (pool_slots, host_flat, loc[slots.long()])
        kv = offload_context_ref(kv_cache, block_tables, seq_lens, sel_rows, local, offload)
    res = attend_blocks_ref(q, kv, seq_lens, blocks, scale)
    if out is None:
        return res
    out.copy_(res)
    return out


def sparse_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sel: torch.Tensor,
    slots: torch.Tensor,
    local: int,
    scale: float,
    out: torch.Tensor | None = None,
    offload: tuple | None = None,
    view_by_slot: bool = False,
) -> torch.Tensor:
    """sparse_decode_ref's contract."""
    fn = sparse_decode_triton if use_triton(q) else sparse_decode_ref
    return fn(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        sel,
        slots,
        local,
        scale,
        out=out,
        offload=offload,
        view_by_slot=view_by_slot,
    )


# ---- Triton ----


@triton.jit
def _attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PREC: tl.constexpr):
    """Online-softmax update of the group's query heads with one tile (visible: its columns)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    acc, m_i, l_i = softmax_update(acc, m_i, l_i, tl.where(visible[None, :], s, float("-inf")), v, DOT_PREC)
    return m_i, l_i, acc


@triton.jit
def _store_partial(
    part_out_ptr,
    part_lse_ptr,
    b,
    heads,
    split,
    dims,
    g,
    q_mask,
    m_i,
    l_i,
    acc,
    GROUP: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """part_out [B, Hq, splits, BLOCK_D], part_lse [B, Hq, splits]; empty split: zeros, -inf."""
    row = (b * tl.num_programs(1) * GROUP + heads).to(tl.int64) * tl.num_programs(2) + split
    tl.store(
        part_out_ptr + row[:, None] * BLOCK_D + dims[None, :], acc / tl.where(l_i > 0, l_i, 1.0)[:, None], mask=q_mask
    )
    tl.store(part_lse_ptr + row, tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf")), mask=g < GROUP)


# The tables' width follows the step: not specialized on.
@triton.jit(do_not_specialize=["stride_tb"])
def _sparse_split_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    seq_lens_ptr,
    slots_ptr,
    sel_ptr,
    part_out_ptr,
    part_lse_ptr,
    pool_ptr,
    host_ptr,
    loc_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ch,
    stride_ckv,
    stride_tb,
    stride_ss,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAP: tl.constexpr,
    LOCAL: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_E: tl.constexpr,
    CAP_PAD: tl.constexpr,
    DOT_PREC: tl.constexpr,
    OFFLOAD: tl.constexpr,
    VIEW_BY_SLOT: tl.constexpr,
    ALIGNED: tl.constexpr,
    PDL: tl.constexpr,
):
    """One split of a row's list and window (plain gather). ALIGNED (the launcher checks it: kv_rows_aligned):
    under OFFLOAD every K and V token row starts 16-byte aligned, so the picked rows load in 16-byte vectors."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)  # 0 for padding rows: no entry is valid
    slot = tl.load(slots_ptr + b).to(tl.int64)  # step inputs: read before pdl_wait (kernels/pdl.py)
    pdl_wait(PDL)
    nb = tl.cdiv(seq_len, BLOCK_SIZE)
    local_start = tl.maximum(nb - LOCAL, 0)
    sel_row = sel_ptr + slot * stride_ss + kvh * CAP
    table_row = table_ptr + b.to(tl.int64) * stride_tb

    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    q_mask = (g[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    kv_base = cache_ptr + kvh * stride_ch

    t = tl.arange(0, TILE_E * BLOCK_SIZE)  # entry t // BLOCK_SIZE, row t % BLOCK_SIZE
    off = t % BLOCK_SIZE
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    # Lists hold their entries first, then -1 (adaptive lists fill a fraction of the cap): the
    # splits share the row's n listed entries and its window, entry v < n the list's, v >= n the
    # window's, so every program of the fixed grid works however full the list is.
    c = tl.arange(0, CAP_PAD)
    n = tl.max(tl.where(tl.load(sel_row + c, mask=c < CAP, other=-1) >= 0, c + 1, 0), 0)  # past the last entry
    per = tl.cdiv(tl.cdiv(n + LOCAL, TILE_E), tl.num_programs(2)) * TILE_E
    v_start = split * per
    v_end = tl.minimum(v_start + per, n + LOCAL)
    # config.tiles tiles a program, software-pipelined. No branch on empty tiles: it would stop
    # the pipelining, and masked-off entries load nothing anyway.
    for v0 in range(v_start, v_end, TILE_E):
        v = v0 + t // BLOCK_SIZE
        listed = v < n
        e = tl.where(listed, v, CAP + v - n)  # the entry: list position, or CAP + window position
        j = tl.load(sel_row + e, mask=listed, other=-1)
        j = tl.where(listed, j, local_start + e - CAP)
        ok = tl.where(listed, (j >= 0) & (j < local_start), j < nb) & (v < v_end)
        ok = ok & (j * BLOCK_SIZE + off < seq_len)
        if OFFLOAD:  # listed: pool slot or host row (bypass); the window: the device cache
            in_list = ok & listed
            lrow = ((slot if VIEW_BY_SLOT else b.to(tl.int64)) * tl.num_programs(1) + kvh) * CAP
            pslot = tl.load(loc_ptr + lrow + e, mask=in_list, other=-1)
            blk = tl.load(table_row + j, mask=ok & ~listed, other=0).to(tl.int64)
            # One pointer per token row (a select, not three masked loads): pool, host (UVA) or cache.
            k_rows = (
                tl.where(
                    in_list & (pslot >= 0),
                    pool_ptr + tl.maximum(pslot, 0) * (2 * BLOCK_SIZE * HEAD_DIM),
                    tl.where(in_list, host_ptr + (-1 - pslot) * (2 * BLOCK_SIZE * HEAD_DIM), kv_base + blk * stride_cb),
                )
                + off * HEAD_DIM
            )
            v_rows = k_rows + tl.where(in_list, BLOCK_SIZE * HEAD_DIM, stride_ckv)
            if ALIGNED:  # the select loses the bases' alignment (docs/kernels.md, "Design notes")
                k_rows = tl.multiple_of(k_rows, 16)
                v_rows = tl.multiple_of(v_rows, 16)
            kv_mask = ok[:, None] & (dims[None, :] < HEAD_DIM)
            k = tl.load(k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        else:
            blk = tl.load(table_row + j, mask=ok, other=0).to(tl.int64)
            k_ptrs = kv_base + (blk * stride_cb + off * HEAD_DIM)[:, None] + dims[None, :]
            kv_mask = ok[:, None] & (dims[None, :] < HEAD_DIM)
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(k_ptrs + stride_ckv, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, ok, m_i, l_i, acc, qk_scale, DOT_PREC)
    _store_partial(part_out_ptr, part_lse_ptr, b, heads, split, dims, g, q_mask, m_i, l_i, acc, GROUP, BLOCK_D)


# Nothing step-shaped is specialized on (docs/architecture.md, "kernels/").
@triton.jit(do_not_specialize=["stride_tb"])
def _sparse_split_tma_kernel(
    q_ptr,
    kv_desc,
    table_ptr,
    seq_lens_ptr,
    slots_ptr,
    sel_ptr,
    part_out_ptr,
    part_lse_ptr,
    pool_desc,
    host_ptr,
    loc_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_tb,
    stride_ss,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAP: tl.constexpr,
    LOCAL: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_E: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_PREC: tl.constexpr,
    OFFLOAD: tl.constexpr,
    VIEW_BY_SLOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """The split kernel with the block gather done by TMA: a descriptor over the layer's cache as
    [blocks x Hkv x 2 x block_size, D] rows, one [block_size, D] box for K and one for V. A
    program loads its SPLIT_E entries' blocks up front, then loops over valid entries only, so
    no load depends on another (docs/sparse.md, "Kernel notes"). OFFLOAD: the listed entries in
    pool slots through a second descriptor over the pool ([slots x 2 x block_size, D] rows), those
    read from their host rows (bypass) by pointer, the window from the cache."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)  # step inputs: read before pdl_wait (kernels/pdl.py)
    pdl_wait(PDL)
    nb = tl.cdiv(seq_len, BLOCK_SIZE)
    local_start = tl.maximum(nb - LOCAL, 0)
    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    q_mask = (g[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)

    e = split * SPLIT_E + tl.arange(0, SPLIT_E)
    listed = e < CAP
    j = tl.load(sel_ptr + slot * stride_ss + kvh * CAP + e, mask=listed, other=-1)
    j = tl.where(listed, j, local_start + e - CAP)
    ok = tl.where(listed, (j >= 0) & (j < local_start), j < nb) & (e < CAP + LOCAL)
    cached = ok
    if OFFLOAD:  # listed entries: a pool slot, or -(host row + 1); the window: the device cache
        lrow = ((slot if VIEW_BY_SLOT else b.to(tl.int64)) * NUM_KV_HEADS + kvh) * CAP
        in_list = ok & listed
        pslot = tl.load(loc_ptr + lrow + e, mask=in_list, other=-1).to(tl.int64)
        cached = ok & ~listed
    blk = tl.load(table_ptr + b.to(tl.int64) * stride_tb + j, mask=cached, other=0)
    rank = tl.where(cached, tl.cumsum(cached.to(tl.int32), 0) - 1, -1)  # the loop's i-th block: rank i
    # the block's K rows, V after them (int32: TMA coordinates)
    row0 = (blk * NUM_KV_HEADS + kvh) * (2 * BLOCK_SIZE)
    tok = tl.arange(0, BLOCK_SIZE)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    for i in tl.range(0, tl.sum(cached.to(tl.int32), 0), num_stages=NUM_STAGES):
        pick = rank == i
        r = tl.sum(tl.where(pick, row0, 0), 0)
        first = tl.sum(tl.where(pick, j, 0), 0) * BLOCK_SIZE
        k = kv_desc.load([r, 0])
        v = kv_desc.load([r + BLOCK_SIZE, 0])
        m_i, l_i, acc = _attend_tile(q, k, v, first + tok < seq_len, m_i, l_i, acc, qk_scale, DOT_PREC)
    if OFFLOAD:
        pooled = in_list & (pslot >= 0)
        prank = tl.where(pooled, tl.cumsum(pooled.to(tl.int32), 0) - 1, -1)
        prow = (tl.maximum(pslot, 0) * (2 * BLOCK_SIZE)).to(tl.int32)
        for i in tl.range(0, tl.sum(pooled.to(tl.int32), 0), num_stages=NUM_STAGES):
            r = tl.sum(tl.where(prank == i, prow, 0), 0)
            k = pool_desc.load([r, 0])
            v = pool_desc.load([r + BLOCK_SIZE, 0])  # a listed block lies before the window: every row valid
            m_i, l_i, acc = _attend_tile(q, k, v, tok < BLOCK_SIZE, m_i, l_i, acc, qk_scale, DOT_PREC)
        hosted = in_list & (pslot < 0)
        hrank = tl.where(hosted, tl.cumsum(hosted.to(tl.int32), 0) - 1, -1)
        kv_mask = (tok < BLOCK_SIZE)[:, None] & (dims < HEAD_DIM)[None, :]
        for i in range(0, tl.sum(hosted.to(tl.int32), 0)):  # rare (the pool's bypass reads): by pointer, UVA
            base = host_ptr + tl.sum(tl.where(hrank == i, -1 - pslot, 0), 0) * (2 * BLOCK_SIZE * HEAD_DIM)
            k_ptrs = base + (tok * HEAD_DIM)[:, None] + dims[None, :]
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(k_ptrs + BLOCK_SIZE * HEAD_DIM, mask=kv_mask, other=0.0)
            m_i, l_i, acc = _attend_tile(q, k, v, tok < BLOCK_SIZE, m_i, l_i, acc, qk_scale, DOT_PREC)
    _store_partial(part_out_ptr, part_lse_ptr, b, heads, split, dims, g, q_mask, m_i, l_i, acc, GROUP, BLOCK_D)


# The number of splits follows the batch: not specialized on, merged in tiles (merge_splits).
@triton.jit(do_not_specialize=["num_splits"])
def _sparse_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Log-sum-exp merge of one (sequence, query head); a row that attended nothing gets zeros."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    row0 = (b * NUM_Q_HEADS + h).to(tl.int64) * num_splits
    out = merge_splits(part_out_ptr, part_lse_ptr, row0, num_splits, BLOCK_D, MERGE_TILE)
    dims = tl.arange(0, BLOCK_D)
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ot + h * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@dataclass(frozen=True)
class SparseDecodeConfig:
    """The split kernel's launch; FAST_CONFIG and TMA_CONFIG: docs/sparse.md, "Kernel notes"."""

    tile_n: int = 128  # tokens a tile (whole blocks: at least one)
    # tiles == 0: programs aimed at (0: 8 an SM); else the least (0: 2 an SM)
    target_programs: int = 0
    num_warps: int = 4
    num_stages: int = 2
    tiles: int = 0  # tiles a program loops over (0: as many as target_programs leaves)
    tma: bool = False  # gather with TMA (capability 9+; offload: the pool's too): tiles x tile_n tokens


# bf16/fp16 where TMA does not apply: a few tiles a program, 3 stages; 2 under offload, whose pointer select
# holds more registers a stage (at 3, fewer programs fit an SM: docs/offload.md).
FAST_CONFIG = SparseDecodeConfig(tile_n=128, num_warps=4, num_stages=3, tiles=4)
FAST_OFFLOAD_CONFIG = replace(FAST_CONFIG, num_stages=2)
# Where TMA applies (bf16/fp16, capability 9+; offload too): 16 blocks a program, 2 warps.
TMA_CONFIG = SparseDecodeConfig(tile_n=128, num_warps=2, num_stages=3, tiles=4, tma=True)


# Blocks smaller than this take the plain kernel even where TMA applies: its tile gathers several blocks, where
# TMA copies a box a block; under offload, boxes (block x head_dim elements) smaller than TMA_MIN_BOX do
# (docs/sparse.md, "Kernel notes").
TMA_MIN_BLOCK = 32
TMA_MIN_BOX = 2048


def default_config(kv_cache: torch.Tensor, offload) -> SparseDecodeConfig:
    """TMA_CONFIG on a GPU where TMA applies (blocks of TMA_MIN_BLOCK tokens or more; offloaded, boxes of
    TMA_MIN_BOX elements or more), else FAST_CONFIG, or FAST_OFFLOAD_CONFIG offloaded (the interpreter: plain)."""
    on_gpu = kv_cache.device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    block_size, head_dim = kv_cache.shape[3], kv_cache.shape[-1]
    big_blocks = block_size >= TMA_MIN_BLOCK or (offload is not None and block_size * head_dim >= TMA_MIN_BOX)
    if on_gpu and big_blocks and tma_capable(kv_cache, offload):
        return TMA_CONFIG
    return FAST_CONFIG if offload is None else FAST_OFFLOAD_CONFIG


def tma_capable(kv_cache: torch.Tensor, offload) -> bool:
    """2-D descriptors over the cache (and the pool) work: contiguous tensors whose head_dim is a power
    of two, a GPU of compute capability 9+ or the interpreter."""
    head_dim = kv_cache.shape[-1]
    if not kv_cache.is_contiguous() or head_dim & (head_dim - 1):
        return False
    if offload is not None and not offload[0].is_contiguous():
        return False
    return kv_cache.device.type != "cuda" or torch.cuda.get_device_capability(kv_cache.device)[0] >= 9


def kv_rows_aligned(kv_cache: torch.Tensor, *bases: torch.Tensor) -> bool:
    """Whether every K and V token row an offloaded read can pick starts 16-byte aligned: the cache's and each
    base's (pool, host store) start, and the cache's block, head, K/V and row strides."""
    es = kv_cache.element_size()
    return all(t.data_ptr() % 16 == 0 for t in (kv_cache, *bases)) and all(
        kv_cache.stride(i) * es % 16 == 0 for i in range(4)
    )


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def split_plan(
    batch: int, num_kv_heads: int, entries: int, tile_e: int, device: torch.device, config: SparseDecodeConfig
) -> tuple[int, int]:
    """(entries per split, splits) from shapes only: a fixed grid under a CUDA graph."""
    tiles = triton.cdiv(entries, tile_e)
    if config.tiles:
        per_split = min(tiles, config.tiles)
        # Halved while the grid has fewer than target_programs (default: two an SM): the
        # kernel is short and latency-bound at small batches.
        least = config.target_programs or 2 * num_sms(device)
        while per_split > 1 and batch * num_kv_heads * triton.cdiv(tiles, per_split) < least:
            per_split //= 2
    else:
        target = config.target_programs or 8 * num_sms(device)
        splits = min(tiles, max(1, triton.cdiv(target, batch * num_kv_heads)))
        per_split = triton.cdiv(tiles, splits)
    return per_split * tile_e, triton.cdiv(tiles, per_split)


def sparse_decode_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sel: torch.Tensor,
    slots: torch.Tensor,
    local: int,
    scale: float,
    out: torch.Tensor | None = None,
    offload: tuple | None = None,
    view_by_slot: bool = False,
    config: SparseDecodeConfig | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D]; sel: one layer's lists [S, Hkv, cap]; slots: int32 [B].
    Returns (fills) out [B, Hq, D]."""
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    cap = sel.shape[-1]
    assert kv_cache.stride(4) == 1 and kv_cache.stride(3) == head_dim and q.stride(2) == 1 and sel.stride(2) == 1
    if config is None:
        config = SparseDecodeConfig(tile_n=32) if q.dtype == torch.float32 else default_config(kv_cache, offload)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    tile_e = max(1, config.tile_n // block_size, 16 // block_size)  # tl.dot needs 16 rows
    per_split, num_splits = split_plan(batch, num_kv_heads, cap + local, tile_e, q.device, config)
    block_d = triton.next_power_of_2(head_dim)
    part_out = torch.empty(batch, num_q_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    if offload is not None:
        pool_slots, host_flat, loc = offload
        assert pool_slots.is_contiguous() and host_flat.is_contiguous() and pool_slots.dtype == kv_cache.dtype
        rows = sel.shape[0] if view_by_slot else batch  # by slot: a scratch row may follow
        assert loc.shape[1:] == (num_kv_heads, cap) and loc.shape[0] >= rows and loc.is_contiguous()
        assert loc.dtype == torch.int64
    else:
        pool_slots = host_flat = loc = kv_cache  # unused (OFFLOAD=False)
    pdl = use_pdl(q.device)
    common = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        CAP=cap,
        LOCAL=local,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl,
    )
    # else the plain kernel
    if config.tma and tma_capable(kv_cache, offload) and per_split & (per_split - 1) == 0:
        from triton.tools.tensor_descriptor import TensorDescriptor

        box = [block_size, head_dim]
        kv_desc = TensorDescriptor.from_tensor(kv_cache.view(-1, head_dim), box)
        pool_desc = kv_desc if offload is None else TensorDescriptor.from_tensor(pool_slots.view(-1, head_dim), box)
        _sparse_split_tma_kernel[(batch, num_kv_heads, num_splits)](
            q,
            kv_desc,
            block_tables,
            seq_lens,
            slots,
            sel,
            part_out,
            part_lse,
            pool_desc,
            host_flat,
            loc,
            scale * LOG2E,
            q.stride(0),
            q.stride(1),
            block_tables.stride(0),
            sel.stride(0),
            NUM_KV_HEADS=num_kv_heads,
            SPLIT_E=per_split,
            NUM_STAGES=config.num_stages,
            OFFLOAD=offload is not None,
            VIEW_BY_SLOT=view_by_slot,
            **common,
        )
    else:
        _sparse_split_kernel[(batch, num_kv_heads, num_splits)](
            q,
            kv_cache,
            block_tables,
            seq_lens,
            slots,
            sel,
            part_out,
            part_lse,
            pool_slots,
            host_flat,
            loc,
            scale * LOG2E,
            q.stride(0),
            q.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            block_tables.stride(0),
            sel.stride(0),
            TILE_E=tile_e,
            CAP_PAD=triton.next_power_of_2(cap),
            OFFLOAD=offload is not None,
            VIEW_BY_SLOT=view_by_slot,
            ALIGNED=offload is not None and kv_rows_aligned(kv_cache, pool_slots, host_flat),
            **common,
        )
    _sparse_merge_kernel[(batch, num_q_heads)](
        part_out,
        part_lse,
        out,
        num_splits,
        out.stride(0),
        out.stride(1),
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        MERGE_TILE=MERGE_TILE,
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out
