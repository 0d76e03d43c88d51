"""Fused elementwise ops of the decoder layer: residual add + RMSNorm, rotary on q and k,
SiLU-and-mul; one program per token row, one pass (why: docs/kernels.md, "Design notes").

The references (`*_ref`) compute as transformers does. The kernels compute in float32 and round
once at the end (the references round between ops), so bf16 results may differ in the last bit.
"""

from __future__ import annotations

import torch

from sparseserve.kernels.dispatch import tl, triton, use_triton
from sparseserve.kernels.pdl import pdl_wait, use_pdl


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_cols,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: read before pdl_wait
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        # The sum is rounded to the model dtype first, as the torch residual add does.
        x = x.to(tl.float32) + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)  # HF rounds before the weight
    tl.store(out_ptr + row * n_cols + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in float32, rounded to x's dtype before the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """RMSNorm(x) or, with a residual, (RMSNorm(x + residual), x + residual)."""
    if residual is None:
        return rmsnorm_ref(x, weight, eps)
    x = x + residual
    return rmsnorm_ref(x, weight, eps), x


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """add_rmsnorm_ref's contract."""
    if use_triton(x):
        return add_rmsnorm_triton(x.contiguous(), residual, weight, eps)
    return add_rmsnorm_ref(x, residual, weight, eps)


def add_rmsnorm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """x: [..., H] contiguous."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    res = residual.reshape(-1, shape[-1]) if residual is not None else x2
    if x2.shape[0]:
        pdl = use_pdl(x.device)
        _add_rmsnorm_kernel[(x2.shape[0],)](
            x2,
            res,
            weight,
            out,
            res_out,
            shape[-1],
            eps,
            HAS_RES=residual is not None,
            BLOCK=triton.next_power_of_2(shape[-1]),
            num_warps=4,
            PDL=pdl,
            launch_pdl=pdl,
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    NUM_Q: tl.constexpr,
    NUM_K: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dmask = d < HALF
    c = tl.load(cos_ptr + t * HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * HALF + d, mask=dmask, other=0.0).to(tl.float32)
    for which in tl.static_range(2):  # q, then k: one program rotates every head of its token
        if which == 0:
            src, dst, st, sh, nh = q_ptr, q_out_ptr, stride_qt, stride_qh, NUM_Q
        else:
            src, dst, st, sh, nh = k_ptr, k_out_ptr, stride_kt, stride_kh, NUM_K
        m = (heads < nh) & dmask
        base = t * st + heads * sh + d
        x1 = tl.load(src + base, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + base + HALF, mask=m, other=0.0).to(tl.float32)
        obase = t * nh * 2 * HALF + heads * 2 * HALF + d  # outputs are contiguous [T, H, D]
        tl.store(dst + obase, (x1 * c - x2 * s).to(dst.dtype.element_ty), mask=m)
        tl.store(dst + obase + HALF, (x2 * c + x1 * s).to(dst.dtype.element_ty), mask=m)


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated in halves (transformers' rotate_half); cos, sin [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, Hq, D] and k [T, Hkv, D] rotated; returns new q, k."""
    return apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """rotary_ref's contract (q and k of a token in one kernel on the GPU)."""
    return (rotary_triton if use_triton(q) else rotary_ref)(q, k, cos, sin)


def rotary_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, Hq, D], k [T, Hkv, D] (unit last stride); cos, sin [T, 1, D/2]. Returns new q, k."""
    num_tokens, num_q, head_dim = q.shape
    num_k = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        cos, sin = cos.reshape(num_tokens, -1).contiguous(), sin.reshape(num_tokens, -1).contiguous()
        pdl = use_pdl(q.device)
        _rotary_kernel[(num_tokens,)](
            q,
            k,
            cos,
            sin,
            q_out,
            k_out,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            NUM_Q=num_q,
            NUM_K=num_k,
            HALF=head_dim // 2,
            BLOCK_H=triton.next_power_of_2(max(num_q, num_k)),
            BLOCK_D=triton.next_power_of_2(head_dim // 2),
            num_warps=4,
            PDL=pdl,
            launch_pdl=pdl,
        )
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2n] = [gate | up] (the packed gate_up projection) -> silu(gate) * up, [..., n]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul_ref's contract."""
    return (silu_and_mul_triton if use_triton(x) else silu_and_mul_ref)(x)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2n] = [gate | up] -> silu(gate) * up, [T, n]."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        pdl = use_pdl(x.device)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, n, BLOCK=block, num_warps=4, PDL=pdl, launch_pdl=pdl
        )
    return out.view(*x.shape[:-1], n)
