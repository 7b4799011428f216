"""The Attention layer that models call: writes this step's K/V into the paged cache, then attends."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.per_token import per_token_paged_attention
from tokenmill.attention.torch_paged import paged_attention, softcap_paged_attention, write_kv
from tokenmill.attention.triton_attention import triton_paged_attention, triton_write_kv

# One layer's cache: (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    """Paged multi-head / grouped-query attention over a flat token batch.

    forward(q [T, H*D], k [T, KVH*D], v [T, KVH*D], kv_cache, metadata) -> [T, H*D].
    With ``batch_invariant`` set (deterministic mode) every token attends as its own decode query.
    With ``use_triton`` set (by the CUDA runner) K/V writes and attention run in the Triton kernels,
    which read only the device-side fields of the metadata. ``cpu_decode_kernel`` (on by default; the
    CPU runner sets it from measurements and ``--no-cpu-kernels``) lets decode queries on CPU run in
    the compiled paged decode kernel; ``cpu_prefill_kernel`` (off by default; the CPU runner sets it
    from measurements) lets prefill chunks on CPU run in the compiled flash-style prefill kernel.
    ``logit_softcap`` (Gemma 2): scores become ``cap * tanh(scores / cap)`` before the softmax; the compiled
    and Triton kernels do not cap, so such a layer always runs the torch path
    (``torch_paged.softcap_paged_attention``), on CPU only and not in deterministic mode.
    """

    batch_invariant = False
    use_triton = False
    cpu_decode_kernel = True
    cpu_prefill_kernel = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 logit_softcap: float | None = None) -> None:
        super().__init__()
        self.logit_softcap = logit_softcap
        assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        if self.logit_softcap is not None:
            if self.use_triton or self.batch_invariant:
                raise NotImplementedError("attention logit soft-capping (Gemma 2) runs only on the CPU torch path: "
                                          "not on CUDA and not in deterministic mode")
            write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
            out = softcap_paged_attention(q, k_cache, v_cache, metadata, self.scale, self.logit_softcap)
            return out.reshape(num_tokens, self.num_heads * self.head_dim)
        if self.use_triton:
            triton_write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
            out = triton_paged_attention(q, k_cache, v_cache, metadata, self.scale)
            return out.reshape(num_tokens, self.num_heads * self.head_dim)
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        if self.batch_invariant:
            out = per_token_paged_attention(q, k_cache, v_cache, metadata, self.scale)
        else:
            out = paged_attention(q, k_cache, v_cache, metadata, self.scale, self.cpu_decode_kernel,
                                  self.cpu_prefill_kernel)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
