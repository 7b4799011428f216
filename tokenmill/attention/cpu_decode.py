"""Fast CPU decode attention: a small C kernel (csrc/paged_decode.c) built on first use, called via ctypes.

The kernel reads each sequence's K/V straight from the paged cache (no gather copy) and is
compared against the torch reference in torch_paged.py by tests. If no C compiler is present,
``available()`` is False and callers use the reference path.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from tokenmill.csrc_build import load_c_library

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# -ffast-math is fine here: attention does not promise a summation order.
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11")


def _setup(lib: ctypes.CDLL) -> None:
    argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None


@functools.cache
def _get_lib() -> ctypes.CDLL | None:
    return load_c_library(_SOURCE, "paged_decode", _setup, _FLAGS)


def available() -> bool:
    """True if the compiled kernel can be used in this process."""
    return _get_lib() is not None


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention straight from the paged cache.

    query: [B, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    block_table: [B, max_blocks] int64; seq_lens: [B] int64 (keys per sequence, >= 1).
    Returns [B, num_heads, head_dim] in query's dtype. dtype float32 or bfloat16, CPU only.
    """
    lib = _get_lib()
    assert lib is not None, "CPU decode kernel is not available"
    assert query.dtype == k_cache.dtype == v_cache.dtype and query.dtype in (torch.float32, torch.bfloat16)
    query = query.contiguous()
    block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(query)
    fn = lib.paged_decode_bf16 if query.dtype == torch.bfloat16 else lib.paged_decode_f32
    fn(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), seq_lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_table.shape[1],
        float(scale), torch.get_num_threads(),
    )
    return out
