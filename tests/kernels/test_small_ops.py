"""Fused small-op kernels (kernels/small_ops.py) against their torch references."""

from __future__ import annotations

import pytest
import torch

from sparseserve.kernels.small_ops import (
    add_rmsnorm_triton,
    apply_rotary_ref,
    rmsnorm_ref,
    rotary_triton,
    silu_and_mul_ref,
    silu_and_mul_triton,
)
from sparseserve.layers.rotary import RotaryEmbedding
from tests.kernel_utils import DEVICE
from tests.kernel_utils import rel_err as rel

TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = list(TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(1, 64), (5, 96), (33, 256)])
def test_add_rmsnorm(dtype, tokens, hidden):
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    x = torch.randn(tokens, hidden, dtype=dtype)
    res = torch.randn(tokens, hidden, dtype=dtype)
    ref_out, ref_res = rmsnorm_ref(x + res, weight, 1e-5), x + res
    out, res_out = add_rmsnorm_triton(x.to(DEVICE), res.to(DEVICE), weight.to(DEVICE), 1e-5)
    if dtype != torch.bfloat16 or DEVICE.type == "cuda":
        assert torch.equal(res_out.cpu(), ref_res)  # the residual sum is rounded exactly as torch rounds it
    else:  # the CPU interpreter truncates float32 -> bf16 instead of rounding to nearest even
        ulp = 2.0 ** (torch.frexp(ref_res.float()).exponent.float() - 8)
        assert ((res_out.float() - ref_res.float()).abs() <= ulp).all()
    assert rel(out.cpu(), ref_out) < TOL[dtype]
    assert (
        rel(add_rmsnorm_triton(x.to(DEVICE), None, weight.to(DEVICE), 1e-5).cpu(), rmsnorm_ref(x, weight, 1e-5))
        < TOL[dtype]
    )


def test_rmsnorm_ref_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(96, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * torch.randn(96))
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    assert torch.equal(rmsnorm_ref(x, hf.weight, 1e-6), hf(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens, hq, hkv, d", [(1, 4, 2, 64), (7, 6, 3, 32), (20, 8, 1, 128), pytest.param(5, 9, 3, 64, id="group3-9q3kv")]
)
def test_rotary_on_strided_qk(dtype, tokens, hq, hkv, d):
    # q and k are views of one packed qkv row, as in the model.
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, dtype=dtype)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
    pos = torch.randint(0, 5000, (tokens,))
    cos, sin = RotaryEmbedding(d, {"rope_theta": 10000.0})(pos, dtype)
    q_out, k_out = rotary_triton(*(t.to(DEVICE) for t in (q, k, cos, sin)))
    assert rel(q_out.cpu(), apply_rotary_ref(q, cos, sin)) < TOL[dtype]
    assert rel(k_out.cpu(), apply_rotary_ref(k, cos, sin)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, n", [(1, 64), (9, 1500)])
def test_silu_and_mul(dtype, tokens, n):
    x = torch.randn(tokens, 2 * n, dtype=dtype)
    assert rel(silu_and_mul_triton(x.to(DEVICE)).cpu(), silu_and_mul_ref(x)) < TOL[dtype]
