"""Paged attention in Triton: the GPU counterpart of ``torch_paged.py``, which is its specification.

Prefill rows use a FlashAttention-style kernel (online softmax over key tiles, float32
accumulators) that gathers K/V straight from the paged cache through each request's block table;
one launch covers every multi-token query of the step. Single-token (decode) rows use a kernel
that reads each K/V row once per KV head for all its query heads and, when there are too few
(sequence, KV head) pairs to fill the GPU, splits each context into partitions whose partial
results a second kernel merges by log-sum-exp (split-KV, as in Flash-Decoding).
Everything the kernels read is a device tensor: a step launches with no host synchronisation.
The kernels themselves live in ``triton_kernels.py``, imported on first use.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import os
from types import ModuleType

import torch

from tokenmill.attention.metadata import AttentionMetadata

# Decode splitting: aim for about this many programs per SM, never splitting below this many keys.
_PROGRAMS_PER_SM = 2
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 32


def available() -> bool:
    """Whether the Triton kernels can run here: triton is importable and either a CUDA device is
    present or TRITON_INTERPRET=1 asks for triton's CPU interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernels() -> ModuleType:
    from tokenmill.attention import triton_kernels

    return triton_kernels


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter has no SMs; a small number keeps its grids small
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_decodes: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Partitions per decode context: enough (sequence, KV head, partition) programs to give
    every SM about ``_PROGRAMS_PER_SM``, but no partition shorter than ``_MIN_KEYS_PER_SPLIT``
    keys of ``max_context`` (an upper bound on any context this step) and at most ``_MAX_SPLITS``.
    Returns 1 (no split) when the sequences alone fill the GPU."""
    programs = max(1, num_decodes * num_kv_heads)
    by_occupancy = -(-_PROGRAMS_PER_SM * num_sms // programs)
    by_length = max_context // _MIN_KEYS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _pow2(n: int, minimum: int = 16) -> int:
    """Power-of-two tile extent covering n; tl.dot needs at least 16."""
    return max(minimum, _next_pow2(n))


def _dot_config(dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_F32, DOT_PRECISION): float32 inputs use exact (not tf32) products so they can be
    checked tightly; the interpreter upcasts every dot (it mishandles bfloat16 operands)."""
    return _interpreted(), "ieee" if dtype == torch.float32 else "tf32"


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache need a contiguous head_dim (stride 1)")


