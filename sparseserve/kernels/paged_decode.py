"""Flash-decoding over the paged KV cache: one query token per sequence, split over the KV length.

Kernel 1: a (sequence, KV head, split) program attends `split_size` tokens with all query heads
of the KV group, writing a partial output and its log-sum-exp; kernel 2 merges the splits. The
grid follows only the batch, the head counts and the host-side `max_seq_len` bound, so a CUDA
graph replays it for any `seq_lens` (splits past a sequence's end return at once).
Design notes: docs/kernels.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from sparseserve.kernels.dispatch import tl, triton, use_triton

LOG2E = 1.4426950408889634
# Splits merged per tile (merge_splits): one kernel variant whatever the number of splits.
MERGE_TILE = 16


@triton.jit
def attend_tile(
    acc,
    m_i,
    l_i,
    q,
    kv_base,
    table_row,
    tile_start,
    kv_end,
    pos,
    dims,
    qk_scale,
    stride_cb,
    stride_ckv,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One online-softmax step of q [M, D] over TILE_N paged tokens starting at tile_start.

    Scores are in the log2 domain (qk_scale includes log2(e)). MASKED tiles hide tokens >= kv_end
    and, per row, tokens after the row's position `pos` (causal); unmasked tiles skip all of that.
    """
    tok = tile_start + tl.arange(0, TILE_N)
    # Row `tok % BLOCK_SIZE` of head block `blk`: HEAD_DIM contiguous elements, V at +stride_ckv.
    # Masks only where needed: an all-true mask the compiler cannot prove costs vector loads.
    if MASKED:
        tmask = tok < kv_end
        blk = tl.load(table_row + tok // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        k_ptrs = kv_base + (blk * stride_cb + (tok % BLOCK_SIZE) * HEAD_DIM)[:, None] + dims[None, :]
        if BLOCK_D == HEAD_DIM:
            kv_mask = tmask[:, None]
        else:
            kv_mask = tmask[:, None] & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(k_ptrs + stride_ckv, mask=kv_mask, other=0.0)
    else:
        blk = tl.load(table_row + tok // BLOCK_SIZE).to(tl.int64)
        k_ptrs = kv_base + (blk * stride_cb + (tok % BLOCK_SIZE) * HEAD_DIM)[:, None] + dims[None, :]
        if BLOCK_D == HEAD_DIM:
            k = tl.load(k_ptrs)
            v = tl.load(k_ptrs + stride_ckv)
        else:
            k = tl.load(k_ptrs, mask=dims[None, :] < HEAD_DIM, other=0.0)
            v = tl.load(k_ptrs + stride_ckv, mask=dims[None, :] < HEAD_DIM, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if MASKED:
        s = tl.where((tok[None, :] <= pos[:, None]) & tmask[None, :], s, float("-inf"))
    return softmax_update(acc, m_i, l_i, s, v, DOT_PREC)


@triton.jit
def softmax_update(acc, m_i, l_i, s, v, DOT_PREC: tl.constexpr):
    """Folds a tile's log2-domain scores s [M, N] (-inf: hidden) and values v [N, D] into
    (acc, m, l)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no visible token yet keeps m = -inf; shift by 0 to avoid inf - inf.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


# Nothing step-shaped is specialized on (docs/architecture.md, "kernels/").
@triton.jit(do_not_specialize=["stride_tb"])
def _decode_split_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    split_size,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ch,
    stride_ckv,
    stride_tb,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Partial attention of one (sequence, KV head, split) (reference: paged_decode_ref).

    Writes part_out[b, h, split] = softmax-weighted V over the split and part_lse = its log2-sum-exp
    for the GROUP query heads h of the KV head. Splits past the sequence's end write nothing.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * split_size
    if start >= seq_len:
        return
    end = tl.minimum(start + split_size, seq_len)

    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    q_mask = (g[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    kv_base = cache_ptr + kvh * stride_ch
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    pos = tl.full([BLOCK_G], 0, tl.int32) + (seq_len - 1)  # the decode query is the last token

    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    full_end = start + (end - start) // TILE_N * TILE_N
    for tile in range(start, full_end, TILE_N):
        acc, m_i, l_i = attend_tile(
            acc,
            m_i,
            l_i,
            q,
            kv_base,
            table_row,
            tile,
            end,
            pos,
            dims,
            qk_scale,
            stride_cb,
            stride_ckv,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            TILE_N,
            False,
            DOT_PREC,
        )
    if full_end < end:
        acc, m_i, l_i = attend_tile(
            acc,
            m_i,
            l_i,
            q,
            kv_base,
            table_row,
            full_end,
            end,
            pos,
            dims,
            qk_scale,
            stride_cb,
            stride_ckv,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            TILE_N,
            True,
            DOT_PREC,
        )

    # part_out is [B, Hq, num_splits, BLOCK_D] and part_lse [B, Hq, num_splits], both contiguous.
    row = (b * tl.num_programs(1) * GROUP + heads).to(tl.int64) * num_splits + split
    tl.store(part_out_ptr + row[:, None] * BLOCK_D + dims[None, :], acc / l_i[:, None], mask=q_mask)
    tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=g < GROUP)


@triton.jit
def merge_splits(part_out_ptr, part_lse_ptr, row0, num_valid, BLOCK_D: tl.constexpr, MERGE_TILE: tl.constexpr):
    """Log-sum-exp merge of a row's first num_valid partials (partial i at row0 + i); zeros
    where none has weight. Reads tiles of MERGE_TILE, so one compiled variant serves any count."""
    st = tl.arange(0, MERGE_TILE)
    lse_tile = tl.full([MERGE_TILE], float("-inf"), tl.float32)
    for s0 in range(0, num_valid, MERGE_TILE):
        lse = tl.load(part_lse_ptr + row0 + s0 + st, mask=s0 + st < num_valid, other=float("-inf"))
        lse_tile = tl.maximum(lse_tile, lse)
    lse_max = tl.max(lse_tile, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)

    dims = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    denom_tile = tl.zeros([MERGE_TILE], tl.float32)
    for s0 in range(0, num_valid, MERGE_TILE):
        smask = s0 + st < num_valid
        w = tl.exp2(tl.load(part_lse_ptr + row0 + s0 + st, mask=smask, other=float("-inf")) - lse_max)
        denom_tile += w
        part = tl.load(
            part_out_ptr + (row0 + s0 + st)[:, None] * BLOCK_D + dims[None, :], mask=smask[:, None], other=0.0
        )
        acc += tl.sum(w[:, None] * part, 0)
    denom = tl.sum(denom_tile, 0)
    return acc / tl.where(denom > 0, denom, 1.0)


@triton.jit(do_not_specialize=["split_size", "num_splits"])
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    split_size,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_TILE: tl.constexpr,
):
    """Log-sum-exp merge of the splits of one (sequence, query head) (reference: paged_decode_ref).

    Only the splits the sequence reaches are read (the others were never written); length 0
    (padding) gives zeros. Split counts follow the step, so they are not specialized on.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    num_valid = tl.cdiv(seq_len, split_size)
    row0 = (b * NUM_Q_HEADS + h).to(tl.int64) * num_splits
    out = merge_splits(part_out_ptr, part_lse_ptr, row0, num_valid, BLOCK_D, MERGE_TILE)
    dims = tl.arange(0, BLOCK_D)
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ot + h * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters; `target_programs` sets the number of splits (B * Hkv * splits).
    Defaults from a sweep: docs/kernels.md, "Run 1"."""

    tile_n: int = 128
    target_programs: int = 0  # 0: 8 per multiprocessor
    num_warps: int = 4
    num_stages: int = 2


def default_decode_config(dtype: torch.dtype, head_dim: int) -> DecodeConfig:
    if dtype == torch.float32 or head_dim > 128:  # keep num_stages K/V tiles within shared memory
        return DecodeConfig(tile_n=32)
    return DecodeConfig()


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def split_plan(
    batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device, config: DecodeConfig
) -> tuple[int, int]:
    """(split_size, num_splits) from host-side bounds only: a fixed grid under a CUDA graph."""
    target = config.target_programs or 8 * _num_sms(device)
    max_tiles = max(1, triton.cdiv(max_seq_len, config.tile_n))
    num_splits = min(max_tiles, max(1, triton.cdiv(target, batch * num_kv_heads)))
    split_size = triton.cdiv(max_tiles, num_splits) * config.tile_n
    return split_size, max(1, triton.cdiv(max_seq_len, split_size))


def sequence_kv(kv_cache: torch.Tensor, table_row: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a sequence's first `length` tokens, float32 [Hkv, length, D] each, from one
    layer's paged cache [NB, Hkv, 2, bs, D] through its block-table row."""
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    nb = -(-length // block_size)
    kv = kv_cache[table_row[:nb].long()].float()  # [nb, Hkv, 2, bs, D]
    kv = kv.permute(2, 1, 0, 3, 4).reshape(2, num_kv_heads, nb * block_size, head_dim)[:, :, :length]
    return kv[0], kv[1]


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float) -> torch.Tensor:
    """Causal float32 attention of q [n, Hq, D] at positions first .. first + n - 1 over k, v
    [Hkv, L, D] (L >= first + n; query head h reads KV head h // group); returns [n, Hq, D]."""
    n, num_q_heads, head_dim = q.shape
    num_kv_heads, length, _ = k.shape
    mask = None  # one query at the end sees every key
    if not (n == 1 and first + 1 >= length):
        mask = torch.arange(length, device=q.device)[None, :] <= first + torch.arange(n, device=q.device)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k[None],
        v[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_q_heads != num_kv_heads,
    )
    return out[0].transpose(0, 1)


def paged_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D], one query per sequence at position seq_lens[b] - 1; returns (or fills)
    out [B, Hq, D]. Rows of length 0 give zeros."""
    out = torch.empty_like(q) if out is None else out
    for b, length in enumerate(seq_lens.tolist()):
        if length <= 0:
            out[b] = 0
            continue
        k, v = sequence_kv(kv_cache, block_tables[b], length)
        out[b] = attend_ref(q[b : b + 1], k, v, length - 1, scale)[0].to(out.dtype)
    return out


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_decode_ref's contract."""
    fn = paged_decode_triton if use_triton(q) else paged_decode_ref
    return fn(q, kv_cache, block_tables, seq_lens, scale, max_seq_len, out)


def paged_decode_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    batch, num_q_heads, head_dim = q.shape
    config = config or default_decode_config(q.dtype, head_dim)
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    assert num_q_heads % num_kv_heads == 0 and kv_cache.shape[4] == head_dim
    assert kv_cache.stride(4) == 1 and kv_cache.stride(3) == head_dim and q.stride(2) == 1
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    split_size, num_splits = split_plan(batch, num_kv_heads, max_seq_len, q.device, config)
    block_d = triton.next_power_of_2(head_dim)
    part_out = torch.empty(batch, num_q_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        scale * LOG2E,
        split_size,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        TILE_N=config.tile_n,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        part_out,
        part_lse,
        seq_lens,
        out,
        split_size,
        num_splits,
        out.stride(0),
        out.stride(1),
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        MERGE_TILE=MERGE_TILE,
        num_warps=4,
    )
    return out
