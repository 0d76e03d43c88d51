"""Sparse prefill calibration (calibration/prefill.py) on one hand-built layer: each head's threshold is the
first of start, start/2, ... whose output error, the head selecting alone, is within the bound."""

from __future__ import annotations

import pytest
import torch

from sparseserve.attention.backend import AttentionMetadata
from sparseserve.calibration.prefill import calibrate_layer
from sparseserve.kernels.sale_select import sale_select_ref
from sparseserve.kernels.sparse_prefill import TileLayout, sparse_prefill_ref

HQ, HKV, D, BS, N = 4, 2, 32, 16, 420


@pytest.fixture(scope="module")
def layer():
    g = torch.Generator().manual_seed(0)
    nb = -(-N // BS)
    cache = torch.randn(nb, HKV, 2, BS, D, generator=g)
    # Queries of different sharpness per head: their errors cross a bound at different thresholds.
    q = torch.randn(N, HQ, D, generator=g) * torch.tensor([0.5, 1.5, 3.0, 6.0])[None, :, None]
    meta = AttentionMetadata(
        torch.arange(N),
        torch.tensor([0, N], dtype=torch.int32),
        torch.tensor([N], dtype=torch.int32),
        torch.randperm(nb, generator=g).int()[None],
        0,
        N,
        N,
    )
    return q, cache, meta


def head_error(q, cache, meta, head: int, t: float) -> float:
    """The head's relative output error when it alone selects (the group's other heads select nothing)."""
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, D**-0.5, N, N, TileLayout())
    thr = torch.full((HQ,), float("inf"))
    thr[head] = t
    _, index, count = sale_select_ref(*args, thr)
    ref = sparse_prefill_ref(*args)[:, head]
    return ((sparse_prefill_ref(*args, index, count)[:, head] - ref).norm() / ref.norm()).item()


def test_thresholds_halve_until_within_bound(layer):
    q, cache, meta = layer
    start, lowest, bound = 1.0, 2.0**-6, 0.03
    thr = calibrate_layer(q, cache, meta, D**-0.5, TileLayout(), start, lowest, bound)
    assert thr.shape == (HQ,)
    for h, t in enumerate(thr.tolist()):
        if t == 0:  # even the lowest threshold tried was not within the bound
            assert head_error(q, cache, meta, h, lowest) > bound, h
            continue
        assert t in {start / 2**k for k in range(7)}, t
        assert head_error(q, cache, meta, h, t) <= bound, (h, t)
        if t < start:
            assert head_error(q, cache, meta, h, 2 * t) > bound, (h, t)
    assert len(set(thr.tolist())) > 1  # the heads differ


def test_bounds_at_the_extremes(layer):
    q, cache, meta = layer
    args = (q, cache, meta, D**-0.5, TileLayout(), 0.5, 0.2)
    assert torch.equal(calibrate_layer(*args, float("inf")), torch.full((HQ,), 0.5))  # the start passes
    assert torch.equal(calibrate_layer(*args, -1.0), torch.zeros(HQ))  # nothing passes: every tile
