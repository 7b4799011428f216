"""Fused elementwise layers in Triton for the CUDA path: RMSNorm, SiLU-and-multiply, rotary embedding.

In eager torch each of these is 2–9 kernels (casts, powers, means, products, a concatenation); at
small decode batches the launches, not the bytes, set the step time. Each function here is one
kernel with the torch layer's contract and rounding (the torch layers stay the specification and
the CPU path). Used when the CUDA runner sets ``use_triton`` on the layers. Importing this module
does not import triton; the kernels (``triton_elementwise_kernels.py``) load on first use.
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch


@functools.cache
def _kernels() -> ModuleType:
    from tokenmill.layers import triton_elementwise_kernels

    return triton_elementwise_kernels


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, as ``layers.layernorm.RMSNorm``.

    x: [T, N] or [T, H, N] with a contiguous last dimension (any row strides, e.g. a slice of a
    fused projection); weight: [N]. Returns a new contiguous tensor of x's shape in
    ``promote(weight.dtype, x.dtype)``.
    """
    assert x.dim() in (2, 3) and x.stride(-1) == 1, (tuple(x.shape), x.stride())
    num_cols = x.shape[-1]
    num_heads = x.shape[1] if x.dim() == 3 else 1
    stride_h = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    num_rows = x.shape[0] * num_heads
    if num_rows:
        block = _next_pow2(num_cols)
        _kernels().rms_norm_kernel[(num_rows,)](
            x, weight, out, eps, num_heads, x.stride(0), stride_h,
            N=num_cols, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    return out


def triton_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up]: [T, 2I] (contiguous last dimension) -> [T, I], x's dtype."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0, (tuple(x.shape), x.stride())
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, intermediate, dtype=x.dtype, device=x.device)
    if num_tokens:
        block = min(1024, _next_pow2(intermediate))
        _kernels().silu_and_mul_kernel[(num_tokens, -(-intermediate // block))](
            x, out, x.stride(0), intermediate, BLOCK=block, num_warps=4,
        )
    return out


def triton_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rotate-half RoPE, as ``layers.rotary_embedding.apply_rotary_emb``.

    x: [T, H * head_dim] or [T, H, head_dim] with a contiguous last dimension (any row stride);
    cos/sin: [T, 1, head_dim // 2] in x's dtype (what ``RotaryEmbedding`` returns). Returns a new
    contiguous [T, H, head_dim] tensor.
    """
    x = x.view(x.shape[0], -1, head_dim)  # (T, H, D)
    assert x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    num_tokens, num_heads, _ = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        half = head_dim // 2
        _kernels().rotary_kernel[(num_tokens,)](
            x, cos, sin, out, num_heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            HALF=half, BLOCK_H=_next_pow2(num_heads), BLOCK_D=_next_pow2(half), num_warps=4,
        )
    return out
