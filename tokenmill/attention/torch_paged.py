"""Reference paged attention in plain torch (runs on CPU): write K/V through slot_mapping, read through block tables.

Decode queries (one token) are batched into one masked float32 softmax; each prefill chunk runs its
own SDPA over its cached prefix plus the chunk. Per layer, a sliding window (keys p - window < j <= p)
and Gemma 2's logit soft-capping change the masks and scores. A GPU backend must match this numerically. On CPU
the compiled kernels take over where the runner's plan says they are faster: decode queries in
``cpu_decode``, prefill chunks in ``cpu_prefill`` (flash-style, straight from the paged cache).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tokenmill.attention import cpu_decode, cpu_prefill
from tokenmill.attention.kv_quant import QuantizedKVCache, gather_dequantized, write_quantized
from tokenmill.attention.metadata import AttentionMetadata, PrefillSpan


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's K/V into the paged cache.

    key/value: [T, num_kv_heads, head_dim]; k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    (or ``QuantizedKVCache``s: quantized per token and head on the way in); slot_mapping: [T] int64 flat
    slot per token.
    """
    if isinstance(k_cache, QuantizedKVCache):  # --kv-cache-dtype int8 / fp8_e4m3
        write_quantized(key, value, k_cache, v_cache, slot_mapping)
        return
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def write_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's latent vectors (multi-head latent attention) into their one-plane cache.

    latent: [T, 1, D]; cache: [num_blocks, block_size, 1, D]; slot_mapping: [T] int64 flat slot per token.
    """
    cache.view(-1, *cache.shape[-2:]).index_copy_(0, slot_mapping, latent.to(cache.dtype))


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, kvh, d] cache, [..., nb] ids -> [..., kvh, nb * bs, d] keys/values in sequence order."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    if isinstance(cache, QuantizedKVCache):  # codes * scales, in float32
        blocks = gather_dequantized(cache, block_ids.reshape(-1))
    else:
        blocks = cache.index_select(0, block_ids.reshape(-1))  # (prod(...) * nb, bs, kvh, d)
    flat = blocks.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, num_kv_heads, head_dim)
    return flat.transpose(-3, -2)  # (..., kvh, L, d)


def use_fast_decode(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the compiled CPU decode kernel handles these tensors."""
    return (
        query.device.type == "cpu"
        and query.dtype == k_cache.dtype
        and query.dtype in (torch.float32, torch.bfloat16)
        and cpu_decode.available()
    )


