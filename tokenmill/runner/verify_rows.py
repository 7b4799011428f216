"""The verify step as decode rows: each scheduled token of a verifying request becomes a query of its
own over the request's block table, with the sequence length it would have in plain decoding.

Pure numpy. The runner builds the step's attention metadata from these rows when every request in the
step is decoding, so a verify step runs the decode path (one query per row, the lean decode step where
installed) with plain decoding's per-row kernels. Row j of a request with c computed tokens attends to
c + j + 1 keys, its own included: the K/V of every row is written before any row attends (the
attention layers write the step's K/V first), so the rows see exactly the keys plain decoding would.
"""
from __future__ import annotations

import numpy as np


def verify_rows_layout(query_lens: np.ndarray, num_computed_tokens: np.ndarray,
                       block_table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-token rows of a step whose requests are all decoding or verifying.

    Args:
        query_lens: [B] int64, tokens scheduled per request (1 + its drafts).
        num_computed_tokens: [B] int64, tokens already in each request's KV cache.
        block_table: [B, max_blocks] int64, each request's block ids.
    Returns:
        (row_query_lens [T] of ones, row_num_computed [T], row_block_table [T, max_blocks]) for the
        T = sum(query_lens) tokens in step order: token j of request b has b's computed tokens + j.
    """
    query_lens = np.asarray(query_lens, dtype=np.int64)
    num_tokens = int(query_lens.sum())
    req = np.repeat(np.arange(len(query_lens)), query_lens)  # (T,) request of each token
    starts = np.cumsum(query_lens) - query_lens  # (B,)
    offset = np.arange(num_tokens) - starts[req]  # (T,) index within its request
    return (np.ones(num_tokens, dtype=np.int64), np.asarray(num_computed_tokens, dtype=np.int64)[req] + offset,
            np.asarray(block_table, dtype=np.int64)[req])
