"""Batched LoRA: add each token's adapter delta to a projection's output, Punica-style.

Tokens come grouped by adapter slot (``LoRAMapping``). Per slot, a shrink ``h = x @ A_slot.T`` over
all output slices at once, then an expand of h into each slice's columns with that slice's scale
folded in. Base-model tokens are never read or written. Slot weights are zero-padded to the largest
rank R.

The default path (``StackedOperands``) runs each of the mapping's slot groups as one batched GEMM
over consecutive slots (``torch.bmm``: a decode step with many adapters, a few tokens each, is one
shrink and one expand per slice rather than two small GEMMs per adapter), over the group's largest
adapter rank r (the slots' zero rows beyond their own ranks add nothing). Its expand reads B^T
stored [S, R, out] (rank-major: the first r rows of a slot are contiguous, and the product streams
``out``, which small GEMMs do several times faster than B [out, r]).
With ``batch_invariant`` (deterministic mode) both GEMMs of each segment run in the batch-invariant C
kernel over the padded R, from per-slot ``SlotOperands`` (A [R * n, in] and block-diagonal B
[out, R * n]), so a token's delta depends only on its own row and its adapter, never on the batch
(and the one-adapter shortcut, which skips the gather, computes the same rows).
``add_lora_reference`` is the slow per-token specification, written from the unpacked per-slice
weights, that both paths are tested against.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenmill.layers.batch_invariant import bi_linear
from tokenmill.lora.adapter import LoRASliceWeights
from tokenmill.layers.gemm_shapes import gemm_rows
from tokenmill.lora.mapping import LoRAMapping, SlotGroup


SlotOperands = tuple[torch.Tensor, torch.Tensor]  # (A [r * n, in], B [out, r * n]) of one slot
_MAX_CACHED_VIEWS = 256  # per module: (first slot, slot count, rank) triples; a few per step in practice


class LoRAWorkspace:
    """Scratch buffers of the default path, reused by every hooked layer of a forward (they run one
    at a time, and each is done with its buffers when it returns). A buffer grows when a step needs more."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """Buffer ``name`` as a contiguous tensor of ``shape`` with ``like``'s dtype and device (contents undefined)."""
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = torch.empty(max(numel, 2 * buffer.numel() if buffer is not None else 0), dtype=like.dtype,
                                 device=like.device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)


