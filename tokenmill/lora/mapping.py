"""LoRAMapping: which adapter slot each token of a step uses, as segments of tokens grouped by slot.

Built once per step by the model runner from per-request slot ids and query lengths with numpy
(no loop over tokens); every LoRA-hooked layer of the forward reads the same mapping. On a CUDA
device the token indices and the segment table the Triton kernels read travel in one pinned,
non-blocking copy; on CPU the step's slot groups for the batched GEMMs (``SlotGroup``, padded
rows) are planned here once, not in each of the hooked layers.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.layers.gemm_shapes import gemm_rows

# Segments of at most this many tokens are batched with their neighbours (padded to the group's
# longest); a longer one (a prefill chunk) runs alone, where one GEMM is already efficient.
MAX_PADDED_SEGMENT = 16
# Two segments share a group when at most this many slots lie between them (their rows are padding).
MAX_SLOT_GAP = 1


@dataclass(frozen=True)
class SlotGroup:
    """Consecutive slots ``first_slot .. first_slot + num_slots - 1`` whose tokens run as one batched
    GEMM (``ops.add_lora``): rows ``row_start + k * rows_per_slot ..`` of the padded layout hold slot
    ``first_slot + k``'s tokens, then padding; ``slots`` are those with tokens (the others are padding)."""

    first_slot: int
    num_slots: int
    rows_per_slot: int
    row_start: int
    slots: tuple[int, ...]

    @property
    def row_end(self) -> int:
        return self.row_start + self.num_slots * self.rows_per_slot


@dataclass(frozen=True)
class LoRAMapping:
    """Tokens of the flat batch that run with an adapter, grouped by slot (Punica's segments).

    token_indices: [N] int64, positions in the step's [T] token batch; tokens of one slot are
        contiguous here and keep their batch order. Base-model tokens are absent (they pay nothing).
    segments: (slot, start, end) per slot present: ``token_indices[start:end]`` use ``slot``.
    single_slot: the slot when every token of the step uses it (token_indices is then 0..T-1), else None.
    segment_table: [3, G] int64 on token_indices' device, rows (slot, start, end) of ``segments``, for
        the Triton kernels (``triton_ops.py``); built by ``build_lora_mapping`` on a non-CPU device,
        None otherwise (``device_segment_table`` then builds it on demand).
    groups: the CPU path's batched GEMMs (``plan_slot_groups``), covering every segment; empty when
        built for another device.
    padded_rows: [P] int64, the batch position each row of the groups' padded layout reads (padding
        rows read position 0; their results are dropped); None when built for another device.
    valid_rows: [N] int64, the padded-layout row of each ``token_indices`` entry; None when the
        layout has no padding (row j is then token_indices[j]).
    batch_rows: [T] int64 when every token of the step has an adapter: the padded-layout row of each
        batch position (the deltas then reach y by a gather, not a scatter); None otherwise.
    """

    token_indices: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]
    single_slot: int | None = None
    segment_table: torch.Tensor | None = None
    groups: tuple[SlotGroup, ...] = ()
    padded_rows: torch.Tensor | None = None
    valid_rows: torch.Tensor | None = None
    batch_rows: torch.Tensor | None = None

    @property
    def num_lora_tokens(self) -> int:
        return int(self.token_indices.shape[0])

    @property
    def max_segment_len(self) -> int:
        """Tokens in the longest segment (host-side: sizes the kernels' grids without a device sync)."""
        return max((end - start for _, start, end in self.segments), default=0)

    def device_segment_table(self) -> torch.Tensor:
        """``segment_table``, or (a mapping built for CPU) a new one on token_indices' device."""
        if self.segment_table is not None:
            return self.segment_table
        table = torch.tensor(self.segments, dtype=torch.int64).reshape(-1, 3).t()  # (3, G)
        return table.contiguous().to(self.token_indices.device)


