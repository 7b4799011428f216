"""The fused Triton RMSNorm, SiLU-and-multiply and RoPE kernels against the torch layers they replace.

On a CUDA machine the compiled kernels run; elsewhere triton's interpreter runs them on CPU
(TRITON_INTERPRET=1 is set before triton is imported, as in test_triton_attention.py; if triton
was imported earlier in this process, the tests rerun this file in a fresh interpreter). float32
must match to float32 rounding. bfloat16 gets slack: on a GPU one bf16 step (summation order and
exp() may differ in the last bit; RoPE must match bit for bit), under the interpreter four (it
converts float32 to bfloat16 by truncation, not rounding, at every cast).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported; process-wide, harmless on CPU

triton_language = pytest.importorskip("triton.language")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from tests.triton_interpreter import rerun_in_interpreter  # noqa: E402
from tokenmill.layers import RMSNorm, SiluAndMul, apply_rotary_emb  # noqa: E402
from tokenmill.layers.triton_elementwise import triton_rms_norm, triton_rotary, triton_silu_and_mul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNNABLE = DEVICE == "cuda" or isinstance(triton_language.cdiv, InterpretedFunction)
needs_kernels = pytest.mark.skipif(not RUNNABLE, reason="triton imported before TRITON_INTERPRET=1: see the fresh run")
DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.skipif(RUNNABLE, reason="the tests run in this process")
def test_in_fresh_interpreter():
    rerun_in_interpreter(__file__)


def assert_close_to_layer(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """float32: float32 rounding; bfloat16: one bf16 step (2**-7 of max(scale, 1/4), scale
    defaulting to |value|) on a GPU, four under the interpreter."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        steps = 1 if DEVICE == "cuda" else 4
        slack = (want.float().abs() if scale is None else scale).clamp_min(0.25) * 2**-7 * steps
        error = (got.float() - want.float()).abs()
        assert (error <= slack).all(), f"max error {error.max()}"


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_strided_rows_and_heads(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5).to(DEVICE, dtype)
    norm.weight.copy_(torch.randn(96, generator=gen))
    x = torch.randn(7, 200, generator=gen).to(DEVICE, dtype)[:, 10:106]  # rows of a wider projection
    assert_close_to_layer(triton_rms_norm(x, norm.weight, 1e-5), norm(x))
    head_norm = RMSNorm(32).to(DEVICE, dtype)
    head_norm.weight.copy_(torch.randn(32, generator=gen))
    heads = torch.randn(5, 9, 40, generator=gen).to(DEVICE, dtype)[:, 1:8, 4:36]  # (T, H, D), strided
    assert_close_to_layer(triton_rms_norm(heads, head_norm.weight, 1e-6), head_norm(heads))
    assert triton_rms_norm(x[:0], norm.weight, 1e-5).shape == (0, 96)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(6, 2 * 1100, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype) * 4
    assert_close_to_layer(triton_silu_and_mul(x), SiluAndMul()(x))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_the_fused_qk_slice(dtype):
    gen = torch.Generator().manual_seed(2)
    head_dim, heads, kv_heads, tokens = 32, 6, 2, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim]  # what LlamaAttention rotates in one pass
    cos_sin = torch.randn(tokens, head_dim, generator=gen).to(DEVICE, dtype).unsqueeze(1)
    cos, sin = cos_sin.chunk(2, dim=-1)  # (T, 1, D/2) views, as RotaryEmbedding returns them
    got = triton_rotary(qk, cos, sin, head_dim)
    want = apply_rotary_emb(qk, cos, sin, head_dim)
    assert got.is_contiguous() and got.shape == (tokens, heads + kv_heads, head_dim)
    if DEVICE == "cuda":  # same per-op rounding to nearest: bit for bit
        assert torch.equal(got, want)
    # Each output is a difference or sum of two products: errors scale with the products' size.
    x = qk.view(tokens, -1, head_dim).float().abs()
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.float().abs(), sin.float().abs()
    assert_close_to_layer(got, want, scale=torch.cat((x1 * c + x2 * s, x2 * c + x1 * s), dim=-1))
    assert torch.equal(apply_rotary_emb(qk, cos, sin, head_dim, use_triton=True), got)
