"""row_view (kernels/row_view.py): a step's block tables and slot mapping by device row, the Triton kernel against
its torch reference on random inputs (TRITON_INTERPRET on CPU): padding entries, -1 slots, tables wider than one
pass of a program, more slots than one program takes."""

from __future__ import annotations

import pytest
import torch

from sparseserve.kernels.row_view import row_view_ref, row_view_triton
from tests.kernel_utils import DEVICE


@pytest.mark.parametrize("rows, width, tokens, block_size", [(3, 7, 5, 16), (2, 1500, 600, 8), (0, 4, 3, 16)])
def test_row_view_matches_reference(rows, width, tokens, block_size):
    g = torch.Generator().manual_seed(rows * 1000 + width)
    blocks = 2000
    row_of = torch.randperm(blocks + 1, generator=g).to(torch.int32)
    tables = torch.randint(0, blocks + 1, (rows, width + 3), generator=g, dtype=torch.int32)[:, :width]  # strided
    slots = torch.randint(0, blocks * block_size, (tokens,), generator=g)
    slots[torch.rand(tokens, generator=g) < 0.3] = -1
    args = [t.to(DEVICE) for t in (row_of, tables, slots)]
    got, want = row_view_triton(*args, block_size), row_view_ref(*args, block_size)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    assert (got[1][args[2] < 0] == -1).all() and (got[1][args[2] >= 0] >= 0).all()
