"""Quantized KV cache (``--kv-cache-dtype int8|fp8_e4m3``): K and V stored in one byte per element with
a scale per token and KV head, computed from the values themselves when they are written (no
calibration step, no fixed scale).

For a token's head vector ``x`` (``head_dim`` values), ``scale = max|x| / QMAX`` and the stored codes
are ``round(x / scale)`` in int8 (QMAX 127) or ``x / scale`` cast to float8 e4m3 (QMAX 448, the format's
largest finite value); reading multiplies back. Scales are float16 (2 bytes per token per head), kept in
a tensor beside the codes with the same block layout, so a block's scales move with its codes. At
``head_dim`` 64 a token costs 66 bytes per head and K/V instead of 128 in bf16 (1.94x the tokens in the
same memory) or 256 in float32.

The reading side dequantizes the blocks it gathers (``torch_paged._gather_context``), so decode and
prefill attention both see ``codes * scale`` in float32; the compiled CPU decode kernel reads plain
float caches only, so quantized caches take the torch path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8")  # "fp8" is vLLM's alias of fp8_e4m3
_STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float16
_MIN_SCALE = 2.0**-24  # float16's smallest subnormal: an all-zero vector keeps a usable scale


def storage_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The code dtype of ``--kv-cache-dtype`` (None for ``auto``: the model's dtype, unquantized).

    Raises:
        ValueError: an unknown name.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return _STORAGE.get(kv_cache_dtype)


def bytes_per_element_and_head(kv_cache_dtype: str, head_dim: int, model_dtype_bytes: int) -> float:
    """Bytes one token takes per KV head for K (or V): codes plus its share of the scale."""
    if storage_dtype(kv_cache_dtype) is None:
        return head_dim * model_dtype_bytes
    return head_dim + SCALE_DTYPE.itemsize


@dataclass
class QuantizedKVCache:
    """One layer's K (or V) cache: ``codes`` ``[num_blocks, block_size, kv_heads, head_dim]`` in int8 or
    float8 e4m3 and ``scales`` ``[num_blocks, block_size, kv_heads]`` in float16 (views into the pool)."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.codes.dtype

    @property
    def device(self) -> torch.device:
        return self.codes.device


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_dim]`` -> (codes in ``dtype``, scales ``[...]`` float16), one scale per vector."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / _QMAX[dtype]).to(SCALE_DTYPE).clamp_min(_MIN_SCALE)
    scaled = xf / scale.float().unsqueeze(-1)
    if dtype == torch.int8:
        codes = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        codes = scaled.clamp(-_QMAX[dtype], _QMAX[dtype]).to(dtype)
    return codes, scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes ``[..., head_dim]`` and scales ``[...]`` -> float32 values ``[..., head_dim]``."""
    return codes.float() * scales.float().unsqueeze(-1)


def write_quantized(key: torch.Tensor, value: torch.Tensor, k_cache: QuantizedKVCache, v_cache: QuantizedKVCache,
                    slot_mapping: torch.Tensor) -> None:
    """Quantize this step's K/V ``[T, kv_heads, head_dim]`` and scatter them to their slots ``[T]``."""
    num_kv_heads, head_dim = k_cache.codes.shape[-2:]
    for x, cache in ((key, k_cache), (value, v_cache)):
        codes, scales = quantize(x, cache.codes.dtype)
        # Copied as bytes: torch has no index_copy_ for float8 on CPU.
        cache.codes.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping,
                                                                                  codes.view(torch.uint8))
        cache.scales.view(-1, num_kv_heads).index_copy_(0, slot_mapping, scales)


def gather_dequantized(cache: QuantizedKVCache, block_ids: torch.Tensor) -> torch.Tensor:
    """The blocks ``block_ids`` ``[n]`` of a quantized cache as float32 ``[n, block_size, kv_heads, head_dim]``."""
    codes = cache.codes.view(torch.uint8).index_select(0, block_ids).view(cache.codes.dtype)
    return dequantize(codes, cache.scales.index_select(0, block_ids))
