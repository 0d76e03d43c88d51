"""SALE's selection pass: which (query tile, key tile) pairs of a prefill chunk sparse_prefill
computes.

1. Quantization (_sum_kernel's means, then _quant_kernel). Q~ = q - mean_q (over the chunk's
   queries, per query head), K~ = k - mean_k (over the context, per KV head), rows in fp8 e4m3:
   a query row at absmax / 448; a key row at its own power-of-two scale, re-expressed at its key
   group's largest (KEY_GROUP_TILES tiles share s_k[g(j)]). The estimate
       est_ij = s_q[i] s_k[g(j)] (q_code[i] . k_code[j]) + qmk[h(i), j],  qmk = mean_q[h] . K~_j
   equals q_i . k_j up to terms constant along row i.
2. Selection (_select_kernel, program (sequence, query tile, KV head)): per query row i, with
   z = est * scale * log2(e), m_i and l_i are the max and sum of 2^(z - m_i) over the forced
   tiles (causal); element (i, j) is important when z_ij > m_i + log2(l_i) + log2(threshold[h])
   (SALE's relative score, without exp). A middle tile is kept when any element of any query
   head of the group is; threshold 0 keeps every tile, a streaming KV head none.
Outputs: mask uint8 [B, Hkv, n_q_tiles, n_k_tiles] (1: computed, forced included); the middle
tiles as kv_index int32 [same] and kv_count int32 [B, Hkv, n_q_tiles]. References:
quantize_qk_ref, select_tiles_ref. No host sync: grids follow host-side bounds; thresholds and
streaming flags are device tensors. Why fp8 and group scales: docs/sparse_prefill.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from sparseserve.kernels.dispatch import tl, triton, use_triton
from sparseserve.kernels.paged_decode import LOG2E
from sparseserve.kernels.sparse_prefill import TileLayout, tile_classes

FP8_MAX = 448.0  # the largest finite e4m3 value
KEY_GROUP_TILES = 2  # key tiles sharing one power-of-two scale (the selection's key chunk)
KEY_EXP_NONE = -(1 << 20)  # the exponent of a zero row: never a group's largest
_SCORE_ELEMENTS = 1 << 25


class QKCodes(NamedTuple):
    """Quantized Q and K of a batch of chunks; L = n_k_tiles * k_tile (past seq_len: code 0,
    scale 1)."""

    q_code: torch.Tensor  # float8_e4m3fn [T, Hq, D]
    q_scale: torch.Tensor  # float32 [T, Hq]
    k_code: torch.Tensor  # float8_e4m3fn [B, Hkv, L, D]
    k_scale: torch.Tensor  # float32 [B, Hkv, L]
    qmk: torch.Tensor  # float32 [B, Hq, L]: mean_q[h] . K~_j


def _gather_keys(kv_cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """float32 [B, Hkv, length, D]: each sequence's first `length` keys (garbage past its end);
    the table may cover fewer positions (max_seq_len, not whole key tiles)."""
    block_size = kv_cache.shape[3]
    nblk = min(-(-length // block_size), block_tables.shape[1])
    k = kv_cache[block_tables[:, :nblk].long(), :, 0].float()  # [B, nblk, Hkv, bs, D]
    b, _, hkv, _, d = k.shape
    k = k.permute(0, 2, 1, 3, 4).reshape(b, hkv, nblk * block_size, d)
    return torch.nn.functional.pad(k, (0, 0, 0, max(length - nblk * block_size, 0)))[:, :, :length]


def _quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (last dim) absmax scaling to e4m3, the kernel's arithmetic: (codes, scales)."""
    absmax = x.abs().amax(-1)
    inv = torch.where(absmax > 0, FP8_MAX / absmax.where(absmax > 0, 1.0), 0.0)
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    return (x * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def pow2_exponent_ref(absmax: torch.Tensor) -> torch.Tensor:
    """int32: the smallest e with absmax / 2^e <= 448 (absmax = m 2^p, m in [1, 2): e = p - 8
    when m <= 1.75, else p - 7, as the kernel's bit arithmetic); a zero row: KEY_EXP_NONE."""
    f, q = torch.frexp(absmax)  # absmax = f 2^q, f in [0.5, 1)
    e = torch.where(2 * f <= 1.75, q - 9, q - 8).to(torch.int32)
    return torch.where(absmax > 0, e, KEY_EXP_NONE)


def quantize_keys_ref(kt: torch.Tensor, valid: torch.Tensor, group_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K~ [B, Hkv, L, D] (zero past the end; valid [B, L]) -> (codes, scales): each row at its
    own power-of-two scale, then at its group's largest (exact, except below e4m3's normals)."""
    b, h, length, d = kt.shape
    e = pow2_exponent_ref(kt.abs().amax(-1))  # [B, Hkv, L]
    tok = (kt * torch.ldexp(torch.ones_like(kt), -e.clamp_min(-126)[..., None])).to(torch.float8_e4m3fn)
    pad = -length % group_rows
    eg = torch.nn.functional.pad(e, (0, pad), value=KEY_EXP_NONE).view(b, h, -1, group_rows).amax(-1)
    eg = torch.where(eg == KEY_EXP_NONE, 0, eg).repeat_interleave(group_rows, -1)[..., :length]
    shift = torch.ldexp(torch.ones_like(kt), (e - eg).clamp(-30, 0)[..., None])
    code = (tok.float() * shift).to(torch.float8_e4m3fn)
    scale = torch.where(valid[:, None, :], torch.ldexp(torch.ones_like(eg, dtype=torch.float32), eg), 1.0)
    return torch.where(valid[:, None, :, None], code.float(), 0.0).to(torch.float8_e4m3fn), scale


def _means_ref(q, keys, seq_lens, query_start_loc, length):
    """(mean_q [B, Hq, D], mean_k [B, Hkv, D]) in float32; an empty range has mean 0."""
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    batch = q_lens.numel()
    seq_idx = torch.repeat_interleave(torch.arange(batch, device=q.device), q_lens, output_size=q.shape[0])
    mean_q = torch.zeros(batch, q.shape[1], q.shape[2], dtype=torch.float32, device=q.device)
    mean_q.index_add_(0, seq_idx, q.float())
    mean_q /= q_lens.clamp_min(1)[:, None, None]
    valid = torch.arange(length, device=q.device)[None, :] < seq_lens.long()[:, None]  # [B, L]
    mean_k = torch.where(valid[:, None, :, None], keys, 0.0).sum(2) / seq_lens.long().clamp_min(1)[:, None, None]
    return mean_q, mean_k


def quantize_qk_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_seq_len: int,
    layout: TileLayout,
) -> QKCodes:
    """Stage 1 in torch (module docstring)."""
    num_q_heads = q.shape[1]
    num_kv_heads = kv_cache.shape[1]
    group = num_q_heads // num_kv_heads
    length = layout.num_k_tiles(max_seq_len) * layout.k_tile
    keys = _gather_keys(kv_cache, block_tables, length)
    mean_q, mean_k = _means_ref(q, keys, seq_lens, query_start_loc, length)
    qsl = query_start_loc.long()
    seq_idx = torch.repeat_interleave(
        torch.arange(seq_lens.numel(), device=q.device), qsl[1:] - qsl[:-1], output_size=q.shape[0]
    )
    q_code, q_scale = _quantize_rows_ref(q.float() - mean_q[seq_idx])
    valid = torch.arange(length, device=q.device)[None, :] < seq_lens.long()[:, None]
    kt = torch.where(valid[:, None, :, None], keys - mean_k[:, :, None], 0.0)  # K~, 0 past the end
    k_code, k_scale = quantize_keys_ref(kt, valid, KEY_GROUP_TILES * layout.k_tile)
    qmk = torch.einsum("bhgd,bhjd->bhgj", mean_q.view(-1, num_kv_heads, group, q.shape[2]), kt)
    return QKCodes(q_code, q_scale, k_code, k_scale, qmk.reshape(-1, num_q_heads, length))


def select_tiles_ref(
    codes: QKCodes,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    layout: TileLayout,
    thresholds: torch.Tensor,
    streaming: torch.Tensor | None = None,
    with_margin: bool = False,
):
    """Stage 2 in torch: (mask, kv_index, kv_count); with_margin also float32 [B, Hkv, n_q_tiles,
    n_k_tiles], each middle tile's max (est - T) * scale * log2(e) (> 0: kept; -inf: not
    estimated), so tests see how far each decision is from its boundary."""
    q_code, q_scale, k_code, k_scale, qmk = codes
    num_q_heads = q_code.shape[1]
    batch, num_kv_heads, length, _ = k_code.shape
    group = num_q_heads // num_kv_heads
    n_qt, n_kt = layout.num_q_tiles(max_query_len), layout.num_k_tiles(max_seq_len)
    dev = q_code.device
    forced, middle = tile_classes(seq_lens, query_start_loc, n_qt, n_kt, layout)
    margin = torch.full((batch, num_kv_heads, n_qt, n_kt), float("-inf"), device=dev)
    c = scale * LOG2E
    log2_thr = torch.log2(thresholds.float().clamp_min(0)).to(dev)
    qsl = query_start_loc.long().tolist()
    lens = seq_lens.long().tolist()
    keys = torch.arange(length, device=dev)
    ktile = keys // layout.k_tile
    k_code_f = k_code.float()
    # Query rows a step (whole tiles), bounding the float32 estimates [Hq, rows, L].
    step = max(1, _SCORE_ELEMENTS // (num_q_heads * length * layout.q_tile)) * layout.q_tile
    for b in range(batch):
        for r0 in range(0, qsl[b + 1] - qsl[b], step):
            rows = torch.arange(r0, min(r0 + step, qsl[b + 1] - qsl[b]), device=dev)
            toks = qsl[b] + rows
            qtile = rows // layout.q_tile
            pos = lens[b] - (qsl[b + 1] - qsl[b]) + rows
            s = torch.einsum(
                "thgd,hjd->hgtj", q_code[toks].float().view(-1, num_kv_heads, group, q_code.shape[2]), k_code_f[b]
            )  # [Hkv, G, rows, L]
            sq = q_scale[toks].T.reshape(num_kv_heads, group, -1, 1)
            # the kernel's order of operations
            est = s * k_scale[b][:, None, None, :] * sq + qmk[b].view(num_kv_heads, group, 1, length)
            z = est * c
            ref = forced[b][qtile][:, ktile] & (keys[None, :] <= pos[:, None])  # [rows, L]
            zr = z.masked_fill(~ref, float("-inf"))
            m = zr.amax(-1, keepdim=True)
            lse2 = m + torch.log2(torch.exp2(zr - m).sum(-1, keepdim=True))
            t_raw = (lse2 + log2_thr.view(num_kv_heads, group, 1, 1)) / c
            over = ((est - t_raw) * c).masked_fill(~middle[b][qtile][:, ktile], float("-inf"))
            # [Hkv, rows, n_kt]
            over = over.amax(1).view(num_kv_heads, -1, n_kt, layout.k_tile).amax(-1)
            margin[b].scatter_reduce_(1, qtile[None, :, None].expand_as(over), over, "amax")
    if streaming is not None:
        margin.masked_fill_(streaming.to(device=dev, dtype=torch.bool)[None, :, None, None], float("-inf"))
    keep = middle[:, None] & (margin > 0)
    mask = (forced[:, None] | keep).to(torch.uint8)
    count = keep.sum(-1, dtype=torch.int32)
    index = torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    return (mask, index, count, margin) if with_margin else (mask, index, count)


@triton.jit
def _round_e4m3(x):
    """x (float32) rounded to the nearest e4m3 value (ties to even), saturating at +-448, so the
    cast to fp8 is exact whatever rounding it does (codes equal torch's float8_e4m3fn cast)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    # Normal range: keep 3 mantissa bits, round half to even on the dropped 20.
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    # Subnormal range (|x| < 2^-6): multiples of 2^-9; adding 1.5 * 2^14 (ulp 2^-9) rounds to them.
    return tl.where(tl.abs(x) < 0.015625, (x + 24576.0) - 24576.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def _pow2(n):
    """2.0 ** n (float32, exact) for int32 n in [-126, 127]."""
    return ((n + 127) << 23).to(tl.float32, bitcast=True)


# Nothing step-shaped is specialized on (docs/architecture.md, "kernels/").
@triton.jit(
    do_not_specialize=["split_len", "stride_tb"],
    do_not_specialize_on_alignment=["table_ptr", "seq_lens_ptr", "qsl_ptr"],
)
def _sum_kernel(
    x_ptr,
    table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    part_ptr,
    split_len,
    stride_xt,
    stride_xh,
    stride_cb,
    stride_ch,
    stride_tb,
    PAGED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOK: tl.constexpr,
):
    """part[b, h, split] = sum of head h's rows in the split's range: sequence b's chunk queries
    (q), or, PAGED, the context's keys (through the block table)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    if PAGED:
        n = tl.load(seq_lens_ptr + b)
    else:
        q_start = tl.load(qsl_ptr + b)
        n = tl.load(qsl_ptr + b + 1) - q_start
    start = split * split_len
    end = tl.minimum(start + split_len, n)
    rows = tl.arange(0, TOK)
    dims = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for r0 in range(start, end, TOK):
        r = r0 + rows
        m = (r < end)[:, None] & (dims < HEAD_DIM)[None, :]
        if PAGED:
            blk = tl.load(table_ptr + b.to(tl.int64) * stride_tb + r // BLOCK_SIZE, mask=r < end, other=0)
            ptrs = x_ptr + (blk.to(tl.int64) * stride_cb + h * stride_ch + (r % BLOCK_SIZE) * HEAD_DIM)[:, None]
        else:
            ptrs = x_ptr + ((q_start + r).to(tl.int64) * stride_xt + h * stride_xh)[:, None]
        acc += tl.sum(tl.load(ptrs + dims[None, :], mask=m, other=0.0).to(tl.float32), 0)
    row = (b * tl.num_programs(1) + h) * tl.num_programs(2) + split
    tl.store(part_ptr + row.to(tl.int64) * BLOCK_D + dims, acc)


@triton.jit(do_not_specialize=["stride_tb"], do_not_specialize_on_alignment=["table_ptr", "seq_lens_ptr", "qsl_ptr"])
def _quant_kernel(
    x_ptr,
    table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    mean_ptr,
    mean_q_ptr,
    code_ptr,
    scale_ptr,
    qmk_ptr,
    length,
    stride_xt,
    stride_xh,
    stride_cb,
    stride_ch,
    stride_tb,
    stride_oa,
    stride_ob,
    stride_st,
    stride_sh,
    stride_mb,
    stride_mh,
    stride_qmb,
    stride_qmh,
    PAGED: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOK: tl.constexpr,
):
    """Quantizes TOK rows of head h (stage 1; reference: quantize_qk_ref).

    Not PAGED: sequence b's chunk queries -> code [T, Hq, D], scale [T, Hq].
    PAGED: sequence b's context positions (all < L; past seq_len: code 0, scale 1, qmk 0)
    -> code [B, Hkv, L, D], scale [B, Hkv, L], qmk [B, Hq, L] for the GROUP heads of h."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.program_id(2) * TOK + tl.arange(0, TOK)
    dims = tl.arange(0, BLOCK_D)
    dmask = (dims < HEAD_DIM)[None, :]
    mean = tl.load(mean_ptr + b * stride_mb + h * stride_mh + dims, mask=dims < HEAD_DIM, other=0.0)
    if PAGED:
        ok = r < tl.load(seq_lens_ptr + b)
        blk = tl.load(table_ptr + b.to(tl.int64) * stride_tb + r // BLOCK_SIZE, mask=ok, other=0)
        ptrs = x_ptr + (blk.to(tl.int64) * stride_cb + h * stride_ch + (r % BLOCK_SIZE) * HEAD_DIM)[:, None]
        out_row = (b * tl.num_programs(1) + h).to(tl.int64) * stride_oa + r.to(tl.int64) * stride_ob
        s_row = b.to(tl.int64) * stride_st + h * stride_sh + r
        w_mask = r < length  # every position of L is written
    else:
        q_start = tl.load(qsl_ptr + b)
        ok = r < tl.load(qsl_ptr + b + 1) - q_start
        tok = (q_start + r).to(tl.int64)
        ptrs = x_ptr + (tok * stride_xt + h * stride_xh)[:, None]
        out_row = tok * stride_oa + h * stride_ob
        s_row = tok * stride_st + h * stride_sh
        w_mask = ok
    x = tl.load(ptrs + dims[None, :], mask=ok[:, None] & dmask, other=0.0).to(tl.float32)
    x = tl.where(ok[:, None] & dmask, x - mean[None, :], 0.0)
    absmax = tl.max(tl.abs(x), 1)
    if PAGED:  # TOK rows = one key group: power-of-two scales, the group's largest
        bits = absmax.to(tl.int32, bitcast=True)
        p = ((bits >> 23) & 0xFF) - 127
        e = tl.where(absmax > 0, tl.where((bits & 0x7FFFFF) <= 0x600000, p - 8, p - 7), -1048576)
        e_group = tl.max(e, 0)
        e_group = tl.where(e_group == -1048576, 0, e_group)
        code = _round_e4m3(x * _pow2(-tl.maximum(e, -126))[:, None])
        code = _round_e4m3(code * _pow2(tl.maximum(e - e_group, -30))[:, None]).to(code_ptr.dtype.element_ty)
        scale = tl.where(ok, _pow2(e_group + tl.zeros_like(e)), 1.0)
    else:
        inv = tl.where(absmax > 0, 448.0 / tl.where(absmax > 0, absmax, 1.0), 0.0)
        scale = tl.where(absmax > 0, absmax / 448.0, 1.0)
        code = _round_e4m3(x * inv[:, None]).to(code_ptr.dtype.element_ty)
    tl.store(code_ptr + out_row[:, None] + dims[None, :], code, mask=w_mask[:, None] & dmask)
    tl.store(scale_ptr + s_row, scale, mask=w_mask)
    if PAGED:
        for g in tl.static_range(GROUP):
            hq = h * GROUP + g
            # mean_q: [B, Hq, BLOCK_D]
            mq = tl.load(mean_q_ptr + (b * tl.num_programs(1) * GROUP + hq) * BLOCK_D + dims)
            tl.store(
                qmk_ptr + b.to(tl.int64) * stride_qmb + hq * stride_qmh + r, tl.sum(x * mq[None, :], 1), mask=w_mask
            )


@triton.jit
def _split_tiles(x, Q_TILE: tl.constexpr, K_TILE: tl.constexpr, CHUNK: tl.constexpr):
    """[Q_TILE, CHUNK * K_TILE], column c = key c // CHUNK of tile c % CHUNK -> CHUNK (1 or 2)
    [Q_TILE, K_TILE]."""
    if CHUNK == 1:
        return (x,)
    else:
        return tl.split(tl.reshape(x, [Q_TILE, K_TILE, 2]))


@triton.jit(
    do_not_specialize=["num_q_tiles", "stride_mb", "stride_mh", "stride_mt", "stride_nb", "stride_nh"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "qsl_ptr", "stream_ptr"],
)
def _select_kernel(
    q_code_ptr,
    q_scale_ptr,
    k_code_ptr,
    k_scale_ptr,
    qmk_ptr,
    seq_lens_ptr,
    qsl_ptr,
    log2_thr_ptr,
    stream_ptr,
    mask_ptr,
    idx_ptr,
    cnt_ptr,
    c_log2,
    num_q_tiles,
    stride_qct,
    stride_qch,
    stride_qst,
    stride_qsh,
    stride_kcb,
    stride_kch,
    stride_ksb,
    stride_ksh,
    stride_qmb,
    stride_qmh,
    stride_mb,
    stride_mh,
    stride_mt,
    stride_nb,
    stride_nh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    Q_TILE: tl.constexpr,
    K_TILE: tl.constexpr,
    SINK: tl.constexpr,
    LOCAL: tl.constexpr,
    CHUNK: tl.constexpr,
    STREAMING: tl.constexpr,
):
    """Program (sequence, query tile, KV head): the tile's mask row and middle-tile list
    (reference: select_tiles_ref). The group's heads run in a static loop, each one
    [Q_TILE, CHUNK * K_TILE] dot against the CHUNK key tiles loaded once."""
    b = tl.program_id(0)
    t = num_q_tiles - 1 - tl.program_id(1)  # the last (heaviest) query tiles first
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if t * Q_TILE >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_start = seq_len - q_len
    p0 = ctx_start + t * Q_TILE
    last = (tl.minimum(p0 + Q_TILE, seq_len) - 1) // K_TILE
    lo = tl.maximum(p0 // K_TILE - LOCAL, 0)
    s_end = tl.minimum(lo, SINK)
    mrow = b.to(tl.int64) * stride_mb + kvh * stride_mh + t * stride_mt  # mask, index: same layout
    jv = tl.arange(0, CHUNK)
    ones = tl.full([CHUNK], 1, tl.uint8)
    for j0 in range(0, s_end, CHUNK):
        tl.store(mask_ptr + mrow + j0 + jv, ones, mask=j0 + jv < s_end)
    for j0 in range(lo, last + 1, CHUNK):
        tl.store(mask_ptr + mrow + j0 + jv, ones, mask=j0 + jv <= last)

    count = tl.zeros([], tl.int32)
    active = lo > s_end  # the tile has middle tiles
    if STREAMING:
        active = active & (tl.load(stream_ptr + kvh) == 0)
    if active:
        keep_all = False
        for g in tl.static_range(GROUP):
            keep_all = keep_all | (tl.load(log2_thr_ptr + kvh * GROUP + g) == float("-inf"))
        if keep_all:  # threshold 0 for a head of the group: every middle tile, no estimate
            for j0 in range(s_end, lo, CHUNK):
                j = j0 + jv
                tl.store(mask_ptr + mrow + j, ones, mask=j < lo)
                tl.store(idx_ptr + mrow + j - s_end, j, mask=j < lo)
            count = lo - s_end
        else:
            qi = t * Q_TILE + tl.arange(0, Q_TILE)
            row_ok = qi < q_len
            pos = ctx_start + qi
            tok = (q_start + qi).to(tl.int64)
            dims = tl.arange(0, BLOCK_D)
            dmask = (dims < HEAD_DIM)[None, :]
            kk = tl.arange(0, K_TILE)
            k_base = k_code_ptr + b.to(tl.int64) * stride_kcb + kvh * stride_kch
            ks_base = k_scale_ptr + b.to(tl.int64) * stride_ksb + kvh * stride_ksh
            qm_base = qmk_ptr + b.to(tl.int64) * stride_qmb + kvh * GROUP * stride_qmh
            codes = ()
            scales = ()
            for g in tl.static_range(GROUP):
                h = kvh * GROUP + g
                codes = codes + (
                    tl.load(
                        q_code_ptr + (tok * stride_qct + h * stride_qch)[:, None] + dims[None, :],
                        mask=row_ok[:, None] & dmask,
                        other=0.0,
                    ),
                )
                scales = scales + (tl.load(q_scale_ptr + tok * stride_qst + h * stride_qsh, mask=row_ok, other=0.0),)
            # Reference statistics over the forced tiles: [0, s_end) then [lo, last].
            ms = ()
            ls = ()
            for g in tl.static_range(GROUP):
                ms = ms + (tl.full([Q_TILE], float("-inf"), tl.float32),)
                ls = ls + (tl.zeros([Q_TILE], tl.float32),)
            for i in range(s_end + last + 1 - lo):
                j = tl.where(i < s_end, i, lo + i - s_end)
                keys = j * K_TILE + kk
                k = tl.load(k_base + (keys * HEAD_DIM)[:, None] + dims[None, :], mask=dmask, other=0.0)
                ksc = tl.load(ks_base + keys)
                vis = (keys[None, :] <= pos[:, None]) & row_ok[:, None]
                new_ms = ()
                new_ls = ()
                for g in tl.static_range(GROUP):
                    qmk = tl.load(qm_base + g * stride_qmh + keys)
                    s = tl.dot(codes[g], tl.trans(k))
                    z = tl.where(vis, (s * ksc[None, :] * scales[g][:, None] + qmk[None, :]) * c_log2, float("-inf"))
                    m_new = tl.maximum(ms[g], tl.max(z, 1))
                    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                    new_ls = new_ls + (ls[g] * tl.exp2(ms[g] - m_shift) + tl.sum(tl.exp2(z - m_shift[:, None]), 1),)
                    new_ms = new_ms + (m_new,)
                ms = new_ms
                ls = new_ls
            t_raw = ()
            for g in tl.static_range(GROUP):
                lse2 = ms[g] + tl.log2(tl.where(ls[g] > 0, ls[g], 1.0))
                thr = tl.load(log2_thr_ptr + kvh * GROUP + g)
                t_raw = t_raw + (tl.where(row_ok, (lse2 + thr) / c_log2, float("inf")),)
            # Middle tiles, CHUNK a step, one dot per head: row r of the key block is key
            # r // CHUNK of tile j0 + r % CHUNK, so the tiles split off the lowest column bits.
            rr = tl.arange(0, CHUNK * K_TILE)
            r_tile = rr % CHUNK
            r_key = rr // CHUNK
            # Whole key groups a step (one scale: est = fma(dot, row x group scale, qmk)); a first
            # group starting before s_end masks its sink tiles out.
            for j0 in range(s_end - s_end % CHUNK, lo, CHUNK):
                keys = (j0 + r_tile) * K_TILE + r_key
                in_range = (j0 + r_tile >= s_end) & (j0 + r_tile < lo)
                k = tl.load(
                    k_base + (keys * HEAD_DIM)[:, None] + dims[None, :], mask=in_range[:, None] & dmask, other=0.0
                )
                k_group_scale = tl.load(ks_base + j0 * K_TILE)
                row_hits = ()
                for cc in tl.static_range(CHUNK):
                    row_hits = row_hits + (tl.zeros([Q_TILE], tl.int32),)
                for g in tl.static_range(GROUP):
                    qmk = tl.load(qm_base + g * stride_qmh + keys, mask=in_range, other=float("-inf"))
                    est = tl.dot(codes[g], tl.trans(k)) * (scales[g] * k_group_scale)[:, None] + qmk[None, :]
                    tiles = _split_tiles(est, Q_TILE, K_TILE, CHUNK)
                    new_hits = ()
                    for cc in tl.static_range(CHUNK):
                        new_hits = new_hits + (row_hits[cc] | (tl.max(tiles[cc], 1) > t_raw[g]).to(tl.int32),)
                    row_hits = new_hits
                hits = tl.zeros([Q_TILE, CHUNK], tl.int32)
                for cc in tl.static_range(CHUNK):
                    hits = hits | tl.where(jv[None, :] == cc, row_hits[cc][:, None], 0)
                j = j0 + jv
                middle = (j >= s_end) & (j < lo)
                keep = (tl.max(hits, 0) > 0) & middle
                tl.store(mask_ptr + mrow + j, keep.to(tl.uint8), mask=middle)
                slot = count + tl.cumsum(keep.to(tl.int32), 0) - 1
                tl.store(idx_ptr + mrow + slot, j, mask=keep)
                count += tl.sum(keep.to(tl.int32), 0)
    tl.store(cnt_ptr + b.to(tl.int64) * stride_nb + kvh * stride_nh + t, count)


@dataclass(frozen=True)
class TileSelectConfig:
    """Launch shapes. `chunk` key tiles (dividing a key group) are one dot per query head;
    `max_registers` caps registers a thread (None: the compiler's choice); `quant_tok`: rows a
    query quantization program. Defaults: docs/sparse_prefill.md, "The kernels"."""

    chunk: int = 2
    num_warps: int = 4
    num_stages: int = 2
    max_registers: int | None = 128
    quant_tok: int = 32  # rows a quantization program

    def __post_init__(self) -> None:
        if KEY_GROUP_TILES % self.chunk:
            raise ValueError(f"chunk must divide the key group's {KEY_GROUP_TILES} tiles, got {self.chunk}")


def _empty_codes(q, num_seqs, num_kv_heads, length) -> QKCodes:
    dev, (t, hq, d) = q.device, q.shape
    return QKCodes(
        torch.empty(t, hq, d, dtype=torch.float8_e4m3fn, device=dev),
        torch.empty(t, hq, dtype=torch.float32, device=dev),
        torch.empty(num_seqs, num_kv_heads, length, d, dtype=torch.float8_e4m3fn, device=dev),
        torch.empty(num_seqs, num_kv_heads, length, dtype=torch.float32, device=dev),
        torch.empty(num_seqs, hq, length, dtype=torch.float32, device=dev),
    )


def quantize_qk_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    layout: TileLayout,
    config: TileSelectConfig | None = None,
) -> QKCodes:
    """Stage 1 with Triton: two _sum_kernel launches (partial sums), two _quant_kernel."""
    config = config or TileSelectConfig()
    num_seqs = seq_lens.numel()
    num_q_heads, head_dim = q.shape[1:]
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    length = layout.num_k_tiles(max_seq_len) * layout.k_tile
    codes = _empty_codes(q, num_seqs, num_kv_heads, length)
    if num_seqs == 0 or max_query_len == 0:
        return codes
    assert kv_cache.stride(4) == 1 and kv_cache.stride(3) == head_dim and q.stride(2) == 1
    block_d = triton.next_power_of_2(head_dim)
    tok = config.quant_tok
    common = {"HEAD_DIM": head_dim, "BLOCK_SIZE": block_size, "BLOCK_D": block_d}
    cache_strides = (kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0))
    sums = []
    for paged, heads, n in ((False, num_q_heads, max_query_len), (True, num_kv_heads, max_seq_len)):
        # Enough programs to fill the GPU (about 512).
        splits = max(1, min(triton.cdiv(n, tok), triton.cdiv(512, num_seqs * heads)))
        split_len = triton.cdiv(triton.cdiv(n, splits), tok) * tok
        part = torch.empty(num_seqs, heads, splits, block_d, dtype=torch.float32, device=q.device)
        _sum_kernel[(num_seqs, heads, splits)](
            kv_cache if paged else q,
            block_tables,
            seq_lens,
            query_start_loc,
            part,
            split_len,
            q.stride(0),
            q.stride(1),
            *cache_strides,
            PAGED=paged,
            TOK=tok,
            **common,
            num_warps=4,
        )
        sums.append(part.sum(2))
    qsl = query_start_loc.long()
    mean_q = sums[0] / (qsl[1:] - qsl[:-1]).clamp_min(1)[:, None, None]
    mean_k = (sums[1] / seq_lens.long().clamp_min(1)[:, None, None]).contiguous()
    mean_q = mean_q.contiguous()  # [B, Hq, BLOCK_D] (padding dims zero)
    q_code, q_scale, k_code, k_scale, qmk = codes
    _quant_kernel[(num_seqs, num_q_heads, triton.cdiv(max_query_len, tok))](
        q,
        block_tables,
        seq_lens,
        query_start_loc,
        mean_q,
        mean_q,
        q_code,
        q_scale,
        qmk,
        length,
        q.stride(0),
        q.stride(1),
        *cache_strides,
        q_code.stride(0),
        q_code.stride(1),
        q_scale.stride(0),
        q_scale.stride(1),
        mean_q.stride(0),
        mean_q.stride(1),
        0,
        0,
        PAGED=False,
        GROUP=group,
        TOK=tok,
        **common,
        num_warps=4,
    )
    key_rows = KEY_GROUP_TILES * layout.k_tile  # a key program quantizes one key group
    _quant_kernel[(num_seqs, num_kv_heads, triton.cdiv(length, key_rows))](
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        mean_k,
        mean_q,
        k_code,
        k_scale,
        qmk,
        length,
        q.stride(0),
        q.stride(1),
        *cache_strides,
        k_code.stride(1),
        k_code.stride(2),
        k_scale.stride(0),
        k_scale.stride(1),
        mean_k.stride(0),
        mean_k.stride(1),
        qmk.stride(0),
        qmk.stride(1),
        PAGED=True,
        GROUP=group,
        TOK=key_rows,
        **common,
        num_warps=8 if key_rows > 64 else 4,
    )
    return codes


def select_tiles_triton(
    codes: QKCodes,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    layout: TileLayout,
    thresholds: torch.Tensor,
    streaming: torch.Tensor | None = None,
    config: TileSelectConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 2 with Triton (select_tiles_ref's contract): (mask, kv_index, kv_count)."""
    config = config or TileSelectConfig()
    q_code, q_scale, k_code, k_scale, qmk = codes
    num_q_heads, head_dim = q_code.shape[1:]
    num_seqs, num_kv_heads, length, _ = k_code.shape
    n_qt, n_kt = layout.num_q_tiles(max_query_len), layout.num_k_tiles(max_seq_len)
    assert length == n_kt * layout.k_tile and k_code.is_contiguous() and q_code.stride(2) == 1
    dev = q_code.device
    mask = torch.zeros(num_seqs, num_kv_heads, n_qt, n_kt, dtype=torch.uint8, device=dev)
    index = torch.empty(num_seqs, num_kv_heads, n_qt, n_kt, dtype=torch.int32, device=dev)
    count = torch.zeros(num_seqs, num_kv_heads, n_qt, dtype=torch.int32, device=dev)
    if num_seqs == 0 or max_query_len == 0:
        return mask, index, count
    log2_thr = torch.log2(thresholds.to(device=dev, dtype=torch.float32).clamp_min(0)).contiguous()
    stream = streaming.to(device=dev, dtype=torch.bool) if streaming is not None else log2_thr
    _select_kernel[(num_seqs, n_qt, num_kv_heads)](
        q_code,
        q_scale,
        k_code,
        k_scale,
        qmk,
        seq_lens,
        query_start_loc,
        log2_thr,
        stream,
        mask,
        index,
        count,
        scale * LOG2E,
        n_qt,
        q_code.stride(0),
        q_code.stride(1),
        q_scale.stride(0),
        q_scale.stride(1),
        k_code.stride(0),
        k_code.stride(1),
        k_scale.stride(0),
        k_scale.stride(1),
        qmk.stride(0),
        qmk.stride(1),
        mask.stride(0),
        mask.stride(1),
        mask.stride(2),
        count.stride(0),
        count.stride(1),
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        Q_TILE=layout.q_tile,
        K_TILE=layout.k_tile,
        SINK=layout.sink,
        LOCAL=layout.local,
        CHUNK=config.chunk,
        STREAMING=streaming is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({"maxnreg": config.max_registers} if config.max_registers else {}),
    )
    return mask, index, count


def sale_select_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    layout: TileLayout,
    thresholds: torch.Tensor,
    streaming: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = quantize_qk_ref(q, kv_cache, block_tables, seq_lens, query_start_loc, max_seq_len, layout)
    return select_tiles_ref(
        codes, seq_lens, query_start_loc, scale, max_query_len, max_seq_len, layout, thresholds, streaming
    )


def sale_select(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    layout: TileLayout,
    thresholds: torch.Tensor,
    streaming: torch.Tensor | None = None,
    config: TileSelectConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tiles of query_start_loc's prefill chunks that sparse_prefill computes.

    q: [T, Hq, D] (the attention's queries); kv_cache: one layer, the chunks' K stored;
    thresholds: float [Hq], >= 0 (0: every tile); streaming: bool [Hkv] or None. Returns (mask
    uint8 [B, Hkv, n_q_tiles, n_k_tiles], kv_index int32 [same], kv_count [B, Hkv, n_q_tiles])."""
    num_q_heads = q.shape[1]
    num_kv_heads = kv_cache.shape[1]
    if num_q_heads % num_kv_heads or thresholds.shape != (num_q_heads,):
        raise ValueError(f"thresholds must be [num_q_heads={num_q_heads}], got {tuple(thresholds.shape)}")
    if streaming is not None and streaming.shape != (num_kv_heads,):
        raise ValueError(f"streaming must be [num_kv_heads={num_kv_heads}], got {tuple(streaming.shape)}")
    if not use_triton(q):
        return sale_select_ref(
            q,
            kv_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_query_len,
            max_seq_len,
            layout,
            thresholds,
            streaming,
        )
    codes = quantize_qk_triton(
        q, kv_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, layout, config
    )
    return select_tiles_triton(
        codes, seq_lens, query_start_loc, scale, max_query_len, max_seq_len, layout, thresholds, streaming, config
    )
