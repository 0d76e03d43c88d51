"""Triton kernels of sparse decode's bookkeeping: K/V store with the key-metadata update, block scoring, block
selection, and sparse_lag's list rows of a step.

References: attention/torch_ref.py (store_kv_ref), kvcache/metadata.py (update_key_meta_ref) and
attention/selection.py (block_scores_ref, update_selection_ref, step_slots_ref). Grids depend only on shapes
and host-side bounds; programs past a sequence's end, of padding rows, of rows that select nothing this step
(slot -1), or of (sequence, KV head) pairs that reuse their selection return at once, so the whole decode
step can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparseserve.attention.selection import SelectionParams
from sparseserve.kernels.pdl import pdl_wait, use_pdl
from sparseserve.kvcache.metadata import AMAX_FLOOR, KeyMeta

MAX_SELECT_BLOCKS = 16384  # one selection program holds a row of block scores in registers


@dataclass(frozen=True)
class ScoreConfig:
    # int8 metadata (H200 sweep, 128K context): 128 rows x 2 tiles a program 20.9 / 33.6 us at batch 4 / 8,
    # the former 64 x 8 26.2 / 34.7 us (more programs: a short kernel is latency-bound at small batches).
    # 2 stages (the second tile's loads in flight during the first; less shared memory than 3): 15.2 / 26.3 us
    # a layer in an 8-layer graph against 15.8 / 26.6 with 3 (fifth session, twice each).
    rows: int = 128       # metadata rows (blocks x pages) of a tile: two [G, D] x [D, rows] dots
    num_warps: int = 4
    num_stages: int = 2   # software pipelining of the tile loop
    tiles: int = 2        # tiles a program loops over (fewer when the context is short)


@dataclass(frozen=True)
class SelectConfig:
    ways: int = 2         # thresholds tested per search round (a power of two)
    num_warps: int = 0    # 0: by the row length (8 at 4096 blocks)


@triton.jit
def _store_kv_key_meta_kernel(k_ptr, v_ptr, cache_ptr, codes_ptr, scale_ptr, slot_ptr, meta_slot_ptr, num_tokens,
                              stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ch, stride_ckv,
                              stride_mb, stride_mh, stride_mm, stride_sb, stride_sh,
                              HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGE: tl.constexpr,
                              BLOCK_D: tl.constexpr, AMAX_FLOOR: tl.constexpr, PDL: tl.constexpr):
    """Program (token, KV head): stores the token's K and V (store_kv), and if the token is the last one this
    step writes into its page, recomputes the page's min/max over its tokens so far, quantized to int8 codes
    and a scale (reference: store_kv_ref then update_key_meta_ref, quantize_key_meta: the same float32
    operations, divisions rounded as IEEE's, so that both agree bit for bit). One launch instead of two in
    every sparse layer. The page's rows that this step writes (a prefill chunk's earlier tokens: other
    programs of this launch store them) are taken from k, the others from the cache (earlier steps). The
    metadata row is the token block of meta_slot (kv_offload: the cache holds device blocks)."""
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
    # A row is this step's when the token `back` places earlier in the batch has the slot `back` places earlier
    # (a sequence's tokens of a step are consecutive in the batch and in their slots).
    in_step = earlier & (tl.load(slot_ptr + src, mask=earlier, other=-1) == slot - back)
    pdl_wait(PDL)
    if slot < 0:
        return
    head_row = cache_ptr + blk * stride_cb + h * stride_ch
    k_src = k_ptr + h * stride_kh + dims
    tl.store(head_row + off * HEAD_DIM + dims,
             tl.load(k_src + t.to(tl.int64) * stride_kt, mask=dmask).to(cache_ptr.dtype.element_ty), mask=dmask)
    tl.store(head_row + stride_ckv + off * HEAD_DIM + dims,
             tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + dims, mask=dmask).to(
                 cache_ptr.dtype.element_ty), mask=dmask)
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


def store_kv_key_meta(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, key_meta: KeyMeta,
                      slot_mapping: torch.Tensor, page_size: int, meta_slots: torch.Tensor | None = None) -> None:
    """store_kv of k, v [T, Hkv, D] into kv_cache (one layer [NB, Hkv, 2, bs, D]) and the key-metadata
    update of the pages they end (key_meta: that layer's). meta_slots (kv_offload): the tokens' slots in
    token blocks, whose metadata rows are updated (None: slot_mapping)."""
    num_tokens = slot_mapping.numel()
    _, hkv, _, block_size, head_dim = kv_cache.shape
    codes, scale = key_meta.codes, key_meta.scale
    assert codes.stride(-1) == 1 and codes.stride(-2) == head_dim and scale.stride(-1) == 1
    assert kv_cache.stride(4) == 1 and kv_cache.stride(3) == head_dim and k.stride(2) == 1 and v.stride(2) == 1
    assert k.shape == v.shape == (num_tokens, hkv, head_dim)
    if num_tokens == 0:
        return
    meta_slots = slot_mapping if meta_slots is None else meta_slots
    pdl = use_pdl(kv_cache.device)
    _store_kv_key_meta_kernel[(num_tokens, hkv)](
        k, v, kv_cache, codes, scale, slot_mapping, meta_slots, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        codes.stride(0), codes.stride(1), codes.stride(2), scale.stride(0), scale.stride(1),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, PAGE=page_size, BLOCK_D=triton.next_power_of_2(head_dim),
        AMAX_FLOOR=AMAX_FLOOR, num_warps=1, PDL=pdl, launch_pdl=pdl)


@triton.jit
def _score_kernel(q_ptr, codes_ptr, page_scale_ptr, table_ptr, seq_lens_ptr, slots_ptr, counter_ptr, scores_ptr,
                  scale, stride_qt, stride_qh, stride_mb, stride_mh, stride_mm, stride_sb, stride_sh, stride_tb,
                  stride_cs, max_blocks, blocks_per_split,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr,
                  CAP: tl.constexpr, REUSE: tl.constexpr, SHORT_DENSE: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, NUM_STAGES: tl.constexpr,
                  PDL: tl.constexpr):
    """Program (sequence, KV head, split of blocks_per_split blocks): scores[b, h, n] = scale * max over
    the block's pages of page_scale * (q+ . codes_max + q- . codes_min), for the GROUP query heads h
    (reference: block_scores_ref). The int8 codes enter the dots in q's dtype (integers up to 127 are
    exact in bf16 and fp16).

    The split is a loop over tiles of BLOCK_N blocks that Triton software-pipelines (NUM_STAGES): the
    block-table and metadata loads of the next tiles are issued while a tile is scored (on an H200,
    3 stages: 2.8 TB/s standalone, 3.5 TB/s inside the decode graph; 1 stage: 2.4 TB/s)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    n_start = tl.program_id(2) * blocks_per_split
    # Whether this program has work: from step inputs and the reuse counter (selection's, of an earlier
    # step), read before pdl_wait (kernels/pdl.py), so that a reused step's programs exit on release.
    seq_len = tl.load(seq_lens_ptr + b)
    nb = tl.cdiv(seq_len, BLOCK_SIZE)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    # past the end; every block is selected anyway; or no selection (slot -1: sparse_lag's reused steps)
    idle = (n_start >= nb) | ((nb <= CAP) & SHORT_DENSE) | (slot < 0)
    if REUSE > 1:
        idle = idle | (tl.load(counter_ptr + slot * stride_cs + kvh, mask=slot >= 0, other=0) % REUSE != 0)
    pdl_wait(PDL)
    if idle:
        return
    n_end = tl.minimum(n_start + blocks_per_split, nb)
    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=(g < GROUP)[:, None] & (dims < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
    q_pos = tl.maximum(q, 0.0).to(q_ptr.dtype.element_ty)
    q_neg = tl.minimum(q, 0.0).to(q_ptr.dtype.element_ty)
    # Rows: BLOCK_N blocks x PAGES pages; a page's min then max codes sit stride_mm apart.
    r = tl.arange(0, BLOCK_N * PAGES)
    page = r % PAGES
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    codes_head = codes_ptr + kvh * stride_mh + page * HEAD_DIM
    page_scale_head = page_scale_ptr + kvh * stride_sh + page
    score_row = scores_ptr + (b * tl.num_programs(1) * GROUP + heads).to(tl.int64) * max_blocks
    for n0 in tl.range(n_start, n_end, BLOCK_N, num_stages=NUM_STAGES):
        n = n0 + r // PAGES
        valid = (n < n_end) & ((n * BLOCK_SIZE + page * (BLOCK_SIZE // PAGES)) < seq_len)
        blk = tl.load(table_row + n, mask=valid, other=0).to(tl.int64)
        ptrs = codes_head[:, None] + (blk * stride_mb)[:, None] + dims[None, :]
        kmask = valid[:, None] & (dims < HEAD_DIM)[None, :]
        cmin = tl.load(ptrs, mask=kmask, other=0).to(q_ptr.dtype.element_ty)
        cmax = tl.load(ptrs + stride_mm, mask=kmask, other=0).to(q_ptr.dtype.element_ty)
        row_scale = tl.load(page_scale_head + blk * stride_sb, mask=valid, other=0.0) * scale
        s = (tl.dot(q_pos, tl.trans(cmax), input_precision=DOT_PREC)
             + tl.dot(q_neg, tl.trans(cmin), input_precision=DOT_PREC))
        s = tl.where(valid[None, :], s * row_scale[None, :], float("-inf"))
        if PAGES > 1:
            s = tl.max(tl.reshape(s, (BLOCK_G, BLOCK_N, PAGES)), 2)
        nn = n0 + tl.arange(0, BLOCK_N)
        tl.store(score_row[:, None] + nn[None, :], s, mask=(g < GROUP)[:, None] & (nn < n_end)[None, :])


@triton.jit
def _select_kernel(scores_ptr, seq_lens_ptr, slots_ptr, sel_ptr, counter_ptr, stats_ptr, streaming_ptr,
                   mass_target, max_blocks, stride_ss, stride_cs,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAP: tl.constexpr, SINK: tl.constexpr,
                   LOCAL: tl.constexpr, REUSE: tl.constexpr, SHORT_DENSE: tl.constexpr, MASS: tl.constexpr,
                   WAYS: tl.constexpr, NB_PAD: tl.constexpr, HEADS: tl.constexpr, PDL: tl.constexpr):
    """Program (sequence, KV head): the selection list (reference: select_ref / update_selection_ref).

    Without a sort: a search over the bit patterns of the (non-negative float) block masses, which
    order like the masses, finds the largest threshold t at which the candidates >= t number at least
    k = cap - #forced or (MASS: topp) bring the mass to the target; that t is a candidate's mass.
    The search keeps [lo, hi) with lo passing (or 0: every candidate) and hi failing, and the counts
    of candidates >= lo and >= hi. Each round tests WAYS thresholds spread over (lo, hi) with one 2-D
    compare and reduction; it stops once at most one candidate lies in [lo, hi) (then t is that
    candidate, or lo): random masses take ~7 rounds of 4 ways or ~11 of 2 ways, where a search down to
    one bit pattern takes 16 or 31.
    Candidates above t, then ties at t, fill the list after the forced blocks, in block order.
    Only B x Hkv programs, one row of masses each, so every pass over the row counts: one 2-D softmax
    (HEADS rows at a time), forced blocks ranked in closed form, one packed scan for the chosen ones.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)  # step inputs and this kernel's own counter: before pdl_wait
    slot = tl.load(slots_ptr + b).to(tl.int64)
    selects = (seq_len > 0) & (slot >= 0)  # slot -1: no selection this step (sparse_lag)
    if REUSE > 1:
        step = tl.load(counter_ptr + slot * stride_cs + kvh, mask=selects, other=0)
    pdl_wait(PDL)
    if not selects:
        return
    if REUSE > 1:
        tl.store(counter_ptr + slot * stride_cs + kvh, step + 1)  # after the wait: scoring reads it
        if step % REUSE != 0:
            return
    nb = tl.cdiv(seq_len, BLOCK_SIZE)
    j = tl.arange(0, NB_PAD)
    valid = j < nb
    # Forced blocks are [0, sink_end) and [local_start, nb): ranked in closed form, no scan needed.
    all_forced = (nb <= CAP) & SHORT_DENSE
    sink_end = tl.where(all_forced, nb, tl.minimum(nb, SINK))
    local_start = tl.maximum(nb - LOCAL, sink_end)
    forced = valid & ((j < sink_end) | (j >= local_start))
    n_forced = sink_end + nb - local_start
    chosen_hi = j < 0  # all false
    chosen_eq = j < 0
    if (nb > CAP) | (not SHORT_DENSE):
        # Estimated mass: mean over the group's query heads of each head's softmax over the blocks,
        # HEADS rows of scores at a time ([HEADS, NB_PAD]: two reductions for all of them).
        r = tl.zeros([NB_PAD], tl.float32)
        h = tl.arange(0, HEADS)
        for g0 in tl.static_range(0, GROUP, HEADS):
            live = g0 + h < GROUP
            row = (b * tl.num_programs(1) * GROUP + kvh * GROUP + g0 + h).to(tl.int64) * max_blocks
            s = tl.load(scores_ptr + row[:, None] + j[None, :], mask=live[:, None] & valid[None, :],
                        other=float("-inf"))
            e = tl.exp(s - tl.where(live, tl.max(s, 1), 0.0)[:, None])  # rows past the group: exp(-inf) = 0
            r += tl.sum(e / tl.where(live, tl.sum(e, 1), 1.0)[:, None], 0)
        r = r / GROUP
        cand = valid & (forced == 0) & (tl.load(streaming_ptr + kvh) == 0)
        bits = tl.where(cand, r.to(tl.int32, bitcast=True), -1)  # non-candidates below every threshold
        k = CAP - n_forced
        top_ok = k <= 0  # does t above every candidate pass? then nothing is chosen
        if MASS:
            fmass = tl.sum(tl.where(forced, r, 0.0), 0)
            top_ok = top_ok | (fmass >= mass_target)
        hi = tl.max(bits, 0) + 1
        lo = tl.where(top_ok, hi, 0)
        c_lo = tl.where(top_ok, 0, tl.sum(cand.to(tl.int32), 0))  # candidates >= lo, and >= hi
        c_hi = c_lo * 0
        w = tl.arange(0, WAYS)
        bits2 = bits[None, :]
        if MASS:
            r2 = r[None, :]
        while (c_lo - c_hi > 1) & (hi - lo > 1):
            gap = tl.cdiv(hi - lo, WAYS + 1)
            th = lo + (w + 1) * gap
            inside = th < hi
            ge = bits2 >= th[:, None]  # [WAYS, NB_PAD]
            cnt = tl.sum(ge.to(tl.int32), 1)
            ok = cnt >= k
            if MASS:
                ok = ok | (fmass + tl.sum(tl.where(ge, r2, 0.0), 1) >= mass_target)
            ok = ok & inside  # monotone in t: the passing thresholds are a prefix
            fail = inside & (ok == 0)
            n_ok = tl.sum(ok.to(tl.int32), 0)
            c_lo = tl.min(tl.where(ok, cnt, c_lo), 0)
            c_hi = tl.max(tl.where(fail, cnt, c_hi), 0)
            hi = tl.minimum(lo + (n_ok + 1) * gap, hi)
            lo = lo + n_ok * gap
        # At most one candidate in [lo, hi) (or hi = lo + 1): t is it, or lo.
        t = tl.maximum(lo, tl.max(tl.where(bits < hi, bits, -1), 0))
        chosen_hi = bits > t
        chosen_eq = cand & (bits == t)
    # One scan ranks both chosen sets: chosen_hi counts in the low 16 bits, chosen_eq in the high ones
    # (NB_PAD <= MAX_SELECT_BLOCKS < 2**15).
    packed = chosen_hi.to(tl.int32) + chosen_eq.to(tl.int32) * 65536
    rank = tl.cumsum(packed, 0)
    total = tl.sum(packed, 0)
    n_hi = total & 0xFFFF
    pos = tl.where(forced, tl.where(j < sink_end, j, sink_end + j - local_start),
                   tl.where(chosen_hi, n_forced + (rank & 0xFFFF) - 1, n_forced + n_hi + (rank >> 16) - 1))
    keep = ((forced.to(tl.int32) + packed) != 0) & (pos < CAP)
    count = tl.minimum(n_forced + n_hi + (total >> 16), CAP)
    row = sel_ptr + slot * stride_ss + kvh * CAP
    tl.store(row + pos, j, mask=keep)
    tl.store(row + j, tl.full([NB_PAD], -1, tl.int32), mask=(j >= count) & (j < CAP))
    tl.atomic_add(stats_ptr, count.to(tl.int64))
    tl.atomic_add(stats_ptr + 1, 1)


def block_scores(q: torch.Tensor, key_meta: KeyMeta, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 slots: torch.Tensor, counter: torch.Tensor, p: SelectionParams, max_blocks: int,
                 scale: float, config: ScoreConfig | None = None) -> torch.Tensor:
    """float32 [B, Hq, max_blocks] (Triton twin of block_scores_ref), written only where selection
    reads it: rows with more than cap blocks that recompute this step, blocks inside the context."""
    batch, num_q_heads, head_dim = q.shape
    codes, page_scale = key_meta.codes, key_meta.scale
    _, hkv, _, pages, _ = codes.shape
    assert counter.stride(1) == 1 and codes.stride(-1) == 1 and codes.stride(-2) == head_dim
    assert page_scale.stride(-1) == 1
    scores = torch.empty(batch, num_q_heads, max_blocks, dtype=torch.float32, device=q.device)
    config = config or ScoreConfig()
    block_n = max(1, config.rows // pages)
    per_split = block_n * max(1, min(config.tiles, triton.cdiv(max_blocks, block_n)))
    group = num_q_heads // hkv
    pdl = use_pdl(q.device)
    _score_kernel[(batch, hkv, triton.cdiv(max_blocks, per_split))](
        q, codes, page_scale, block_tables, seq_lens, slots, counter, scores, scale,
        q.stride(0), q.stride(1), codes.stride(0), codes.stride(1), codes.stride(2),
        page_scale.stride(0), page_scale.stride(1), block_tables.stride(0), counter.stride(0), max_blocks, per_split,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=p.block_size, PAGES=pages, CAP=p.cap, REUSE=p.reuse,
        SHORT_DENSE=p.short_dense, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_STAGES=config.num_stages, num_warps=config.num_warps, PDL=pdl, launch_pdl=pdl)
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
    pdl = use_pdl(scores.device)
    _select_kernel[(batch, hkv)](
        scores, seq_lens, slots, sel, counter, stats, streaming.view(torch.uint8), p.mass_target, max_blocks,
        sel.stride(0), counter.stride(0),
        GROUP=num_q_heads // hkv, BLOCK_SIZE=p.block_size, CAP=p.cap, SINK=p.sink, LOCAL=p.local,
        REUSE=p.reuse, SHORT_DENSE=p.short_dense, MASS=p.policy == "topp", WAYS=config.ways, NB_PAD=nb_pad,
        HEADS=min(triton.next_power_of_2(num_q_heads // hkv), max(1, 16384 // nb_pad)),
        num_warps=config.num_warps or min(16, max(4, nb_pad // 512)), PDL=pdl, launch_pdl=pdl)


def score_and_select(q: torch.Tensor, key_meta: KeyMeta, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     slots: torch.Tensor, sel: torch.Tensor, counter: torch.Tensor, stats: torch.Tensor,
                     streaming: torch.Tensor, p: SelectionParams, max_blocks: int, scale: float) -> None:
    """Scores then selects for the decode rows q [B, Hq, D]; max_blocks: host-side bound of the context."""
    if q.shape[0] == 0:
        return
    scores = block_scores(q, key_meta, block_tables, seq_lens, slots, counter, p, max_blocks, scale)
    select_blocks(scores, seq_lens, slots, sel, counter, stats, streaming, p)


@triton.jit
def _step_slots_kernel(seq_lens_ptr, slots_ptr, read_ptr, write_ptr, batch, num_decodes, reuse, num_slots,
                       BLOCK: tl.constexpr):
    """sparse_lag=1: the selection-buffer rows each sequence reads and writes this step (step_slots_ref)."""
    i = tl.arange(0, BLOCK)
    m = i < batch
    s = tl.load(seq_lens_ptr + i, mask=m, other=0)
    x = tl.load(slots_ptr + i, mask=m, other=0)
    prev = tl.where(s > 0, (s - 1) // reuse, -1)  # floor((s - 1) / R); integer division truncates
    tl.store(read_ptr + i, x + num_slots * ((prev + 1) % 2), mask=m)
    due = (s > 0) & ((i >= num_decodes) | (s % reuse == 0))
    tl.store(write_ptr + i, tl.where(due, x + num_slots * ((s // reuse + 1) % 2), -1), mask=m)


def step_slots(seq_lens: torch.Tensor, slots: torch.Tensor, num_decodes: int, reuse: int, num_slots: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of step_slots_ref: (read, write) int32 [B], one launch a step."""
    batch = seq_lens.numel()
    read = torch.empty(batch, dtype=torch.int32, device=seq_lens.device)
    write = torch.empty_like(read)
    if batch:
        _step_slots_kernel[(1,)](seq_lens, slots, read, write, batch, num_decodes, reuse, num_slots,
                                 BLOCK=max(16, triton.next_power_of_2(batch)), num_warps=1)
    return read, write
