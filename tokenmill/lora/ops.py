"""Batched LoRA: add each token's adapter delta to a projection's output, Punica-style.

Tokens come grouped by adapter slot (``LoRAMapping``); per segment, one shrink ``h = x @ A_slot.T``
over all output slices at once, then one expand ``h @ B_slot.T`` whose B is block-diagonal over the
slices and carries each slice's scale. Base-model tokens are never read or written. Slot weights
are zero-padded to the largest rank R; the default path multiplies only the slot's own rank r. With
``batch_invariant`` (deterministic mode) both GEMMs run in the batch-invariant C kernel over the
padded R, so a token's delta depends only on its own row and its adapter, never on the batch (and
the one-adapter shortcut, which skips the gather, computes the same rows).
``add_lora_reference`` is the slow per-token specification, written from the unpacked per-slice
weights, that the fast path is tested against.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.layers.batch_invariant import bi_linear
from tokenmill.lora.adapter import LoRASliceWeights
from tokenmill.lora.mapping import LoRAMapping


SlotOperands = tuple[torch.Tensor, torch.Tensor]  # (A [r * n, in], B [out, r * n]) of one slot


def slot_operands(lora_a: torch.Tensor, lora_b: torch.Tensor, slot: int, rank: int) -> SlotOperands:
    """Views of one slot's packed weights as the two GEMM operands, over its first ``rank`` ranks.

    lora_a: [S, R, n, in]: ``lora_a[s, k, i]`` is row k of slot s's A for output slice i (zero for
        k at or above the adapter's rank on that slice).
    lora_b: [S, out, R, n]: ``lora_b[s, o, k, i]`` is ``scale_i * B_i[o - offset_i, k]`` for the
        columns o of slice i and zero elsewhere (block-diagonal over the slices).
    Returns A [rank * n, in] (contiguous) and B [out, rank * n] (contiguous when rank == R).
    """
    _, _, num_slices, in_features = lora_a.shape
    a = lora_a[slot, :rank].view(rank * num_slices, in_features)  # (r * n, in)
    b = lora_b[slot, :, :rank].reshape(lora_b.shape[1], rank * num_slices)  # (out, r * n), a view
    return a, b


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    operands: Sequence[SlotOperands | None],
    mapping: LoRAMapping,
    batch_invariant: bool = False,
) -> None:
    """y += the delta of each token's adapter, in place: ``(x @ A.T) @ B.T`` per slot segment.

    Args:
        y: [T, out] the base projection's output (x's dtype).
        x: [T, in] its input.
        operands: [S] each slot's ``slot_operands`` (None: empty slot); with ``batch_invariant``
            they must span the full padded rank R (contiguous, as the C kernel needs).
        mapping: the step's tokens with an adapter, grouped by slot.
        batch_invariant: run both GEMMs in the batch-invariant kernel.
    """
    if mapping.single_slot is not None:  # every token, one adapter: no gather, no scatter
        a, b = operands[mapping.single_slot]
        y.add_(bi_linear(bi_linear(x, a), b) if batch_invariant else (x @ a.t()) @ b.t())
        return
    xs = x.index_select(0, mapping.token_indices)  # (N, in), grouped by slot
    delta = torch.empty(xs.shape[0], y.shape[1], dtype=y.dtype, device=y.device)  # (N, out)
    for slot, start, end in mapping.segments:  # one iteration per adapter in the step
        a, b = operands[slot]
        if batch_invariant:
            delta[start:end] = bi_linear(bi_linear(xs[start:end], a), b)  # (t, r * n) -> (t, out)
        else:
            torch.matmul(xs[start:end] @ a.t(), b.t(), out=delta[start:end])  # (t, r * n) -> (t, out)
    # Each row appears once, so this is one exact add per element (index_add_ is ~10^4x slower on small CPU tensors).
    y.index_put_((mapping.token_indices,), delta, accumulate=True)


def add_lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    slot_weights: Sequence[Sequence[LoRASliceWeights | None]],
    token_slots: Sequence[int | None],
    output_slices: Sequence[tuple[int, int]],
) -> None:
    """The specification of ``add_lora``, one token and one slice at a time (tests only: slow).

    y: [T, out]; x: [T, in]; slot_weights[s][i]: slot s's adapter on output slice i (None: not
    targeted); token_slots: [T] each token's slot (None: base model); output_slices: [n] (offset, size).
    """
    for t, slot in enumerate(token_slots):
        if slot is None:
            continue
        for (offset, size), weights in zip(output_slices, slot_weights[slot]):
            if weights is None:
                continue
            h = weights.lora_a.to(x.dtype) @ x[t]  # (r,)
            y[t, offset : offset + size] += (weights.lora_b.to(x.dtype) @ h) * weights.scale
