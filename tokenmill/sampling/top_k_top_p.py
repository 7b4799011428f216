"""Top-k, top-p (nucleus) and min-p filtering of temperature-scaled logits.

Each function masks filtered-out entries of ``logits`` [B, V] to ``-inf``, vectorised over the
batch (no per-row Python loop). Top-k alone uses ``topk`` and skips the full vocabulary sort.
"""
from __future__ import annotations

import torch


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits, then the smallest set reaching mass ``top_p``.

    Args:
        logits: [B, V] f32, modified in place.
        top_k: [B] int64 in [1, V] (V = off), or None.
        top_p: [B] f32 in (0, 1] (1.0 = off), or None. The most likely token is always kept.
        max_top_k: largest enabled value of ``top_k`` (< V); lets top-k alone run as one
            ``topk(max_top_k)`` instead of a sort. Computed on the device when None.
    Returns:
        ``logits`` [B, V] with filtered entries set to ``-inf``. Ties with the k-th largest
        logit are kept.
    """
    if top_k is None and top_p is None:
        return logits
    if top_p is None:
        assert top_k is not None
        return _apply_top_k_only(logits, top_k, max_top_k)

    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=False)  # [B, V] ascending
    if top_k is not None:
        kth_largest = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))  # [B, 1]
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    # Drop a token when the mass at or below it is <= 1 - p, i.e. the tokens above it already
    # reach p; the top token (last column) always stays.
    drop = cum_probs <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, sorted_ids, sorted_logits)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int | None) -> torch.Tensor:
    """Top-k without a full sort: threshold each row at its k-th largest of ``topk(max_top_k)``."""
    vocab_size = logits.shape[1]
    enabled = top_k < vocab_size  # [B]
    if max_top_k is None:
        max_top_k = int(top_k.masked_fill(~enabled, 1).max())  # host sync; pass max_top_k to avoid
    top_values = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
    kth_index = (top_k.clamp(max=max_top_k) - 1).unsqueeze(1)  # [B, 1]
    kth_largest = top_values.gather(1, kth_index)  # [B, 1]
    kth_largest.masked_fill_(~enabled.unsqueeze(1), float("-inf"))  # disabled rows keep all
    return logits.masked_fill_(logits < kth_largest, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is at least ``min_p`` times the row's largest probability.

    Works in log space: ``p_i >= min_p * p_max``  <=>  ``logit_i >= logit_max + log(min_p)``,
    so no softmax is needed; ``min_p == 0`` gives a ``-inf`` threshold and keeps everything.

    Args:
        logits: [B, V] f32, modified in place.
        min_p: [B] f32 in [0, 1].
    Returns:
        ``logits`` [B, V] with filtered entries set to ``-inf``.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)  # [B, 1]
    return logits.masked_fill_(logits < threshold, float("-inf"))
