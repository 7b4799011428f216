"""LoRAMapping: which adapter slot each token of a step uses, as segments of tokens grouped by slot.

Built once per step by the model runner from per-request slot ids and query lengths with numpy
(no loop over tokens); every LoRA-hooked layer of the forward reads the same mapping. On a CUDA
device the token indices and the segment table the Triton kernels read travel in one pinned,
non-blocking copy; on CPU nothing beyond the token indices is built.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


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
    """

    token_indices: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]
    single_slot: int | None = None
    segment_table: torch.Tensor | None = None

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
        return LoRAMapping(torch.from_numpy(token_indices), segments, single_slot)
    # One host buffer [token_indices (N) | slots (G) | starts (G) | ends (G)], one non-blocking copy.
    host = torch.from_numpy(np.concatenate((token_indices, seg_slots, starts, starts + counts)))  # (N + 3G,)
    if device.type == "cuda":
        host = host.pin_memory()
    packed = host.to(device, non_blocking=True)
    num_lora = len(token_indices)
    return LoRAMapping(packed[:num_lora], segments, single_slot, packed[num_lora:].view(3, len(segments)))
