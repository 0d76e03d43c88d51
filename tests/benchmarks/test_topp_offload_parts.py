"""benchmarks/topp_offload_parts.py runs on the CPU (the kernels under the Triton interpreter, float32, a short
context, each stage called once instead of timed): its numbers matter on the GPU only. Its layer checks itself
(both ways keep the same lists and attend the same output: measure raises otherwise)."""

from __future__ import annotations

import torch

from benchmarks import topp_offload_parts as bench


def test_measure_rows():
    ctx = 4096 + 17 * 16 + 5  # past topp's cap of 4,096 tokens (the prune runs), a partial last block
    rows = bench.measure([1], ctx, 5.0, timer=lambda call: (call(), 0.0)[1], device="cpu", dtype=torch.float32)
    (row,) = rows
    p = bench.build(1, ctx, 5.0, device="cpu", dtype=torch.float32).params
    assert row["batch"] == 1 and row["candidates_found"] == bench.HKV * (p.cap - p.local) and row["missing"] == 0
    assert bench.BS * (p.sink + p.local) < row["kept_tokens"] < bench.BS * p.cap  # the prune kept some, not all
