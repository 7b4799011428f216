"""Apply a structured-output bitmask to the logits of the constrained rows only.

The bitmask is the grammar libraries' common layout: int32 words, token t allowed iff bit t % 32 of
word t // 32 is set. Unconstrained rows of the batch are never touched. Unpacking goes through a
256-entry table (one byte -> 8 flags), which is ~2x faster on CPU than shifting every word 32 times.
"""
from __future__ import annotations

import torch

_BITS = 32
# _BLOCKED_BY_BYTE[b, i]: bit i of byte b is 0 (token disallowed). Bytes are little-endian within a
# word on every platform torch runs on (x86-64, aarch64, CUDA), so byte k of word w holds tokens
# 32w + 8k .. 32w + 8k + 7.
_BLOCKED_BY_BYTE = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0  # (256, 8) bool
_tables: dict[torch.device, torch.Tensor] = {}


def _blocked_table(device: torch.device) -> torch.Tensor:
    table = _tables.get(device)
    if table is None:
        table = _tables[device] = _BLOCKED_BY_BYTE.to(device)
    return table


def blocked_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [N, vocab_size], True where the token is NOT allowed, from an int32 bitmask
    [N, ceil(vocab_size / 32)]."""
    assert bitmask.dtype == torch.int32 and bitmask.dim() == 2, (bitmask.dtype, bitmask.shape)
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # (N, 4W), little-endian bytes
    return _blocked_table(bitmask.device)[as_bytes].view(bitmask.shape[0], -1)[:, :vocab_size]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [N, vocab_size] of allowed tokens from an int32 bitmask [N, ceil(vocab_size / 32)]."""
    return ~blocked_tokens(bitmask, vocab_size)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set the disallowed tokens of ``logits[rows]`` to -inf, in place.

    Args:
        logits: [B, V] float.
        bitmask: [N, ceil(V / 32)] int32 on ``logits.device``.
        rows: [N] int64 row indices into ``logits`` (distinct).
    """
    if rows.numel() == 0:
        return
    blocked = blocked_tokens(bitmask, logits.shape[1])  # (N, V)
    constrained = logits.index_select(0, rows)  # (N, V), a copy
    constrained.masked_fill_(blocked, float("-inf"))
    logits.index_copy_(0, rows, constrained)
