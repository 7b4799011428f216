"""Logit adjustments applied before log-probabilities: logit bias, min_tokens masking and the
repetition / frequency / presence penalties.

Each function edits ``logits`` [B, V] in place, is vectorised over the batch, and is a no-op
when the metadata says no row uses it.
"""
from __future__ import annotations

import torch

from tokenmill.sampling.metadata import SamplingMetadata


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Add each row's ``logit_bias`` to ``logits`` [B, V] in place."""
    if metadata.logit_bias is None:
        return
    rows, tokens, biases = metadata.logit_bias  # each [N]
    logits.index_put_((rows, tokens), biases.to(logits.dtype), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Set stop-token logits to ``-inf`` for rows that have not yet produced ``min_tokens``."""
    if metadata.min_tokens_mask is None:
        return
    rows, tokens = metadata.min_tokens_mask  # each [M]
    logits[rows, tokens] = float("-inf")


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Count each token per row.

    Args:
        token_ids: [B, L] int64, right-padded with ``vocab_size``.
    Returns:
        [B, V] f32 counts (exact below 2**24); the padding column is dropped.
    """
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones(token_ids.shape, dtype=torch.float32, device=token_ids.device))
    return counts[:, :vocab_size]


def token_presence(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] bool: whether each token occurs in the row of ``token_ids`` [B, L] (padded with V)."""
    seen = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=token_ids.device)
    seen.scatter_(1, token_ids, True)
    return seen[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Apply repetition, frequency and presence penalties to ``logits`` [B, V] in place.

    - repetition (HF/CTRL), over prompt + output tokens: positive logits are divided by the
      penalty, negative ones multiplied;
    - frequency: subtract ``frequency_penalty * count`` for each token in the output;
    - presence: subtract ``presence_penalty`` for each token present in the output.
    """
    if metadata.output_token_ids is None:
        return
    vocab_size = logits.shape[1]
    output_counts = token_counts(metadata.output_token_ids, vocab_size)  # [B, V]
    if metadata.repetition_penalties is not None:
        assert metadata.prompt_token_ids is not None
        seen = token_presence(metadata.prompt_token_ids, vocab_size) | (output_counts > 0)  # [B, V]
        penalty = metadata.repetition_penalties.unsqueeze(1)  # [B, 1]
        penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    if metadata.frequency_penalties is not None:
        logits.sub_(metadata.frequency_penalties.unsqueeze(1) * output_counts)
    if metadata.presence_penalties is not None:
        logits.sub_(metadata.presence_penalties.unsqueeze(1) * (output_counts > 0))
