"""Batch-invariant linear and RMSNorm for the deterministic mode: C kernels (csrc/batch_invariant.c) via ctypes.

Each output row depends only on its own input row and the weights, bit for bit, whatever else is in
the batch and however many threads run (torch's F.linear does not promise this on CPU). The kernels
are built on first use; without a C compiler ``available()`` is False.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokenmill.csrc_build import DEFAULT_FLAGS, CLibrary

_SOURCE = Path(__file__).parent / "csrc" / "batch_invariant.c"
# No -ffast-math, no FMA contraction: the summation order written in the C file is the one that runs.
_FLAGS = (*DEFAULT_FLAGS, "-ffp-contract=off")
_DTYPES = (torch.bfloat16, torch.float32)


def _setup(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("bi_linear_bf16", "bi_linear_bf16_f32out", "bi_linear_f32"):
        getattr(lib, name).argtypes = [p, p, p, p, i64, i64, i64, i32]
        getattr(lib, name).restype = None
    for name in ("bi_linear_heads_bf16", "bi_linear_heads_f32"):
        getattr(lib, name).argtypes = [p, p, p, i64, i64, i64, i64, i64, i32]
        getattr(lib, name).restype = None
    for name in ("bi_rms_norm_bf16", "bi_rms_norm_f32"):
        getattr(lib, name).argtypes = [p, p, p, i64, i64, ctypes.c_float, i32]
        getattr(lib, name).restype = None
    lib.bi_isa.argtypes = []
    lib.bi_isa.restype = ctypes.c_char_p


library = CLibrary(_SOURCE, "batch_invariant", _setup, _FLAGS, unavailable=(
    "batch-invariant CPU kernels are unavailable (no C compiler, build failed, or TOKENMILL_DISABLE_CPU_KERNELS=1)"))
# this process's build (None, or RuntimeError from _get_lib, when unavailable); tests pin another ISA
# path's with monkeypatch.setattr(library, "built", ...)
_built = library.built
_get_lib = library.get
_load = library.load  # any ISA path's build, not cached (tests compare the paths)
available = library.available


def isa() -> str:
    """The ISA path the build uses: "avx512_bf16", "avx512", "avx2", "neon" or "portable"
    (``tokenmill.csrc_build``; the build follows ``csrc_build.selected_isa()``).

    Raises:
        RuntimeError: the kernels are not available.
    """
    return library.get().bi_isa().decode()


def bi_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """y = x @ weight.T + bias, with each row of y bitwise independent of the other rows of x.

    x: [M, K] (M may be 0; made contiguous if it is not); weight: [N, K], contiguous; bias: [N] or None.
    All three bfloat16 or all float32, on CPU. Products are accumulated in float32 in a fixed order
    (the C file's "canonical order"), the bias is added in float32, and the sum is rounded once to
    ``out_dtype`` (default x's dtype; nearest even for bf16). ``out_dtype=torch.float32`` with
    bfloat16 inputs keeps the float32 sums unrounded (the LM head's logits). Row m of the result
    depends only on x[m], weight and bias: not on M, m, the other rows or torch.get_num_threads()
    (the thread count the kernel uses).

    Returns [M, N] in ``out_dtype``.

    Raises:
        ValueError: wrong dimensions, mismatched K or bias size, dtypes that differ or are not
            bfloat16/float32, an ``out_dtype`` other than x's dtype or float32, a non-CPU tensor, or
            a non-contiguous weight.
        RuntimeError: the kernels are not available (check ``available()`` first).
    """
    return _linear(library.get(), x, weight, bias, out_dtype)


def _linear(
    lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"bi_linear: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    (M, K), (N, Kw) = x.shape, weight.shape
    if K != Kw:
        raise ValueError(f"bi_linear: x has K={K} but weight has K={Kw}")
    dtype = x.dtype
    if dtype not in _DTYPES or weight.dtype != dtype or (bias is not None and bias.dtype != dtype):
        got = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        raise ValueError(f"bi_linear: x, weight and bias must all be bfloat16 or all float32, got {got}")
    if x.device.type != "cpu" or weight.device.type != "cpu" or (bias is not None and bias.device.type != "cpu"):
        raise ValueError("bi_linear: tensors must be on the CPU")
    if not weight.is_contiguous():
        raise ValueError("bi_linear: weight must be contiguous")
    if bias is not None:
        if bias.shape != (N,):
            raise ValueError(f"bi_linear: bias must be [{N}], got {tuple(bias.shape)}")
        bias = bias.contiguous()
    out_dtype = dtype if out_dtype is None else out_dtype
    if out_dtype not in (dtype, torch.float32):
        raise ValueError(f"bi_linear: out_dtype must be {dtype} or torch.float32, got {out_dtype}")
    x = x.contiguous()
    out = torch.empty((M, N), dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    if dtype == torch.float32:
        fn = lib.bi_linear_f32
    else:
        fn = lib.bi_linear_bf16 if out_dtype == torch.bfloat16 else lib.bi_linear_bf16_f32out
    fn(
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        M, N, K, torch.get_num_threads(),
    )
    return out


def bi_linear_heads(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One product per head, in one C call: y[h] = x[h] @ weight[h].T, each head with the bits of
    ``bi_linear(x[h], weight[h].contiguous())`` (row-invariant likewise).

    x: [H, M, K] (made contiguous if it is not); weight: [H, N, K] whose every head is a contiguous [N, K]
    slab (any head stride: a view of a wider per-head layout reads in place); both bfloat16 or both float32,
    on CPU. Decode-sized M runs all heads in one parallel region (csrc ``linear_heads``). Multi-head latent
    attention's absorbed products use it (models/deepseek.py).

    Returns [H, M, N] in x's dtype.

    Raises:
        ValueError: wrong dimensions, mismatched H or K, dtypes that differ or are not bfloat16/float32, a
            non-CPU tensor, or heads that are not contiguous slabs.
        RuntimeError: the kernels are not available.
    """
    return _linear_heads(library.get(), x, weight)


def _linear_heads(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.dim() != 3 or weight.dim() != 3 or x.shape[0] != weight.shape[0] or x.shape[2] != weight.shape[2]:
        raise ValueError(f"bi_linear_heads: x must be [H, M, K] and weight [H, N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"bi_linear_heads: x and weight must both be bfloat16 or both float32, got {x.dtype} and "
                         f"{weight.dtype}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError("bi_linear_heads: tensors must be on the CPU")
    (H, M, K), N = x.shape, weight.shape[1]
    if weight.stride(2) != 1 or (N > 1 and weight.stride(1) != K) or weight.stride(0) < N * K:
        raise ValueError("bi_linear_heads: each head of weight must be a contiguous [N, K] slab")
    x = x.contiguous()
    out = torch.empty((H, M, N), dtype=x.dtype)
    if H and M and N:
        fn = lib.bi_linear_heads_f32 if x.dtype == torch.float32 else lib.bi_linear_heads_bf16
        fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), H, M, N, K, weight.stride(0), torch.get_num_threads())
    return out


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension with each row computed alone (row-invariant by construction).

    x: [M, H] (made contiguous if it is not); weight: [H]; both bfloat16 or both float32, on CPU.
    Follows layers/layernorm.py's RMSNorm in value order: the mean of squares in float32 (fixed
    summation order), ``x * rsqrt(var + eps)`` in float32 rounded to x's dtype, then multiplied by
    the weight and rounded again (bf16 * bf16 -> bf16, as torch). Close to, not bit-equal with,
    the torch module.

    Returns [M, H] in x's dtype.

    Raises:
        ValueError: wrong dimensions or sizes, dtypes that differ or are not bfloat16/float32, or a
            non-CPU tensor.
        RuntimeError: the kernels are not available.
    """
    return _rms_norm(library.get(), x, weight, eps)


def _rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"bi_rms_norm: x must be [M, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"bi_rms_norm: x and weight must both be bfloat16 or both float32, got {x.dtype} and {weight.dtype}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError("bi_rms_norm: tensors must be on the CPU")
    x = x.contiguous()
    weight = weight.contiguous()
    M, H = x.shape
    out = torch.empty_like(x)
    if M == 0 or H == 0:
        return out
    fn = lib.bi_rms_norm_bf16 if x.dtype == torch.bfloat16 else lib.bi_rms_norm_f32
    fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), M, H, float(eps), torch.get_num_threads())
    return out
