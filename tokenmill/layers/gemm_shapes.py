"""A bounded set of GEMM shapes for torch's half-precision CPU matmuls.

On a CPU with bf16 support torch sends bf16/f16 matmuls through oneDNN, which JIT-compiles a kernel for
each new GEMM shape and caches it (about 1.6 MiB of code and descriptors each, up to 1024 of them). A
server's row count changes with nearly every step (the tokens it schedules), so with exact shapes its
resident memory grew step after step toward that bound (benchmarks/soak.py, issue 44). ``gemm_rows`` maps a
row count to a bucket (powers of two up to 256 rows, then eight buckets per doubling: at most 12.5 % padding)
and ``bounded_linear`` / ``bounded_bmm`` run products at those row counts only, padding with zero rows they
drop afterwards: a weight sees about 9 + 8 per doubling shapes (41 up to 4096 rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_ONEDNN = torch.backends.mkldnn.is_available()


def gemm_rows(rows: int) -> int:
    """The row count a GEMM runs at for ``rows`` (>= 1) real rows: the next power of two up to 256; above,
    the next multiple of 1/8 of the power of two below ``rows`` (257 -> 288, 1000 -> 1024, 1025 -> 1152)."""
    if rows <= 256:
        return 1 << (rows - 1).bit_length()
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def needs_bounded_shapes(x: torch.Tensor) -> bool:
    """Whether a product on ``x`` goes through a per-shape kernel cache: a half-precision CPU tensor while
    torch's oneDNN is on."""
    return (_ONEDNN and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
            and torch._C._get_mkldnn_enabled())


def bounded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` run at ``gemm_rows`` rows when ``x`` goes through oneDNN's per-shape kernel
    cache (``needs_bounded_shapes``; otherwise as it is): x [T, in] -> [T, out]. A row count off the buckets is
    copied into a zero-padded buffer first; every row's result is computed as in an unpadded product at the
    bucket's row count. float32 is never padded: BLAS may round another row count differently (MKL on a Zen 1
    EPYC gave 3 rows other bits than 4)."""
    rows = x.shape[0]
    padded_rows = gemm_rows(rows) if rows else 0
    if padded_rows == rows or not needs_bounded_shapes(x):
        return F.linear(x, weight, bias)
    padded = x.new_zeros(padded_rows, x.shape[1])
    padded[:rows] = x
    return F.linear(padded, weight, bias)[:rows]


def bounded_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` (a [B, T, K], b [B, K, N] -> [B, T, N]) with T padded up to ``gemm_rows(T)`` when
    ``a`` is a half-precision CPU tensor (``needs_bounded_shapes``); the padding rows are dropped."""
    rows = a.shape[1]
    if rows == 0 or not needs_bounded_shapes(a) or gemm_rows(rows) == rows:
        return torch.bmm(a, b)
    padded = a.new_zeros(a.shape[0], gemm_rows(rows), a.shape[2])
    padded[:, :rows] = a
    return torch.bmm(padded, b)[:, :rows]
