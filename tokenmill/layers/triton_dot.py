"""The block product the Triton GEMM kernels share (LoRA shrink/expand, the MoE grouped expert step).
Importing this module imports triton."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ b accumulated in float32, a rounded to b's dtype first. DOT_F32 upcasts both operands (triton's
    interpreter multiplies bfloat16 operands as raw integers); DOT_PRECISION is tl.dot's input_precision."""
    a = a.to(b.dtype)
    if DOT_F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=DOT_PRECISION)
    return out