@dataclass(frozen=True)
class StackedOperands:
    """One module's slot weights as the default path reads them (shared with ``LoRASlots``, in place).

    lora_a / lora_b: [S, R, n, in] / [S, out, R, n] (``slot_operands``' layout); lora_bt: [S, R, out]:
        ``lora_bt[s, k, offset_i + o] = scale_i * B_i[o, k]`` (zero for k at or above the slice's rank).
        A group of several slots expands each slice from lora_bt; a lone slot of a fused module
        expands all slices at once from its block-diagonal lora_b (fewer, larger GEMMs).
    ranks: [S] each slot's adapter rank (the slots' live list; 0 when empty).
    output_slices: [n] (offset, size).
    workspace: scratch buffers (``LoRASlots`` shares one among all its modules).
    views: the GEMM operand views of slot ranges, cached (they stay valid: slots load in place).
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    lora_bt: torch.Tensor
    ranks: list[int]
    output_slices: tuple[tuple[int, int], ...]
    workspace: LoRAWorkspace = field(default_factory=LoRAWorkspace, compare=False, repr=False)
    views: dict[tuple[int, int, int], tuple[torch.Tensor, list[torch.Tensor]]] = field(
        default_factory=dict, compare=False, repr=False)  # ``_group_weights``' cache


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
    operands: Sequence[SlotOperands | None] | StackedOperands,
    mapping: LoRAMapping,
    batch_invariant: bool = False,
) -> None:
    """y += the delta of each token's adapter, in place: ``(x @ A.T) @ B.T`` per slot.

    Args:
        y: [T, out] the base projection's output (x's dtype).
        x: [T, in] its input.
        operands: the slots' weights: ``StackedOperands`` (the default path: batched GEMMs over the
            mapping's slot groups), or [S] each slot's ``slot_operands`` (None: empty slot), one
            segment at a time; with ``batch_invariant`` they must be the latter and span the full
            padded rank R (contiguous, as the C kernel needs).
        mapping: the step's tokens with an adapter, grouped by slot.
        batch_invariant: run both GEMMs in the batch-invariant kernel.
    """
    if isinstance(operands, StackedOperands):
        assert not batch_invariant, "deterministic mode reads per-slot operands over the padded rank"
        _add_lora_stacked(y, x, operands, mapping)
        return
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


def _add_lora_stacked(y: torch.Tensor, x: torch.Tensor, operands: StackedOperands, mapping: LoRAMapping) -> None:
    """The default path of ``add_lora``: one batched shrink and one batched expand per slice per slot group.

    Every intermediate lives in the shared workspace: fresh multi-megabyte tensors per layer cost
    more in page faults than the GEMMs of a long prefill segment."""
    ws = operands.workspace
    num_slices, in_features = operands.lora_a.shape[2:]
    if mapping.single_slot is not None:  # every token, one adapter: the batch is the layout, no gather or scatter
        slot, num_tokens = mapping.single_slot, x.shape[0]
        rows = gemm_rows(num_tokens)  # a bounded set of GEMM shapes (``gemm_rows``); padding rows are dropped
        groups = (SlotGroup(slot, 1, rows, 0, (slot,)),)
        if rows == num_tokens:
            xp = x.contiguous()
        else:
            xp = ws.get("x", (rows, in_features), x)  # (rows, in)
            xp[:num_tokens].copy_(x)
            xp[num_tokens:].zero_()
    else:
        assert mapping.padded_rows is not None, "a mapping built for another device"
        groups = mapping.groups
        num_rows = mapping.padded_rows.shape[0]
        xp = torch.index_select(x, 0, mapping.padded_rows, out=ws.get("x", (num_rows, in_features), x))  # (P, in)
    delta = ws.get("delta", (xp.shape[0], y.shape[1]), y)  # (P, out): each group's slots, padded to its longest
    for group in groups:
        count, rows = group.num_slots, group.rows_per_slot
        rank = max(operands.ranks[s] for s in group.slots)  # other slots' rows beyond their rank are zero
        a_t, bts = _group_weights(operands, group.first_slot, count, rank)
        xg = xp[group.row_start : group.row_end].view(count, rows, in_features)
        h = torch.bmm(xg, a_t, out=ws.get("h", (count, rows, rank * num_slices), y))  # (slots, L, r * n)
        dg = delta[group.row_start : group.row_end].view(count, rows, -1)  # (slots, L, out), contiguous
        if num_slices == 1:
            torch.bmm(h, bts[0], out=dg)
            continue
        if count == 1:  # one slot: one GEMM with its block-diagonal B, no regrouping of h by slice
            b = operands.lora_b[group.first_slot, :, :rank].view(-1, rank * num_slices)  # (out, r * n), a view
            torch.mm(h[0], b.t(), out=dg[0])
            continue
        h_by_slice = ws.get("h_by_slice", (count, rows, num_slices, rank), y)  # (slots, L, n, r)
        h_by_slice.copy_(h.view(count, rows, rank, num_slices).transpose(2, 3))
        parts = [torch.bmm(h_by_slice[:, :, i], bt, out=ws.get(f"slice{i}", (count, rows, bt.shape[2]), y))
                 for i, bt in enumerate(bts)]  # (slots, L, size) each
        torch.cat(parts, dim=2, out=dg)
    if mapping.single_slot is not None:
        y += delta[: y.shape[0]]
    elif mapping.batch_rows is not None:  # every token has an adapter: gather the rows into batch order
        y += torch.index_select(delta, 0, mapping.batch_rows, out=ws.get("rows", tuple(y.shape), y))
    else:
        if mapping.valid_rows is not None:  # (N, out), token_indices order
            delta = torch.index_select(delta, 0, mapping.valid_rows,
                                       out=ws.get("rows", (mapping.num_lora_tokens, y.shape[1]), y))
        # Each row appears once, so this is one exact add per element. (index_add_ goes through
        # scatter_add_ here, which took milliseconds per call inside the engine on a busy 2-core machine.)
        y.index_put_((mapping.token_indices,), delta, accumulate=True)


def _group_weights(
    operands: StackedOperands, first: int, count: int, rank: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Views of slots ``first .. first + count - 1`` over ranks :rank as batched GEMM operands,
    (A^T [count, in, r * n], per output slice B^T [count, r, size]); cached per (first, count, rank)."""
    key = (first, count, rank)
    views = operands.views.get(key)
    if views is None:
        num_slices, in_features = operands.lora_a.shape[2:]
        a = operands.lora_a[first : first + count, :rank].view(count, rank * num_slices, in_features)
        bt = operands.lora_bt[first : first + count, :rank]  # (slots, r, out)
        views = (a.transpose(1, 2), [bt[:, :, offset : offset + size] for offset, size in operands.output_slices])
        if len(operands.views) >= _MAX_CACHED_VIEWS:
            operands.views.clear()
        operands.views[key] = views
    return views


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