def plan_slot_groups(
    segments: tuple[tuple[int, int, int], ...], token_indices: np.ndarray
) -> tuple[tuple[SlotGroup, ...], np.ndarray, np.ndarray | None]:
    """Batch the step's segments into slot groups: a segment longer than ``MAX_PADDED_SEGMENT`` runs
    alone; shorter ones, in slot order, join the open group while at most ``MAX_SLOT_GAP`` slots lie
    between neighbours. A group's rows per slot are ``gemm_rows`` of its longest segment. Returns
    (groups, padded_rows [P], valid_rows [N] or None when P == N).

    segments: (slot, start, end), slots ascending; token_indices: [N] the segments' batch positions.
    """
    runs: list[list[tuple[int, int, int]]] = []  # segments per group
    for segment in segments:
        slot, start, end = segment
        last = runs[-1][-1] if runs else None
        if (end - start <= MAX_PADDED_SEGMENT and last is not None and last[2] - last[1] <= MAX_PADDED_SEGMENT
                and slot - last[0] - 1 <= MAX_SLOT_GAP):
            runs[-1].append(segment)
        else:
            runs.append([segment])
    groups, padded, valid, row = [], [], [], 0  # valid: per group, the rows of its tokens
    for run in runs:
        first, last = run[0][0], run[-1][0]
        rows_per_slot = gemm_rows(max(end - start for _, start, end in run))
        rows = np.zeros((last - first + 1, rows_per_slot), dtype=np.int64)  # (slots, L), padding reads row 0
        for slot, start, end in run:
            rows[slot - first, : end - start] = token_indices[start:end]
            valid.append(row + (slot - first) * rows_per_slot + np.arange(end - start))
        groups.append(SlotGroup(first, last - first + 1, rows_per_slot, row, tuple(s for s, _, _ in run)))
        padded.append(rows.reshape(-1))
        row += rows.size
    valid_rows = np.concatenate(valid)
    return tuple(groups), np.concatenate(padded), None if row == len(token_indices) else valid_rows


def _batch_rows(token_indices: np.ndarray, valid_rows: np.ndarray | None) -> np.ndarray:
    """[T] the padded-layout row of each batch position, when token_indices covers all T of them."""
    rows = np.empty(len(token_indices), dtype=np.int64)
    rows[token_indices] = np.arange(len(token_indices)) if valid_rows is None else valid_rows
    return rows


def build_lora_mapping(
    request_slots: Sequence[int | None], query_lens: np.ndarray, device: torch.device | str = "cpu"
) -> LoRAMapping | None:
    """The mapping of a step whose request i schedules ``query_lens[i]`` tokens with adapter slot
    ``request_slots[i]`` (None: the base model). Returns None when no request uses an adapter.

    request_slots: [B]; query_lens: [B] int64 (tokens of request i are contiguous in the batch).
    """
    num_reqs = len(request_slots)
    has_lora = np.fromiter((s is not None for s in request_slots), dtype=bool, count=num_reqs)  # (B,)
    if not has_lora.any():
        return None
    slots = np.fromiter((s or 0 for s in request_slots), dtype=np.int64, count=num_reqs)  # (B,), 0 where unused
    lens = np.asarray(query_lens, dtype=np.int64)
    token_slot = np.repeat(slots, lens)  # (T,)
    lora_tokens = np.flatnonzero(np.repeat(has_lora, lens))  # (N,) batch positions with an adapter
    token_indices = lora_tokens[np.argsort(token_slot[lora_tokens], kind="stable")]  # (N,) grouped by slot
    seg_slots, starts, counts = np.unique(token_slot[token_indices], return_index=True, return_counts=True)
    segments = tuple((int(s), int(b), int(b + c)) for s, b, c in zip(seg_slots, starts, counts))  # per slot
    single_slot = segments[0][0] if len(segments) == 1 and len(token_indices) == len(token_slot) else None
    device = torch.device(device)
    if device.type == "cpu":
        groups, padded_rows, valid_rows = plan_slot_groups(segments, token_indices)
        batch_rows = _batch_rows(token_indices, valid_rows) if len(token_indices) == len(token_slot) else None
        return LoRAMapping(torch.from_numpy(token_indices), segments, single_slot, None, groups,
                           torch.from_numpy(padded_rows), None if valid_rows is None else torch.from_numpy(valid_rows),
                           None if batch_rows is None else torch.from_numpy(batch_rows))
    # One host buffer [token_indices (N) | slots (G) | starts (G) | ends (G)], one non-blocking copy.
    host = torch.from_numpy(np.concatenate((token_indices, seg_slots, starts, starts + counts)))  # (N + 3G,)
    if device.type == "cuda":
        host = host.pin_memory()
    packed = host.to(device, non_blocking=True)
    num_lora = len(token_indices)
    return LoRAMapping(packed[:num_lora], segments, single_slot, packed[num_lora:].view(3, len(segments)))