def triton_write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's K/V into the paged cache (the contract of ``torch_paged.write_kv``).

    key/value: [T, num_kv_heads, head_dim], any float dtype (cast to the cache dtype), head_dim
    contiguous; k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [T] int64, ``block_id * block_size + offset``; a negative slot (padding) is skipped.
    All on one device. Raises ValueError on mismatched shapes or devices.
    """
    _check_cache(k_cache, v_cache)
    num_tokens = key.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key/value must be [T, {num_kv_heads}, {head_dim}], got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if len({t.device for t in (key, value, k_cache, v_cache, slot_mapping)}) != 1:
        raise ValueError("key, value, k_cache, v_cache and slot_mapping must be on one device")
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _kernels().write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=_next_pow2(num_kv_heads), BLOCK_D=_next_pow2(head_dim),
    )


def triton_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of this step's queries over each request's paged context
    (the contract of ``torch_paged.paged_attention``).

    query: [T, num_heads, head_dim] float32/bfloat16/float16, head_dim contiguous;
    k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], already holding this step's
    K/V (see :func:`triton_write_kv`); num_heads must be a multiple of num_kv_heads.
    Reads metadata.query_start_loc [B + 1], seq_lens [B], block_table [B, max_blocks] (all int64,
    on query's device) plus the host-side counts ``metadata.num_prefills`` and
    ``metadata.decode_token_idx.shape[0]``. num_splits: decode partitions per context (None: chosen
    by :func:`choose_num_splits`). ``sliding_window``: a query at position p sees keys p - window < j <= p
    only (None: all keys up to p). ``logit_softcap`` (Gemma 2): scores ``q.k * scale`` become
    ``cap * tanh(score / cap)`` before the mask and softmax (None: no cap). Returns [T, num_heads, head_dim]
    in query's dtype.
    Raises ValueError on mismatched shapes, dtypes or devices.
    """
    _check_cache(k_cache, v_cache)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"query dtype must be float32, bfloat16 or float16, got {query.dtype}")
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query [T, {num_heads}, {head_dim}] does not fit a cache with {num_kv_heads} KV heads "
            f"of dim {cache_head_dim}"
        )
    if block_size != metadata.block_size:
        raise ValueError(f"cache block_size {block_size} != metadata.block_size {metadata.block_size}")
    if metadata.slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"query has {num_tokens} tokens, metadata has {metadata.slot_mapping.shape[0]}")
    meta = (metadata.query_start_loc, metadata.seq_lens, metadata.block_table)
    if any(t.device != query.device for t in (k_cache, v_cache, *meta)):
        raise ValueError("query, caches, query_start_loc, seq_lens and block_table must be on one device")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be > 0, got {logit_softcap}")

    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    query_start_loc, seq_lens, block_table = (t.contiguous() for t in meta)
    group = num_heads // num_kv_heads
    dot_f32, dot_precision = _dot_config(query.dtype)
    common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_D=_pow2(head_dim),
                  DOT_F32=dot_f32, DOT_PRECISION=dot_precision, SLIDING=sliding_window is not None,
                  SOFTCAP=logit_softcap is not None)
    window = sliding_window or 0
    softcap_log2e = (logit_softcap or 1.0) * math.log2(math.e)  # unread without SOFTCAP
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    num_reqs = seq_lens.shape[0]
    scale_log2e = scale * math.log2(math.e)

    num_prefills = metadata.num_prefills
    if num_prefills:
        block_m, block_n, warps, stages = _prefill_tiles(head_dim, query.dtype)
        # Each prefill owns ceil(len / block_m) tiles: at most T / block_m in total plus one per prefill.
        grid = (-(-num_tokens // block_m) + num_prefills, num_heads)
        _kernels().prefill_kernel[grid](
            query, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
            scale_log2e, num_reqs, window, softcap_log2e,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), *cache_strides, block_table.stride(0),
            BLOCK_R=_pow2(num_reqs), BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=warps, num_stages=stages, **common,
        )

    num_decodes = metadata.decode_token_idx.shape[0]
    if num_decodes:
        max_context = block_table.shape[1] * block_size
        if sliding_window is not None:  # a decode query reads at most its window
            max_context = min(max_context, sliding_window)
        splits = num_splits or choose_num_splits(num_decodes, num_kv_heads, max_context, _num_sms(query.device))
        _decode(query, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, scale_log2e, splits,
                cache_strides, common, window, softcap_log2e)
    return out


def _prefill_tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Small tiles under the interpreter exercise the
    multi-tile paths cheaply."""
    if _interpreted():
        return 16, 16, 4, 1
    if dtype == torch.float32 or head_dim > 128:
        return 64, 32, 4, 1
    return 64, 64, 4, 2


def _decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
    scale_log2e: float, num_splits: int, cache_strides: tuple[int, ...], common: dict, window: int,
    softcap_log2e: float,
) -> None:
    """Launch decode_kernel over (B, KVH, num_splits) and, when split, reduce_kernel over (B, H).
    ``window``: the sliding window when ``common["SLIDING"]`` (else unread); ``softcap_log2e``: the logit cap
    times log2(e) when ``common["SOFTCAP"]`` (else unread)."""
    num_reqs = seq_lens.shape[0]
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    block_n = 16 if _interpreted() else 64
    split = num_splits > 1
    if split:
        part_out = torch.empty(num_reqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_strides = (*part_out.stride()[:3], *part_lse.stride()[:2])
    else:  # the kernel writes the output directly; these arguments are never read
        part_out, part_lse, part_strides = out, out, (0, 0, 0, 0, 0)
    _kernels().decode_kernel[(num_reqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, part_out, part_lse, query_start_loc, seq_lens, block_table,
        scale_log2e, num_splits, window, softcap_log2e,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), *cache_strides, block_table.stride(0),
        *part_strides,
        BLOCK_G=_pow2(common["GROUP"]), BLOCK_N=block_n, SPLIT=split, num_warps=4, num_stages=2, **common,
    )
    if split:
        _kernels().reduce_kernel[(num_reqs, num_heads)](
            out, part_out, part_lse, query_start_loc, num_splits,
            out.stride(0), out.stride(1), *part_strides,
            HEAD_DIM=head_dim, BLOCK_S=_next_pow2(num_splits), BLOCK_D=_next_pow2(head_dim),
        )
