"""Triton kernels of sparse decode's bookkeeping: key-metadata update, block scoring, block selection.

References: kvcache/metadata.py (update_key_meta_ref) and attention/selection.py (block_scores_ref,
update_selection_ref). Grids depend only on shapes and host-side bounds; programs past a sequence's
end, of padding rows, or of (sequence, KV head) pairs that reuse their selection this step return
at once, so the whole decode step can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparseserve.attention.selection import SelectionParams

MAX_SELECT_BLOCKS = 16384  # one selection program holds a row of block scores in registers


@dataclass(frozen=True)
class ScoreConfig:
    rows: int = 64        # metadata rows (blocks x pages) a program scores
    num_warps: int = 4
    num_stages: int = 3   # Triton's default; one tile a program, so stages only cost shared memory


@dataclass(frozen=True)
class SelectConfig:
    ways: int = 4         # thresholds tested per search round (a power of two >= 2)
    num_warps: int = 0    # 0: by the row length


@triton.jit
def _key_meta_kernel(cache_ptr, meta_ptr, slot_ptr, num_tokens,
                     stride_cb, stride_ch, stride_mb, stride_mh, stride_mm,
                     HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (token, KV head): if the token is the last one this step writes into its page, the
    page's min/max over its tokens so far, read back from the cache (reference: update_key_meta_ref)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    nxt = tl.load(slot_ptr + t + 1, mask=t + 1 < num_tokens, other=-1)
    if (slot < 0) | ((nxt == slot + 1) & ((slot + 1) % PAGE != 0)):
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    page = off // PAGE
    rows = page * PAGE + tl.arange(0, PAGE)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows <= off)[:, None] & (dims < HEAD_DIM)[None, :]
    keys = tl.load(cache_ptr + blk * stride_cb + h * stride_ch + rows[:, None] * HEAD_DIM + dims[None, :],
                   mask=mask, other=0.0)
    kmin = tl.min(tl.where(mask, keys, float("inf")), 0)
    kmax = tl.max(tl.where(mask, keys, float("-inf")), 0)
    dst = meta_ptr + blk * stride_mb + h * stride_mh + page * HEAD_DIM + dims
    tl.store(dst, kmin.to(meta_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
    tl.store(dst + stride_mm, kmax.to(meta_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def update_key_meta(kv_cache: torch.Tensor, key_meta: torch.Tensor, slot_mapping: torch.Tensor, page_size: int) -> None:
    """kv_cache: one layer [NB, Hkv, 2, bs, D] (this step's K/V already stored); key_meta: [NB + 1, Hkv, 2, P, D]."""
    num_tokens = slot_mapping.numel()
    _, hkv, _, block_size, head_dim = kv_cache.shape
    assert key_meta.stride(-1) == 1 and key_meta.stride(-2) == head_dim and kv_cache.stride(3) == head_dim
    if num_tokens == 0:
        return
    _key_meta_kernel[(num_tokens, hkv)](
        kv_cache, key_meta, slot_mapping, num_tokens,
        kv_cache.stride(0), kv_cache.stride(1), key_meta.stride(0), key_meta.stride(1), key_meta.stride(2),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, PAGE=page_size, BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1)


@triton.jit
def _score_kernel(q_ptr, meta_ptr, table_ptr, seq_lens_ptr, slots_ptr, counter_ptr, scores_ptr, scale,
                  stride_qt, stride_qh, stride_mb, stride_mh, stride_mm, stride_tb, stride_cs, max_blocks,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr,
                  CAP: tl.constexpr, REUSE: tl.constexpr, SHORT_DENSE: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """Program (sequence, KV head, chunk of BLOCK_N blocks): scores[b, h, n] = scale * max over the
    block's pages of q+ . kmax + q- . kmin, for the GROUP query heads h (reference: block_scores_ref)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    n0 = tl.program_id(2) * BLOCK_N
    seq_len = tl.load(seq_lens_ptr + b)
    nb = tl.cdiv(seq_len, BLOCK_SIZE)
    if n0 >= nb:
        return
    if (nb <= CAP) & SHORT_DENSE:  # every block is selected anyway
        return
    if REUSE > 1:
        slot = tl.load(slots_ptr + b).to(tl.int64)
        if tl.load(counter_ptr + slot * stride_cs + kvh) % REUSE != 0:
            return
    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=(g < GROUP)[:, None] & (dims < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
    q_pos = tl.maximum(q, 0.0).to(meta_ptr.dtype.element_ty)
    q_neg = tl.minimum(q, 0.0).to(meta_ptr.dtype.element_ty)
    # Rows: BLOCK_N blocks x PAGES pages; a page's min then max sit stride_mm apart.
    r = tl.arange(0, BLOCK_N * PAGES)
    n = n0 + r // PAGES
    page = r % PAGES
    valid = (n * BLOCK_SIZE + page * (BLOCK_SIZE // PAGES)) < seq_len
    blk = tl.load(table_ptr + b.to(tl.int64) * stride_tb + n, mask=valid, other=0).to(tl.int64)
    ptrs = meta_ptr + (blk * stride_mb + kvh * stride_mh + page * HEAD_DIM)[:, None] + dims[None, :]
    kmask = valid[:, None] & (dims < HEAD_DIM)[None, :]
    kmin = tl.load(ptrs, mask=kmask, other=0.0)
    kmax = tl.load(ptrs + stride_mm, mask=kmask, other=0.0)
    s = (tl.dot(q_pos, tl.trans(kmax), input_precision=DOT_PREC)
         + tl.dot(q_neg, tl.trans(kmin), input_precision=DOT_PREC))
    s = tl.where(valid[None, :], s * scale, float("-inf"))
    if PAGES > 1:
        s = tl.max(tl.reshape(s, (BLOCK_G, BLOCK_N, PAGES)), 2)
    nn = n0 + tl.arange(0, BLOCK_N)
    row = (b * tl.num_programs(1) * GROUP + heads).to(tl.int64) * max_blocks
    tl.store(scores_ptr + row[:, None] + nn[None, :], s, mask=(g < GROUP)[:, None] & (nn < nb)[None, :])


@triton.jit
def _select_kernel(scores_ptr, seq_lens_ptr, slots_ptr, sel_ptr, counter_ptr, stats_ptr, streaming_ptr,
                   mass_target, max_blocks, stride_ss, stride_cs,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAP: tl.constexpr, SINK: tl.constexpr,
                   LOCAL: tl.constexpr, REUSE: tl.constexpr, SHORT_DENSE: tl.constexpr, MASS: tl.constexpr,
                   WAYS: tl.constexpr, ITERS: tl.constexpr, NB_PAD: tl.constexpr):
    """Program (sequence, KV head): the selection list (reference: select_ref / update_selection_ref).

    Without a sort: a search over the bit patterns of the (non-negative float) block masses, which
    order like the masses, finds the largest threshold t at which the candidates >= t number at least
    k = cap - #forced or (MASS: topp) bring the mass to the target. Each round tests WAYS thresholds
    at once (one reduction for all) and keeps the interval between the last that passes and the
    next; ITERS rounds narrow [0, +inf] to one bit pattern, so t is exactly a mass value.
    Candidates above t, then ties at t, fill the list after the forced blocks, in block order.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    if seq_len == 0:
        return
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if REUSE > 1:
        step = tl.load(counter_ptr + slot * stride_cs + kvh)
        tl.store(counter_ptr + slot * stride_cs + kvh, step + 1)
        if step % REUSE != 0:
            return
    nb = tl.cdiv(seq_len, BLOCK_SIZE)
    j = tl.arange(0, NB_PAD)
    valid = j < nb
    forced = valid & ((j < SINK) | (j >= nb - LOCAL) | ((nb <= CAP) & SHORT_DENSE))
    n_forced = tl.sum(forced.to(tl.int32), 0)
    chosen_hi = j < 0  # all false
    chosen_eq = j < 0
    if (nb > CAP) | (not SHORT_DENSE):
        r = tl.zeros([NB_PAD], tl.float32)
        for g in tl.static_range(GROUP):
            row = (b * tl.num_programs(1) * GROUP + kvh * GROUP + g).to(tl.int64) * max_blocks
            s = tl.load(scores_ptr + row + j, mask=valid, other=float("-inf"))
            e = tl.exp(s - tl.max(s, 0))
            r += e / tl.sum(e, 0)
        r = r / GROUP
        cand = valid & (forced == 0) & (tl.load(streaming_ptr + kvh) == 0)
        fmass = tl.sum(tl.where(forced, r, 0.0), 0)
        k = CAP - n_forced
        bits = r.to(tl.int32, bitcast=True)
        lo = tl.full([], 0, tl.int32)  # the answer is in [lo, hi); lo = 0 (every candidate) if none passes
        hi = tl.full([], 0x7F800001, tl.int32)  # one past +inf
        w = tl.arange(0, WAYS)
        for _ in range(ITERS):
            step = tl.cdiv(hi - lo, WAYS)
            th = lo + w * step  # th[0] = lo
            ge = cand[None, :] & (bits[None, :] >= th[:, None])  # [WAYS, NB_PAD]
            ok = tl.sum(ge.to(tl.int32), 1) >= k
            if MASS:
                ok = ok | (fmass + tl.sum(tl.where(ge, r[None, :], 0.0), 1) >= mass_target)
            # The test is monotone in t: the passing thresholds are a prefix, th[0] counted in.
            n_ok = tl.sum(((ok & (th < hi)) | (w == 0)).to(tl.int32), 0)
            hi = tl.minimum(lo + n_ok * step, hi)
            lo = lo + (n_ok - 1) * step
        chosen_hi = cand & (bits > lo)
        chosen_eq = cand & (bits == lo)
    n_hi = tl.sum(chosen_hi.to(tl.int32), 0)
    pos = tl.where(forced, tl.cumsum(forced.to(tl.int32), 0) - 1,
                   tl.where(chosen_hi, n_forced + tl.cumsum(chosen_hi.to(tl.int32), 0) - 1,
                            n_forced + n_hi + tl.cumsum(chosen_eq.to(tl.int32), 0) - 1))
    keep = ((forced.to(tl.int32) + chosen_hi.to(tl.int32) + chosen_eq.to(tl.int32)) > 0) & (pos < CAP)
    count = tl.minimum(n_forced + n_hi + tl.sum(chosen_eq.to(tl.int32), 0), CAP)
    row = sel_ptr + slot * stride_ss + kvh * CAP
    tl.store(row + pos, j, mask=keep)
    tl.store(row + j, tl.full([NB_PAD], -1, tl.int32), mask=(j >= count) & (j < CAP))
    tl.atomic_add(stats_ptr, count.to(tl.int64))
    tl.atomic_add(stats_ptr + 1, 1)


def block_scores(q: torch.Tensor, key_meta: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 slots: torch.Tensor, counter: torch.Tensor, p: SelectionParams, max_blocks: int,
                 scale: float, config: ScoreConfig | None = None) -> torch.Tensor:
    """float32 [B, Hq, max_blocks] (Triton twin of block_scores_ref), written only where selection
    reads it: rows with more than cap blocks that recompute this step, blocks inside the context."""
    batch, num_q_heads, head_dim = q.shape
    _, hkv, _, pages, _ = key_meta.shape
    assert counter.stride(1) == 1
    scores = torch.empty(batch, num_q_heads, max_blocks, dtype=torch.float32, device=q.device)
    config = config or ScoreConfig()
    block_n = max(1, config.rows // pages)  # two [G, D] x [D, rows] dots a program
    group = num_q_heads // hkv
    _score_kernel[(batch, hkv, triton.cdiv(max_blocks, block_n))](
        q, key_meta, block_tables, seq_lens, slots, counter, scores, scale,
        q.stride(0), q.stride(1), key_meta.stride(0), key_meta.stride(1), key_meta.stride(2),
        block_tables.stride(0), counter.stride(0), max_blocks,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=p.block_size, PAGES=pages, CAP=p.cap, REUSE=p.reuse,
        SHORT_DENSE=p.short_dense, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n, DOT_PREC="ieee" if key_meta.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages)
    return scores


def select_blocks(scores: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor, sel: torch.Tensor,
                  counter: torch.Tensor, stats: torch.Tensor, streaming: torch.Tensor, p: SelectionParams,
                  config: SelectConfig | None = None) -> None:
    """Triton twin of update_selection_ref: new lists into sel [S, Hkv, cap] at the rows' slots."""
    config = config or SelectConfig()
    batch, num_q_heads, max_blocks = scores.shape
    hkv = sel.shape[1]
    if max_blocks > MAX_SELECT_BLOCKS:
        raise ValueError(f"sparse selection handles up to {MAX_SELECT_BLOCKS} blocks per sequence, got "
                         f"{max_blocks}: raise block_size or lower max_model_len")
    assert sel.shape[-1] == p.cap and sel.stride(2) == 1 and counter.stride(1) == 1
    nb_pad = max(triton.next_power_of_2(max_blocks), triton.next_power_of_2(p.cap), 16)
    _select_kernel[(batch, hkv)](
        scores, seq_lens, slots, sel, counter, stats, streaming.view(torch.uint8), p.mass_target, max_blocks,
        sel.stride(0), counter.stride(0),
        GROUP=num_q_heads // hkv, BLOCK_SIZE=p.block_size, CAP=p.cap, SINK=p.sink, LOCAL=p.local,
        REUSE=p.reuse, SHORT_DENSE=p.short_dense, MASS=p.policy == "topp", WAYS=config.ways,
        ITERS=-(-31 // (config.ways.bit_length() - 1)) + 1, NB_PAD=nb_pad,
        num_warps=config.num_warps or min(16, max(4, nb_pad // 256)))


def score_and_select(q: torch.Tensor, key_meta: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     slots: torch.Tensor, sel: torch.Tensor, counter: torch.Tensor, stats: torch.Tensor,
                     streaming: torch.Tensor, p: SelectionParams, max_blocks: int, scale: float) -> None:
    """Scores then selects for the decode rows q [B, Hq, D]; max_blocks: host-side bound of the context."""
    if q.shape[0] == 0:
        return
    scores = block_scores(q, key_meta, block_tables, seq_lens, slots, counter, p, max_blocks, scale)
    select_blocks(scores, seq_lens, slots, sel, counter, stats, streaming, p)
