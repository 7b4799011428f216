"""The Attention layer that models call: writes this step's K/V into the paged cache, then attends."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.per_token import per_token_paged_attention
from tokenmill.attention.torch_paged import paged_attention, write_kv, write_latent
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
    from measurements) lets prefill chunks on CPU run in the compiled flash-style prefill kernel, in steps
    whose longest prompt context is at most ``cpu_prefill_max_context`` tokens (0: any; longer contexts run
    SDPA, which the plan measured faster there).
    ``sliding_window`` (Mistral, Qwen2, Phi-3, Gemma's local layers): a query at position p attends to keys
    p - window < j <= p only, as transformers' sliding-window masks; every path takes it (torch reference, the
    compiled CPU decode and prefill kernels, the deterministic per-token path, Triton). Keys below the window
    stay in the cache (their blocks are not freed). ``logit_softcap`` (Gemma 2): scores become
    ``cap * tanh(scores / cap)`` before the softmax, on every path (the CPU ones and the Triton kernels).
    ``latent_cache`` (multi-head latent attention, models/deepseek.py): the layer's cache is one plane (both
    tensors of ``kv_cache`` are the same view) holding one vector per token, read as the key and as the value
    (num_kv_heads 1); forward writes ``k`` once and ignores ``v``, and every CPU path attends as MQA.
    """

    batch_invariant = False
    use_triton = False
    cpu_decode_kernel = True
    cpu_prefill_kernel = False
    cpu_prefill_max_context = 0

    def prefill_kernel_takes(self, metadata: AttentionMetadata) -> bool:
        """Whether this step's prompt chunks run in the C prefill kernel (``cpu_prefill_kernel`` and every
        chunk's context within ``cpu_prefill_max_context``)."""
        if not self.cpu_prefill_kernel:
            return False
        limit = self.cpu_prefill_max_context
        return not limit or max((span.num_context for span in metadata.prefills), default=0) <= limit

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 logit_softcap: float | None = None, sliding_window: int | None = None,
                 latent_cache: bool = False) -> None:
        super().__init__()
        assert not latent_cache or num_kv_heads == 1, "a latent cache has one KV head"
        self.latent_cache = latent_cache
        assert sliding_window is None or sliding_window >= 1, sliding_window
        self.logit_softcap = logit_softcap
        self.sliding_window = sliding_window
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
        if self.use_triton:
            if self.latent_cache:
                raise NotImplementedError("latent attention (MLA) has no Triton kernels: it runs on the CPU only")
            triton_write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
            out = triton_paged_attention(q, k_cache, v_cache, metadata, self.scale, sliding_window=self.sliding_window,
                                         logit_softcap=self.logit_softcap)
            return out.reshape(num_tokens, self.num_heads * self.head_dim)
        if self.latent_cache:  # one plane: the latent is both key and value
            write_latent(k, k_cache, metadata.slot_mapping)
            v_cache = k_cache
        else:
            write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        if self.batch_invariant:
            out = per_token_paged_attention(q, k_cache, v_cache, metadata, self.scale, self.sliding_window,
                                            self.logit_softcap)
        else:
            out = paged_attention(q, k_cache, v_cache, metadata, self.scale, self.cpu_decode_kernel,
                                  self.prefill_kernel_takes(metadata), self.sliding_window, self.logit_softcap)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
