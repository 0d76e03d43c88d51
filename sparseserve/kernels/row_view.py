"""row_view: a step's addressing by token block -> by device row (KV offload, kvcache/offload.py): its block
tables and its slot mapping in one launch, fixed shapes (CUDA graphs capture it), -1 slots staying -1."""

from __future__ import annotations

import torch

from sparseserve.kernels.dispatch import tl, triton, use_triton


def row_view_ref(
    row_of: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """row_of [N + 1] (int32): token block -> device row; tables [B, W]: token blocks (each < N + 1); slots [T]
    (int64): token slots, -1 none. Returns (tables by device row [B, W] int32, slots by device row [T] int64)."""
    rows = row_of[tables.long()]
    row_slots = row_of[(slots // block_size).clamp_min(0)].long() * block_size + slots % block_size
    return rows, torch.where(slots >= 0, row_slots, -1)


def row_view(
    row_of: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """row_view_ref's contract."""
    return (row_view_triton if use_triton(tables) else row_view_ref)(row_of, tables, slots, block_size)


# Nothing step-shaped is specialized on (docs/architecture.md, "kernels/").
@triton.jit(do_not_specialize=["num_rows", "width", "num_slots", "stride_tb"])
def _row_view_kernel(
    row_of_ptr,
    tables_ptr,
    rows_ptr,
    slots_ptr,
    row_slots_ptr,
    num_rows,
    width,
    num_slots,
    stride_tb,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Programs below num_rows: one table row each; the rest: BLOCK_T slots each."""
    pid = tl.program_id(0)
    if pid < num_rows:
        for w0 in range(0, width, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            m = w < width
            blk = tl.load(tables_ptr + pid.to(tl.int64) * stride_tb + w, mask=m, other=0)
            tl.store(rows_ptr + pid.to(tl.int64) * width + w, tl.load(row_of_ptr + blk, mask=m), mask=m)
    else:
        t = (pid - num_rows) * BLOCK_T + tl.arange(0, BLOCK_T)
        m = t < num_slots
        slot = tl.load(slots_ptr + t, mask=m, other=-1)
        row = tl.load(row_of_ptr + tl.maximum(slot, 0) // BLOCK_SIZE, mask=m & (slot >= 0), other=0).to(tl.int64)
        tl.store(row_slots_ptr + t, tl.where(slot >= 0, row * BLOCK_SIZE + slot % BLOCK_SIZE, -1), mask=m)


def row_view_triton(
    row_of: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    assert tables.stride(1) == 1 and slots.is_contiguous() and slots.dtype == torch.int64
    b, w = tables.shape
    rows = torch.empty(b, w, dtype=row_of.dtype, device=tables.device)
    row_slots = torch.empty_like(slots)
    block_t = 256
    grid = b + triton.cdiv(slots.numel(), block_t)
    if grid:
        _row_view_kernel[(grid,)](
            row_of,
            tables,
            rows,
            slots,
            row_slots,
            b,
            w,
            slots.numel(),
            tables.stride(0),
            BLOCK_SIZE=block_size,
            BLOCK_W=256,  # fixed: a step's table width varies outside graphs (no compilation while serving)
            BLOCK_T=block_t,
        )
    return rows, row_slots
