"""The n-gram proposer (prompt lookup): drafts are the tokens that followed the latest earlier
occurrence of the request's last n tokens in its own prompt + output.

Numpy only, no model, no per-token Python loop. The idea is Saxena's prompt lookup decoding
(github.com/apoorvumang/prompt-lookup-decoding, 2023), which vLLM ships as its ``ngram`` method.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: np.ndarray, min_n: int, max_n: int, num_tokens: int) -> np.ndarray:
    """Draft up to ``num_tokens`` tokens for the sequence ``token_ids``.

    Finds every earlier position where the sequence's last n tokens occur again (n from ``max_n``
    down to ``min_n``, longest first; among equally long matches the latest wins) and proposes the
    tokens that followed that occurrence.

    Args:
        token_ids: [L] int64, prompt + output so far.
        min_n, max_n: n-gram lengths tried (1 <= min_n <= max_n).
        num_tokens: k, the most tokens proposed.
    Returns:
        [m] int64 draft tokens, 0 <= m <= k (empty: no match of length >= min_n).

    Cost: O(C * max_n) for C earlier occurrences of the last token, plus one O(L) comparison.
    """
    length = len(token_ids)
    if length < min_n + 1 or num_tokens <= 0:
        return token_ids[:0]
    # Candidate ends e (e <= L - 2, so a token follows): where the last token occurs earlier.
    ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])  # (C,)
    if ends.size == 0:
        return token_ids[:0]
    span = min(max_n, length - 1)
    back = np.arange(span)  # (n,)
    idx = ends[:, None] - back[None, :]  # (C, n): token e - m must equal token L - 1 - m
    same = (idx >= 0) & (token_ids[np.maximum(idx, 0)] == token_ids[length - 1 - back][None, :])
    match_len = np.cumprod(same, axis=1).sum(axis=1)  # (C,) length of the common suffix, capped at span
    best = int(match_len.max())
    if best < min_n:
        return token_ids[:0]
    end = int(ends[np.flatnonzero(match_len == best)[-1]])  # the latest of the longest matches
    return token_ids[end + 1 : end + 1 + num_tokens]


def propose_ngram_reference(token_ids: list[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Slow, obviously correct twin of :func:`propose_ngram` (plain loops), for tests."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n :]
        for start in range(length - n - 1, -1, -1):  # latest first; a token must follow the occurrence
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + num_tokens]
    return []
