"""Block-sparse causal attention of prefill chunks over the paged KV cache (SALE's compute pass).

A chunk's work is a grid of (query tile, key tile) pairs (TileLayout): query tile t holds the
chunk's queries [t * q_tile, (t + 1) * q_tile) (chunk-relative), key tile j the context
positions [j * k_tile, (j + 1) * k_tile) (absolute). With p0 = seq_len - q_len + t * q_tile the
tile's first query, lo = max(p0 // k_tile - local, 0), s_end = min(sink, lo) and last the key
tile of its last query, its key tiles are
    forced:  [0, s_end) (sink) and [lo, last] (local window and diagonal), always computed;
    middle:  [s_end, lo), computed where the mask lists them, never for a streaming KV head.
Only the diagonal tiles are causally masked.

Masks are per KV head (a program serves the whole GQA group), given as lists:
    kv_index int32 [B, Hkv, n_q_tiles, n_k_tiles]: the middle tiles, first kv_count entries;
    kv_count int32 [B, Hkv, n_q_tiles].
tile_lists() makes them from a dense tile mask; kernels/sale_select.py writes them directly;
kv_index None computes every middle tile (dense). Reference: sparse_prefill_ref.
Design notes: docs/sparse_prefill.md, "The kernels".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseserve.kernels.dispatch import tl, triton, use_triton
from sparseserve.kernels.paged_decode import LOG2E, attend_tile


@dataclass(frozen=True)
class TileLayout:
    """The (query tile, key tile) grid of a sparse prefill; see the module docstring."""

    q_tile: int = 64  # chunk queries a mask row
    k_tile: int = 64  # context positions a mask column
    sink: int = 1  # leading key tiles always computed
    local: int = 2  # key tiles before a query tile's diagonal always computed

    def __post_init__(self) -> None:
        for name in ("q_tile", "k_tile"):
            n = getattr(self, name)
            if n < 16 or n & (n - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {n}")
        if self.sink < 0 or self.local < 0:
            raise ValueError(f"sink and local must be >= 0, got {self.sink}, {self.local}")

    def num_q_tiles(self, max_query_len: int) -> int:
        return max(1, -(-max_query_len // self.q_tile))

    def num_k_tiles(self, max_seq_len: int) -> int:
        return max(1, -(-max_seq_len // self.k_tile))


def tile_geometry(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_q_tiles: int, layout: TileLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """int64 [B, n_q_tiles] each: (valid, s_end, lo, last) of every query tile (module docstring).

    valid: the tile holds at least one query. For invalid tiles the other values are meaningless."""
    qsl = query_start_loc.long()
    q_len = (qsl[1:] - qsl[:-1])[:, None]
    t = torch.arange(num_q_tiles, device=qsl.device)[None, :]
    ctx_start = seq_lens.long()[:, None] - q_len
    p0 = ctx_start + t * layout.q_tile
    p1 = torch.minimum(p0 + layout.q_tile, seq_lens.long()[:, None]) - 1
    lo = (p0 // layout.k_tile - layout.local).clamp_min(0)
    s_end = lo.clamp_max(layout.sink)
    return t * layout.q_tile < q_len, s_end, lo, p1 // layout.k_tile


def tile_classes(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_q_tiles: int, num_k_tiles: int, layout: TileLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [B, n_q_tiles, n_k_tiles] each: (forced, middle) tiles of every valid query tile."""
    valid, s_end, lo, last = (x[..., None] for x in tile_geometry(seq_lens, query_start_loc, num_q_tiles, layout))
    j = torch.arange(num_k_tiles, device=seq_lens.device)
    forced = valid & ((j < s_end) | ((j >= lo) & (j <= last)))
    middle = valid & (j >= s_end) & (j < lo)
    return forced, middle


