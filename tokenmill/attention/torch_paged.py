"""Reference paged attention in plain torch (runs on CPU): write K/V through slot_mapping, read through block tables.

Decode queries (one token) are batched into one padded SDPA call; each prefill chunk runs its
own SDPA over its cached prefix plus the chunk. A GPU backend must match this numerically.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's K/V into the paged cache.

    key/value: [T, num_kv_heads, head_dim]; k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [T] int64 flat slot per token.
    """
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, kvh, d] cache, [..., nb] ids -> [..., kvh, nb * bs, d] keys/values in sequence order."""
    blocks = cache[block_ids]  # (..., nb, bs, kvh, d)
    shape = blocks.shape
    flat = blocks.reshape(*shape[:-4], shape[-4] * shape[-3], shape[-2], shape[-1])  # (..., L, kvh, d)
    return flat.transpose(-3, -2)  # (..., kvh, L, d)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of this step's queries over each request's paged context.

    query: [T, num_heads, head_dim]; caches as in :func:`write_kv` (already holding this step's K/V).
    Returns [T, num_heads, head_dim]. GQA: num_heads must be a multiple of num_kv_heads.
    """
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    use_gqa = num_heads != k_cache.shape[-2]

    if metadata.decode_token_idx.numel():
        q = query[metadata.decode_token_idx].unsqueeze(2)  # (Bd, H, 1, D)
        k = _gather_context(k_cache, metadata.decode_block_table)  # (Bd, KVH, L, D)
        v = _gather_context(v_cache, metadata.decode_block_table)
        o = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=metadata.decode_key_mask, scale=scale, enable_gqa=use_gqa
        )
        out[metadata.decode_token_idx] = o.squeeze(2)

    for span in metadata.prefills:
        q = query[span.token_start : span.token_end].transpose(0, 1).unsqueeze(0)  # (1, H, Lq, D)
        num_query = span.token_end - span.token_start
        k = _gather_context(k_cache, span.block_ids)[:, : span.num_context].unsqueeze(0)  # (1, KVH, Lk, D)
        v = _gather_context(v_cache, span.block_ids)[:, : span.num_context].unsqueeze(0)
        if num_query == span.num_context:
            o = F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale, enable_gqa=use_gqa
            )
        else:
            offset = span.num_context - num_query
            q_pos = torch.arange(num_query).unsqueeze(1) + offset
            mask = torch.arange(span.num_context).unsqueeze(0) <= q_pos  # (Lq, Lk)
            o = F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=use_gqa
            )
        out[span.token_start : span.token_end] = o.squeeze(0).transpose(0, 1)
    return out
