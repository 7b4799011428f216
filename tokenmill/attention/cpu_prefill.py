"""Fast CPU prefill attention: the flash-style C kernel of csrc/paged_prefill.c, built on first use, via ctypes.

Every prefill chunk of a step (a request with more than one query token) attends causally over its
paged context in one call: keys and values are read from the cache blocks as they lie (no gathered
copy, no materialised mask), in tiles with an online softmax. The torch path in ``torch_paged.py``
(SDPA per chunk) is the reference it is tested against; ``tokenmill.runner.cpu_kernels`` times the
two on the model's shapes and keeps the faster. If no C compiler is present, ``available()`` is False.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.csrc_build import DEFAULT_FLAGS, CLibrary

_SOURCE = Path(__file__).parent / "csrc" / "paged_prefill.c"
# FMA contraction for the generic-vector products (C11 mode turns it off by default). No
# reassociation flags: the exp's round-to-integer trick relies on the order as written.
_FLAGS = (*DEFAULT_FLAGS, "-ffp-contract=fast")


def _setup(lib: ctypes.CDLL) -> None:
    p, i32 = ctypes.c_void_p, ctypes.c_int
    # ..., scale, window (0: none), softcap (0: none), num_threads
    argtypes = [p, p, p, p, i32, p, p, p, i32, p, i32, i32, i32, i32, ctypes.c_float, i32, ctypes.c_float, i32]
    for name in ("paged_prefill_f32", "paged_prefill_bf16"):
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = i32
    lib.paged_prefill_isa.argtypes = []
    lib.paged_prefill_isa.restype = ctypes.c_char_p
    lib.paged_prefill_set_dp.argtypes = [ctypes.c_int]  # -1 auto, 0 off, 1 on: the AVX512_BF16 path (tests force it)
    lib.paged_prefill_set_dp.restype = ctypes.c_int
    lib.paged_prefill_vector_width.argtypes = []
    lib.paged_prefill_vector_width.restype = i32


library = CLibrary(_SOURCE, "paged_prefill", _setup, _FLAGS)
# this process's build, or None; tests pin another ISA path's with monkeypatch.setattr(library, "built", ...)
_get_lib = library.built
_load = library.load  # any ISA path's build, not cached (tests compare the paths)
available = library.available


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: CPU, float32 or bfloat16 query and plain (not quantized)
    cache of the same dtype, head_dim a multiple of the build's vector width (16 on AVX-512)."""
    if not (query.device.type == "cpu" and type(k_cache) is torch.Tensor and query.dtype == k_cache.dtype
            and query.dtype in (torch.float32, torch.bfloat16)):
        return False
    lib = library.built()
    return lib is not None and query.shape[-1] % lib.paged_prefill_vector_width() == 0


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> None:
    """Causal attention of every prefill span of ``metadata`` (``metadata.prefills``), written into ``out``.

    query/out: [T, num_heads, head_dim] (the step's flat tokens; rows outside the spans are left as
    they are); caches: [num_blocks, block_size, num_kv_heads, head_dim], already holding this step's
    K/V. Span i's query token j sits at position ``num_context - num_query + j`` and attends to keys
    0 .. that position (softmax(q k^T * scale) v per head; GQA: head h reads kv head h // (H / KVH)).
    ``sliding_window``: the query at position p sees keys p - window < j <= p only (None: all);
    ``logit_softcap``: scores become ``cap * tanh(score / cap)`` before the softmax (Gemma 2; None: none).
    float32 or bfloat16 (scores, softmax and sums in float32), CPU only; see :func:`supports`.

    Raises:
        ValueError: shapes or dtypes the kernel does not take.
        RuntimeError: the kernel is unavailable.
    """
    lib = library.built()
    if lib is None:
        raise RuntimeError("the CPU prefill attention kernel is unavailable")
    return _paged_prefill(lib, query, k_cache, v_cache, metadata, scale, out, sliding_window, logit_softcap)


def _paged_prefill(lib: ctypes.CDLL, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   metadata: AttentionMetadata, scale: float, out: torch.Tensor, sliding_window: int | None = None,
                   logit_softcap: float | None = None) -> None:
    """paged_prefill_attention on a given build of the kernel (tests compare the ISA paths' builds)."""
    assert sliding_window is None or sliding_window >= 1, sliding_window
    assert logit_softcap is None or logit_softcap > 0, logit_softcap
    if not (query.dtype == k_cache.dtype == v_cache.dtype == out.dtype and query.dtype in (torch.float32, torch.bfloat16)):
        raise ValueError(f"paged prefill: query, caches and out must share float32 or bfloat16, got "
                         f"{query.dtype}, {k_cache.dtype}, {v_cache.dtype}, {out.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()) or out.shape != query.shape:
        raise ValueError("paged prefill: caches and out must be contiguous, out shaped as query")
    query = query.contiguous()
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    q_start, q_len, ctx_len, block_table = metadata.prefill_tables
    fn = lib.paged_prefill_bf16 if query.dtype == torch.bfloat16 else lib.paged_prefill_f32
    rc = fn(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), block_table.shape[1],
            q_start.data_ptr(), q_len.data_ptr(), ctx_len.data_ptr(), q_start.shape[0], out.data_ptr(),
            num_heads, num_kv_heads, head_dim, block_size, float(scale), sliding_window or 0,
            float(logit_softcap or 0.0), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"paged prefill: head_dim {head_dim} must be a multiple of "
                         f"{lib.paged_prefill_vector_width()} and num_heads {num_heads} of num_kv_heads {num_kv_heads}")
