"""Batch-invariant attention for the deterministic mode: every query token runs as a decode query.

A prefill token at position p is computed exactly as a decode step at position p would be: the
compiled decode kernel (cpu_decode) attends from its query over keys 0..p of its request (under a
sliding window, p - window + 1..p), in the same order with the same arithmetic. A token's output
therefore never depends on how its prompt was chunked, whether its prefix came from the cache, or what
else ran in the step.
"""
from __future__ import annotations

import torch

from tokenmill.attention import cpu_decode
from tokenmill.attention.metadata import AttentionMetadata


def per_token_paged_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
    sliding_window: int | None = None, logit_softcap: float | None = None,
) -> torch.Tensor:
    """Attention of each query token over its own causal context, token by token.

    query: [T, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim]
    (already holding this step's K/V). Needs metadata built with ``per_token=True``. ``sliding_window`` /
    ``logit_softcap``: as in ``cpu_decode.paged_decode_attention`` (the token's window ends at itself).
    Returns [T, num_heads, head_dim] in query's dtype (float32 or bfloat16).
    """
    assert metadata.token_block_table is not None and metadata.token_seq_lens is not None, (
        "deterministic attention needs metadata built with per_token=True"
    )
    return cpu_decode.paged_decode_attention(
        query, k_cache, v_cache, metadata.token_block_table, metadata.token_seq_lens, scale, sliding_window,
        logit_softcap,
    )
