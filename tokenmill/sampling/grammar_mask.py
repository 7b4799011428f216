"""Apply a structured-output bitmask to the logits of the constrained rows only.

The bitmask is the grammar libraries' common layout: int32 words, token t allowed iff bit t % 32 of
word t // 32 is set. Unconstrained rows of the batch are never touched.
"""
from __future__ import annotations

import torch

_BITS = 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [N, vocab_size] of allowed tokens from an int32 bitmask [N, ceil(vocab_size / 32)]."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)  # (32,)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (N, W, 32); arithmetic shift, then the low bit
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set the disallowed tokens of ``logits[rows]`` to -inf, in place.

    Args:
        logits: [B, V] float.
        bitmask: [N, ceil(V / 32)] int32 on ``logits.device``.
        rows: [N] int64 row indices into ``logits`` (distinct).
    """
    if rows.numel() == 0:
        return
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # (N, V)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