def reference_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
    sliding_window: int | None = None, logit_softcap: float | None = None,
) -> torch.Tensor:
    """Slow, obviously correct decode attention: gather each context, masked softmax in float32.

    q: [Bd, H, D] -> [Bd, H, D]. Uses decode_block_table, decode_seq_lens and decode_key_mask from the metadata.
    ``sliding_window``: the query at position p = seq_len - 1 sees keys p - window < j <= p only;
    ``logit_softcap``: scores become ``cap * tanh(score / cap)`` before the mask and softmax (Gemma 2).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-2]
    group = num_heads // num_kv_heads
    k = _gather_context(k_cache, metadata.decode_block_table).float()  # (Bd, KVH, L, D)
    v = _gather_context(v_cache, metadata.decode_block_table).float()
    qf = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bhld->bhgl", qf, k) * scale  # (Bd, KVH, G, L)
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    mask = metadata.decode_key_mask.view(num_seqs, -1)  # (Bd, L)
    if sliding_window is not None:
        key_pos = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & (key_pos[None, :] >= metadata.decode_seq_lens.to(mask.device)[:, None] - sliding_window)
    scores = scores.masked_fill(~mask.view(num_seqs, 1, 1, -1), float("-inf"))
    out = torch.einsum("bhgl,bhld->bhgd", scores.softmax(dim=-1), v)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def span_keys(span: PrefillSpan, sliding_window: int | None) -> tuple[int, torch.Tensor | None]:
    """The keys a prefill chunk attends to: (key_start, mask).

    Keys ``key_start .. span.num_context - 1`` (0 without a window; under one, the first key the chunk's first
    query sees); ``mask`` [Lq, num_context - key_start] bool (True = attend; None: plain causal, query ==
    context). Query row i sits at position p = num_context - Lq + i and sees keys j <= p, and under a window
    only p - window < j (transformers' sliding-window masks).
    """
    num_query = span.token_end - span.token_start
    if sliding_window is None or span.num_context <= sliding_window:  # the window cuts nothing off
        return 0, span.attn_mask
    first_pos = span.num_context - num_query
    key_start = max(0, first_pos - sliding_window + 1)
    q_pos = torch.arange(first_pos, span.num_context).unsqueeze(1)  # (Lq, 1)
    k_pos = torch.arange(key_start, span.num_context).unsqueeze(0)  # (1, Lk)
    return key_start, (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)  # (Lq, Lk)


def _span_context(cache: torch.Tensor, span: PrefillSpan, key_start: int) -> torch.Tensor:
    """Keys (or values) ``key_start .. num_context - 1`` of a span: [KVH, num_context - key_start, D]."""
    block_size = cache.shape[1]
    first_block, offset = divmod(key_start, block_size)
    context = _gather_context(cache, span.block_ids[first_block:])  # (KVH, L', D)
    return context[:, offset : offset + span.num_context - key_start]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    use_kernel: bool = True,
    use_prefill_kernel: bool = False,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of this step's queries over each request's paged context.

    query: [T, num_heads, head_dim]; caches as in :func:`write_kv` (already holding this step's K/V).
    Returns [T, num_heads, head_dim]. GQA: num_heads must be a multiple of num_kv_heads.
    ``use_kernel=False`` keeps decode queries off the compiled CPU kernel (torch reference instead).
    ``use_prefill_kernel=True`` runs the prefill chunks in the compiled CPU prefill kernel where it
    takes the tensors (``cpu_prefill.supports``), SDPA per chunk otherwise.
    ``sliding_window``: a query at position p attends to keys p - window < j <= p only (None: 0 <= j <= p).
    ``logit_softcap`` (Gemma 2): scores become ``cap * tanh(score / cap)`` before the softmax; the torch
    chunks then run eager attention (:func:`_softcapped_attention`) instead of SDPA.
    """
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    use_gqa = num_heads != k_cache.shape[-2]
    fast_decode = use_kernel and use_fast_decode(query, k_cache)
    window, softcap = sliding_window, logit_softcap

    if not metadata.prefills and fast_decode:  # decode-only step: no gather/scatter
        return cpu_decode.paged_decode_attention(
            query, k_cache, v_cache, metadata.decode_block_table, metadata.decode_seq_lens, scale, window, softcap
        )
    if metadata.decode_token_idx.numel():
        q = query[metadata.decode_token_idx]  # (Bd, H, D)
        if fast_decode:
            o = cpu_decode.paged_decode_attention(
                q, k_cache, v_cache, metadata.decode_block_table, metadata.decode_seq_lens, scale, window, softcap
            )
        else:
            o = reference_decode_attention(q, k_cache, v_cache, metadata, scale, window, softcap)
        out[metadata.decode_token_idx] = o

    if metadata.prefills and use_prefill_kernel and cpu_prefill.supports(query, k_cache):
        cpu_prefill.paged_prefill_attention(query, k_cache, v_cache, metadata, scale, out, window, softcap)
        return out
    _prefill_spans(query, k_cache, v_cache, metadata, scale, out, use_gqa, window, softcap)
    return out


@contextlib.contextmanager
def _sdpa_without_onednn(query: torch.Tensor) -> Iterator[None]:
    """Run the enclosed SDPA call on torch's flash-attention kernel without oneDNN for a bf16/f16 CPU query.

    With oneDNN on, torch's CPU flash attention in bf16 JIT-compiles brgemm kernels for each (query length,
    key length) pair and keeps every one: a server sees a new pair at almost every prefill chunk, so its
    resident memory grew by about 2 MiB per pair without bound (benchmarks/soak.py, issue 44: +0.4 GiB in
    four minutes; 500 lengths in a loop: +0.9 GiB). Without oneDNN the same kernel multiplies through
    torch's blocked GEMM: 1.3-1.45x slower per call on an AMX machine, no cache. (The C prefill kernel,
    ``cpu_prefill``, has no cache either; the plan races it against this path.) ``torch.backends.mkldnn.flags``
    would do the same but also touches the TF32 setting and warns on every call.
    """
    if query.device.type != "cpu" or query.dtype not in (torch.bfloat16, torch.float16) \
            or not torch._C._get_mkldnn_enabled():
        yield
        return
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(True)


def _prefill_spans(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                   scale: float, out: torch.Tensor, use_gqa: bool, window: int | None, softcap: float | None) -> None:
    """The torch path of ``paged_attention``'s prefill chunks: SDPA per span (eager attention under a
    soft-cap), written into ``out`` [T, H, D]."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[-2]
    group = num_heads // num_kv_heads
    for span in metadata.prefills:
        key_start, mask = span_keys(span, window)
        if mask is not None:
            mask = mask.to(query.device)
        k = _span_context(k_cache, span, key_start).unsqueeze(0)  # (1, KVH, Lk, D)
        v = _span_context(v_cache, span, key_start).unsqueeze(0)
        num_query = span.token_end - span.token_start
        if softcap is None:
            q = query[span.token_start : span.token_end].transpose(0, 1).unsqueeze(0)  # (1, H, Lq, D)
            with _sdpa_without_onednn(q):
                o = F.scaled_dot_product_attention(
                    q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=mask is None, scale=scale,
                    enable_gqa=use_gqa,
                )
            out[span.token_start : span.token_end] = o.squeeze(0).transpose(0, 1)
            continue
        q = query[span.token_start : span.token_end]  # (Lq, H, D)
        q = q.view(num_query, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).unsqueeze(0)  # (1, KVH, G, Lq, D)
        if mask is None:  # the chunk is the whole context: plain causal
            mask = torch.ones(num_query, span.num_context, dtype=torch.bool, device=query.device).tril()
        o = _softcapped_attention(q, k, v, mask, scale, softcap)  # (1, KVH, G, Lq, D)
        out[span.token_start : span.token_end] = o[0].permute(2, 0, 1, 3).reshape(num_query, num_heads, head_dim)



def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                          softcap: float) -> torch.Tensor:
    """Eager attention with tanh logit capping, as transformers' Gemma 2 computes it.

    q: [B, KVH, G, Lq, D]; k/v: [B, KVH, Lk, D]; mask: bool, broadcastable to [B, KVH, G, Lq, Lk] (True = attend).
    Returns [B, KVH, G, Lq, D] in q's dtype; the softmax runs in float32.
    """
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k.to(q.dtype)) * scale  # (B, KVH, G, Lq, Lk)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bhgqk,bhkd->bhgqd", probs, v.to(q.dtype))
