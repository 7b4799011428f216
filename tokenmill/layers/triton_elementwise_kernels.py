"""Triton device code for the fused elementwise layers: RMSNorm, SiLU-and-multiply, rotary embedding.

Only ``@triton.jit`` kernels live here; grids, block sizes and checks are chosen by
``triton_elementwise.py``, the only caller. Each kernel rounds to the activation dtype wherever
the torch layer it replaces rounds (every torch op on bf16 computes in float32 and rounds its
result), so bf16 outputs match the torch path up to float32 summation order.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, eps, num_heads, stride_x_t, stride_x_h,
    N: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row (token, head): out = weight * to_dtype(x * rsqrt(mean(x^2) + eps))."""
    row = tl.program_id(0)
    t = row // num_heads
    h = row % num_heads
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + t * stride_x_t + h * stride_x_h + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, 0) / N
    normed = (x32 * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)  # HF: cast before the weight
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (weight.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + cols, out, mask=mask)


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, stride_x, intermediate, BLOCK: tl.constexpr):
    """Grid (T, column blocks): out[t, j] = to_dtype(to_dtype(silu(gate)) * up) for x = [gate | up]."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * intermediate + cols, (act * up).to(dtype), mask=mask)


@triton.jit
def rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, stride_x_t, stride_x_h, stride_cos_t, stride_sin_t,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per token, all heads: out = [x1*cos - x2*sin, x2*cos + x1*sin], rounding each
    product and sum to the activation dtype as the torch expression does; out is [T, H, 2*HALF]."""
    t = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HALF
    mask = (heads < num_heads)[:, None] & dim_ok[None, :]  # (BLOCK_H, BLOCK_D)
    src = x_ptr + t * stride_x_t + heads[:, None] * stride_x_h + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_cos_t + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_sin_t + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    first = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    second = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    dst = out_ptr + t * num_heads * 2 * HALF + heads[:, None] * 2 * HALF + dims[None, :]
    tl.store(dst, first, mask=mask)
    tl.store(dst + HALF, second, mask=mask)
