"""Fast CPU decode attention: a small C kernel (csrc/paged_decode.c) built on first use, called via ctypes.

The kernel reads each sequence's K/V straight from the paged cache (no gather copy) and is
compared against the torch reference in torch_paged.py by tests. If no C compiler is present,
``available()`` is False and callers use the reference path.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokenmill.csrc_build import DEFAULT_FLAGS, CLibrary

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# Attention does not promise a summation order, so the compiler may reassociate. These are -ffast-math's
# parts less -ffinite-math-only (NaN and inf must propagate as torch's do); -ffast-math itself would
# link gcc's crtfastmath.o, whose constructor turns on flush-to-zero for the whole process on load.
_FLAGS = (*DEFAULT_FLAGS, "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
          "-freciprocal-math")


def _setup(lib: ctypes.CDLL) -> None:
    # ..., scale, window (0: none), softcap (0: none), num_threads
    argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_int]
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    lib.paged_decode_isa.argtypes = []
    lib.paged_decode_isa.restype = ctypes.c_char_p
    lib.paged_decode_set_dp.argtypes = [ctypes.c_int]  # -1 auto, 0 off, 1 on: the AVX512_BF16 path (tests force it)
    lib.paged_decode_set_dp.restype = ctypes.c_int


library = CLibrary(_SOURCE, "paged_decode", _setup, _FLAGS)
# this process's build, or None; tests pin another ISA path's with monkeypatch.setattr(library, "built", ...)
_get_lib = library.built
_load = library.load  # any ISA path's build, not cached (tests compare the paths)
available = library.available


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention straight from the paged cache.

    query: [B, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    block_table: [B, max_blocks] int64; seq_lens: [B] int64 (keys per sequence, >= 1).
    ``sliding_window``: the query at position p = seq_len - 1 sees keys p - window < j <= p only (None: all).
    ``logit_softcap``: scores become ``cap * tanh(score / cap)`` before the softmax (Gemma 2; None: none).
    Returns [B, num_heads, head_dim] in query's dtype. dtype float32 or bfloat16, CPU only; num_heads a
    multiple of num_kv_heads. A sequence's output depends only on its own query, keys and values.
    """
    lib = library.built()
    assert lib is not None, "CPU decode kernel is not available"
    return _paged_decode(lib, query, k_cache, v_cache, block_table, seq_lens, scale, sliding_window, logit_softcap)


def _paged_decode(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """paged_decode_attention on a given build of the kernel (tests compare the ISA paths' builds)."""
    assert sliding_window is None or sliding_window >= 1, sliding_window
    assert logit_softcap is None or logit_softcap > 0, logit_softcap
    assert query.dtype == k_cache.dtype == v_cache.dtype and query.dtype in (torch.float32, torch.bfloat16)
    query = query.contiguous()
    block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0
    out = torch.empty_like(query)
    fn = lib.paged_decode_bf16 if query.dtype == torch.bfloat16 else lib.paged_decode_f32
    fn(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), seq_lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_table.shape[1],
        float(scale), sliding_window or 0, float(logit_softcap or 0.0), torch.get_num_threads(),
    )
    return out
