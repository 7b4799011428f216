"""A bounded set of GEMM shapes for torch's half-precision CPU matmuls.

On a CPU with bf16 support torch sends bf16/f16 matmuls through oneDNN, which JIT-compiles a kernel for
each new GEMM shape and caches it (about 1.6 MiB of code and descriptors each, up to 1024 of them). A
server's row count changes with nearly every step (the tokens it schedules), so with exact shapes its
resident memory grew step after step toward that bound (benchmarks/soak.py, issue 44). ``gemm_rows`` maps a
row count to one of a few dozen buckets and ``bounded_linear`` runs a product at those row counts only: the
rows in 256-row pieces, the last piece padded up to its bucket, so each weight sees at most nine shapes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PIECE_ROWS = 256  # bounded_linear's pieces: the largest bucket a product runs at
_ONEDNN = torch.backends.mkldnn.is_available()


def gemm_rows(rows: int) -> int:
    """The row count a GEMM runs at for ``rows`` (>= 1) real rows: the next power of two up to 256, then the
    next multiple of 256. Padding rows are dropped by the caller."""
    if rows <= PIECE_ROWS:
        return 1 << (rows - 1).bit_length()
    return -(-rows // PIECE_ROWS) * PIECE_ROWS


def needs_bounded_shapes(x: torch.Tensor) -> bool:
    """Whether a product on ``x`` goes through a per-shape kernel cache: a half-precision CPU tensor while
    torch's oneDNN is on."""
    return (_ONEDNN and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
            and torch._C._get_mkldnn_enabled())


def bounded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` run only at the row counts 1, 2, 4, ..., 256: x [T, in] -> [T, out].

    Full 256-row pieces run in place; the rest (fewer than 256 rows) is copied into a zero-padded buffer of
    ``gemm_rows`` rows. Every row's result is computed the same way as in an unpadded product of that piece.
    """
    rows = x.shape[0]
    if rows == 0 or (rows <= PIECE_ROWS and gemm_rows(rows) == rows):
        return F.linear(x, weight, bias)
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device)
    full = rows - rows % PIECE_ROWS
    w_t = weight.t()
    for start in range(0, full, PIECE_ROWS):
        piece, dest = x[start : start + PIECE_ROWS], out[start : start + PIECE_ROWS]
        if bias is None:
            torch.mm(piece, w_t, out=dest)
        else:
            torch.addmm(bias, piece, w_t, out=dest)  # the bias inside the product, as F.linear adds it
    tail = rows - full
    if tail:
        padded = x.new_zeros(gemm_rows(tail), x.shape[1])
        padded[:tail] = x[full:]
        out[full:] = F.linear(padded, weight, bias)[:tail]
    return out


def bounded_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` (a [B, T, K], b [B, K, N] -> [B, T, N]) with T padded up to ``gemm_rows(T)`` when
    ``a`` is a half-precision CPU tensor (``needs_bounded_shapes``); the padding rows are dropped."""
    rows = a.shape[1]
    if rows == 0 or not needs_bounded_shapes(a) or gemm_rows(rows) == rows:
        return torch.bmm(a, b)
    padded = a.new_zeros(a.shape[0], gemm_rows(rows), a.shape[2])
    padded[:, :rows] = a
    return torch.bmm(padded, b)[:, :rows]
