"""Causal attention of prefill chunks over the paged KV cache (varlen batch, chunked prefill).

store_kv has already written the chunk's own K/V, so every key is read through the block table.
A program's rows are BLOCK_Q query tokens x the GROUP query heads of one KV head (row r: token
r // GROUP, head r % GROUP), so one K/V tile load serves the GQA group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseserve.kernels.dispatch import tl, triton, use_triton
from sparseserve.kernels.paged_decode import LOG2E, attend_ref, attend_tile, sequence_kv


# Nothing step-shaped is specialized on (docs/architecture.md, "kernels/").
@triton.jit(do_not_specialize=["stride_tb"], do_not_specialize_on_alignment=["table_ptr", "seq_lens_ptr", "qsl_ptr"])
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_ckv,
    stride_tb,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (sequence, tile of BLOCK_Q queries, KV head) (reference: paged_prefill_ref).

    Query i of sequence b sits at position seq_lens[b] - q_len + i. Key tiles wholly before the
    tile's first query run unmasked; the rest run with the causal mask.
    """
    b = tl.program_id(0)
    first_q = tl.program_id(1) * BLOCK_Q
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_start = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    qi = first_q + r // GROUP
    heads = kvh * GROUP + r % GROUP
    dims = tl.arange(0, BLOCK_D)
    io_mask = ((r < BLOCK_Q * GROUP) & (qi < q_len))[:, None] & (dims[None, :] < HEAD_DIM)
    tok = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=io_mask, other=0.0)
    pos = ctx_start + qi
    kv_base = cache_ptr + kvh * stride_ch
    table_row = table_ptr + b.to(tl.int64) * stride_tb

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    kv_end = tl.minimum(seq_len, ctx_start + first_q + BLOCK_Q)  # one past the tile's last query
    full_end = (ctx_start + first_q) // BLOCK_N * BLOCK_N
    for tile in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc,
            m_i,
            l_i,
            q,
            kv_base,
            table_row,
            tile,
            kv_end,
            pos,
            dims,
            qk_scale,
            stride_cb,
            stride_ckv,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            BLOCK_N,
            False,
            DOT_PREC,
        )
    for tile in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc,
            m_i,
            l_i,
            q,
            kv_base,
            table_row,
            tile,
            kv_end,
            pos,
            dims,
            qk_scale,
            stride_cb,
            stride_ckv,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            BLOCK_N,
            True,
            DOT_PREC,
        )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


@dataclass(frozen=True)
class PrefillConfig:
    """Rows per program (query tokens x GQA group), key tile, and the launch shape.
    Defaults from a sweep: docs/kernels.md, "Run 1"."""

    block_m: int = 128
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2


def default_prefill_config(dtype: torch.dtype, head_dim: int) -> PrefillConfig:
    if dtype == torch.float32 or head_dim > 128:  # keep the tiles within shared memory
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    return PrefillConfig()


# The references' float32 scores of one query chunk stay near 64 MB however long the context.
_REF_SCORE_ELEMENTS = 1 << 24


def paged_prefill_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention for the sequences of query_start_loc (token offsets into q).

    q: [T, Hq, D]; block_tables, seq_lens: a row per sequence, query_start_loc one more entry;
    fills out[query tokens] only and returns out. One sequence at a time, in query chunks of
    bounded memory.
    """
    out = torch.empty_like(q) if out is None else out
    num_q_heads = q.shape[1]
    starts = query_start_loc.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        q0, q1 = starts[b], starts[b + 1]
        if q1 <= q0 or length <= 0:
            continue
        k, v = sequence_kv(kv_cache, block_tables[b], length)
        first = length - (q1 - q0)  # position of the chunk's first query
        chunk = max(1, _REF_SCORE_ELEMENTS // (num_q_heads * length))
        for c0 in range(q0, q1, chunk):
            c1 = min(c0 + chunk, q1)
            end = first + c1 - q0  # keys past the chunk's last query are never visible
            out[c0:c1] = attend_ref(q[c0:c1], k[:, :end], v[:, :end], first + c0 - q0, scale).to(out.dtype)
    return out


def paged_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_prefill_ref's contract."""
    fn = paged_prefill_triton if use_triton(q) else paged_prefill_ref
    return fn(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, out)


def paged_prefill_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    num_q_heads, head_dim = q.shape[1:]
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    assert num_q_heads % num_kv_heads == 0 and kv_cache.shape[4] == head_dim
    assert kv_cache.stride(4) == 1 and kv_cache.stride(3) == head_dim and q.stride(2) == 1
    config = config or default_prefill_config(q.dtype, head_dim)
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.numel()
    if num_seqs == 0 or max_query_len == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_m = max(config.block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    _prefill_kernel[(num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=config.block_n,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
