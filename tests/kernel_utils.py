"""Shared by the Triton kernel tests: where they run and how results are compared.

Without CUDA the kernels run on the CPU under the Triton interpreter (conftest.py sets
TRITON_INTERPRET before any kernel module is imported); with CUDA the same tests run on the GPU.
"""
from __future__ import annotations

import pytest
import torch

import triton  # noqa: F401  (a test dependency: its absence must fail, not skip)

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# The Triton 3.9 interpreter multiplies bf16 tl.dot operands as their raw uint16 bits
# (InterpreterBuilder.create_dot), so bf16 attention is checked on the GPU only.
ATTN_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