def tile_lists(
    mask: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, layout: TileLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_index, kv_count) of a tile mask [B, Hkv, n_q_tiles, n_k_tiles] (nonzero: compute):
    its middle tiles in ascending order, without a host sync."""
    _, middle = tile_classes(seq_lens, query_start_loc, mask.shape[2], mask.shape[3], layout)
    keep = (mask != 0) & middle[:, None]
    count = keep.sum(-1, dtype=torch.int32)
    index = torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    return index, count


def _allowed_tiles(
    seq_lens, query_start_loc, num_kv_heads, num_q_tiles, num_k_tiles, layout, kv_index, kv_count, streaming
) -> torch.Tensor:
    """bool [B, Hkv, n_q_tiles, n_k_tiles]: the tiles the kernel computes."""
    forced, middle = tile_classes(seq_lens, query_start_loc, num_q_tiles, num_k_tiles, layout)
    batch = seq_lens.numel()
    if kv_index is None:
        listed = middle[:, None].expand(batch, num_kv_heads, num_q_tiles, num_k_tiles)
    else:
        n = kv_index.shape[-1]
        used = torch.arange(n, device=kv_index.device) < kv_count[..., None].long()
        # Unused entries go to a spare column, dropped after the scatter.
        cols = torch.where(used, kv_index.long(), num_k_tiles)
        listed = torch.zeros(
            batch, num_kv_heads, num_q_tiles, num_k_tiles + 1, dtype=torch.bool, device=seq_lens.device
        )
        listed.scatter_(-1, cols, True)
        listed = listed[..., :num_k_tiles] & middle[:, None]
    if streaming is not None:
        listed = listed & ~streaming.to(device=listed.device, dtype=torch.bool)[None, :, None, None]
    return forced[:, None] | listed


_SCORE_ELEMENTS = 1 << 25


def sparse_prefill_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    layout: TileLayout,
    kv_index: torch.Tensor | None = None,
    kv_count: torch.Tensor | None = None,
    streaming: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal float32 attention of each chunk query over the keys of its allowed tiles."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    batch = seq_lens.numel()
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or batch == 0 or max_query_len == 0:
        return out
    n_qt, n_kt = layout.num_q_tiles(max_query_len), layout.num_k_tiles(max_seq_len)
    allowed = _allowed_tiles(seq_lens, query_start_loc, num_kv_heads, n_qt, n_kt, layout, kv_index, kv_count, streaming)
    max_blocks = max(1, -(-max_seq_len // block_size))
    kv = kv_cache[block_tables[:, :max_blocks].long()].float()  # [B, MB, Hkv, 2, bs, D]
    ctx = max_blocks * block_size
    k = kv[:, :, :, 0].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, ctx, head_dim)
    v = kv[:, :, :, 1].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, ctx, head_dim)
    keys = torch.arange(ctx, device=q.device)
    # unwritten cache memory may hold NaN
    v = v.masked_fill((keys[None, :] >= seq_lens.long()[:, None])[:, None, :, None], 0.0)

    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(batch, device=q.device), q_lens, output_size=num_tokens)
    local = torch.arange(num_tokens, device=q.device) - qsl[seq_idx]
    qp = q.new_zeros(batch, max_query_len, num_kv_heads, group, head_dim, dtype=torch.float32)
    qp[seq_idx, local] = q.float().view(num_tokens, num_kv_heads, group, head_dim)
    ctx_start = seq_lens.long() - q_lens
    qpos = ctx_start[:, None] + torch.arange(max_query_len, device=q.device)[None, :]  # [B, maxq]
    qvalid = torch.arange(max_query_len, device=q.device)[None, :] < q_lens[:, None]
    res = torch.zeros_like(qp)
    # Query chunks bound the float32 scores [B, Hkv, group, chunk, ctx] (long prompts on the CPU).
    chunk = max(1, _SCORE_ELEMENTS // (batch * num_q_heads * ctx))
    qtile = torch.arange(max_query_len, device=q.device) // layout.q_tile
    ktile = (keys // layout.k_tile).clamp_max(n_kt - 1)
    for q0 in range(0, max_query_len, chunk):
        rows = slice(q0, q0 + chunk)
        # [B, Hkv, chunk, ctx]: tile allowed, key causal (so in the context), a real query
        vis = allowed[:, :, qtile[rows]][..., ktile] & (keys[None, None, :] <= qpos[:, rows, None])[:, None]
        vis = (vis & qvalid[:, None, rows, None])[:, :, None]
        scores = torch.einsum("bqhgd,bhkd->bhgqk", qp[:, rows], k) * scale
        probs = torch.softmax(scores.masked_fill(~vis, float("-inf")), dim=-1).nan_to_num(0.0)
        res[:, rows] = torch.einsum("bhgqk,bhkd->bqhgd", probs, v)
    res = res.view(batch, max_query_len, num_q_heads, head_dim)
    out[:] = res[seq_idx, local].to(out.dtype)
    return out


# Nothing step-shaped is specialized on (docs/architecture.md, "kernels/").
@triton.jit(
    do_not_specialize=["num_progs", "stride_tb", "stride_ib", "stride_ih", "stride_it", "stride_nb", "stride_nh"],
    do_not_specialize_on_alignment=["table_ptr", "seq_lens_ptr", "qsl_ptr", "stream_ptr"],
)
def _sparse_prefill_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    idx_ptr,
    cnt_ptr,
    stream_ptr,
    out_ptr,
    qk_scale,
    num_progs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_ckv,
    stride_tb,
    stride_ib,
    stride_ih,
    stride_it,
    stride_nb,
    stride_nh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Q_TILE: tl.constexpr,
    K_TILE: tl.constexpr,
    SINK: tl.constexpr,
    LOCAL: tl.constexpr,
    DENSE: tl.constexpr,
    STREAMING: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (sequence, BLOCK_Q queries, KV head): rows are BLOCK_Q tokens x GROUP_PAD heads
    (heads >= GROUP pad); BLOCK_Q divides q_tile. The last query tiles run first."""
    b = tl.program_id(0)
    first_q = (num_progs - 1 - tl.program_id(1)) * BLOCK_Q  # the last (heaviest) query tiles first
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_start = seq_len - q_len
    t = first_q // Q_TILE
    lo = tl.maximum((ctx_start + t * Q_TILE) // K_TILE - LOCAL, 0)
    s_end = tl.minimum(lo, SINK)

    r = tl.arange(0, BLOCK_M)
    qi = first_q + r // GROUP_PAD
    g = r % GROUP_PAD
    heads = kvh * GROUP + g
    dims = tl.arange(0, BLOCK_D)
    row_ok = (r < BLOCK_Q * GROUP_PAD) & (g < GROUP) & (qi < q_len)
    io_mask = row_ok[:, None] & (dims[None, :] < HEAD_DIM)
    tok = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=io_mask, other=0.0)
    pos = ctx_start + qi
    kv_base = cache_ptr + kvh * stride_ch
    table_row = table_ptr + b.to(tl.int64) * stride_tb

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    kv_end = tl.minimum(seq_len, ctx_start + first_q + BLOCK_Q)  # one past the program's last query
    full_end = (ctx_start + first_q) // BLOCK_N * BLOCK_N  # keys before it are visible to every row
    # One unmasked loop (one software pipeline): the sink, the listed middle tiles, then the
    # local window up to full_end.
    SUB: tl.constexpr = K_TILE // BLOCK_N
    n_listed = lo - s_end  # DENSE: the middle tiles in order
    if STREAMING:
        n_listed = tl.where(tl.load(stream_ptr + kvh) != 0, 0, n_listed)
    list_row = idx_ptr + b.to(tl.int64) * stride_ib + kvh * stride_ih + t * stride_it
    if not DENSE:
        n_listed = tl.minimum(n_listed, tl.load(cnt_ptr + b.to(tl.int64) * stride_nb + kvh * stride_nh + t))
    sink_steps = s_end * SUB
    list_end = sink_steps + n_listed * SUB
    for i in range(list_end + (full_end - lo * K_TILE) // BLOCK_N):
        e = i - sink_steps
        listed = (i >= sink_steps) & (i < list_end)
        if DENSE:
            j = s_end + e // SUB
        else:
            j = tl.load(list_row + e // SUB, mask=listed, other=0)
        tile = tl.where(
            i < sink_steps,
            i * BLOCK_N,
            tl.where(listed, j * K_TILE + (e % SUB) * BLOCK_N, lo * K_TILE + (i - list_end) * BLOCK_N),
        )
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
    for tile in range(full_end, kv_end, BLOCK_N):  # diagonal: causal mask
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
class SparsePrefillConfig:
    """Rows a program (query tokens x padded GQA group), keys a step (divides k_tile), launch
    shape. Defaults: docs/sparse_prefill.md, "The kernels"."""

    block_m: int = 64
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2


def default_sparse_prefill_config(dtype: torch.dtype, head_dim: int, k_tile: int) -> SparsePrefillConfig:
    return SparsePrefillConfig(block_n=min(32, k_tile))


def sparse_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    layout: TileLayout,
    kv_index: torch.Tensor | None = None,
    kv_count: torch.Tensor | None = None,
    streaming: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: SparsePrefillConfig | None = None,
) -> torch.Tensor:
    """Block-sparse causal paged attention of the chunks of query_start_loc (module docstring).

    q: [T, Hq, D]; kv_cache: one layer [NB, Hkv, 2, bs, D], the chunks' own K/V already stored;
    block_tables int32 [B, >= cdiv(max_seq_len, bs)]; seq_lens int32 [B] (chunk included);
    query_start_loc int32 [B + 1]; max_query_len, max_seq_len: host-side bounds (the grid).
    kv_index, kv_count: the middle tiles (None: all); streaming: bool [Hkv], heads computing
    only the forced tiles. Fills out[query tokens] and returns out."""
    num_q_heads, head_dim = q.shape[1:]
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    if num_q_heads % num_kv_heads or kv_cache.shape[4] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    if (kv_index is None) != (kv_count is None):
        raise ValueError("pass kv_index and kv_count together (or neither: every tile)")
    n_qt = layout.num_q_tiles(max_query_len)
    if kv_index is not None and (
        kv_index.shape[:3] != (seq_lens.numel(), num_kv_heads, n_qt) or kv_count.shape != kv_index.shape[:3]
    ):
        raise ValueError(
            f"kv_index {tuple(kv_index.shape)} / kv_count {tuple(kv_count.shape)} do not match "
            f"(B, Hkv, n_q_tiles) = {(seq_lens.numel(), num_kv_heads, n_qt)}"
        )
    if not use_triton(q):
        return sparse_prefill_ref(
            q,
            kv_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_query_len,
            max_seq_len,
            layout,
            kv_index,
            kv_count,
            streaming,
            out,
        )
    assert kv_cache.stride(4) == 1 and kv_cache.stride(3) == head_dim and q.stride(2) == 1
    config = config or default_sparse_prefill_config(q.dtype, head_dim, layout.k_tile)
    if layout.k_tile % config.block_n:
        raise ValueError(f"block_n {config.block_n} must divide k_tile {layout.k_tile}")
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.numel()
    if num_seqs == 0 or max_query_len == 0:
        return out
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, min(layout.q_tile, config.block_m // group_pad))
    block_m = max(16, block_q * group_pad)
    dense = kv_index is None
    idx = kv_index if not dense else seq_lens  # unused (DENSE)
    cnt = kv_count if not dense else seq_lens
    if not dense:
        assert kv_index.stride(3) == 1 and kv_count.stride(2) == 1
    stream = streaming if streaming is not None else seq_lens  # unused (STREAMING=False)
    num_progs = triton.cdiv(max_query_len, block_q)
    _sparse_prefill_kernel[(num_seqs, num_progs, num_kv_heads)](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        idx,
        cnt,
        stream,
        out,
        scale * LOG2E,
        num_progs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_tables.stride(0),
        idx.stride(0) if not dense else 0,
        idx.stride(1) if not dense else 0,
        idx.stride(2) if not dense else 0,
        cnt.stride(0) if not dense else 0,
        cnt.stride(1) if not dense else 0,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=config.block_n,
        Q_TILE=layout.q_tile,
        K_TILE=layout.k_tile,
        SINK=layout.sink,
        LOCAL=layout.local,
        DENSE=dense,
        STREAMING=streaming is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
