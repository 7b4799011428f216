"""Per-step inputs of the CUDA runner for steps that do not replay a graph: preallocated buffers, one copy.

``StepBuffers`` packs a step's int64 inputs (input_ids, positions, slot_mapping, query_start_loc,
seq_lens, decode_token_idx, sample_idx, block_table) into one pinned host buffer, moves them with
one non-blocking copy into a device twin of the same size, and hands out device views plus the
AttentionMetadata the Triton backend reads (no per-prefill Python objects). ``fetch_to_host``
brings a step's results back with a single synchronisation. Owns no model state.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from tokenmill.attention.metadata import AttentionMetadata, step_layout


class StagedStep(NamedTuple):
    """Device views of one staged step: input_ids [T], positions [T], sample_idx [S] (flat token
    index of each row whose logits are wanted), metadata (Triton-backend fields only)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    sample_idx: torch.Tensor
    metadata: AttentionMetadata


class StepBuffers:
    """Pinned host staging + device buffer sized for the largest step.

    Args:
        max_num_tokens: most tokens in one step (``max_num_batched_tokens``).
        max_num_reqs: most requests in one step (``max_num_seqs``).
        max_blocks_per_req: block-table width of the longest request (``ceil(max_model_len / block_size)``).
        block_size: tokens per KV block.
        device: where the model runs; on CPU the host buffer is the device buffer.
    """

    def __init__(
        self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, block_size: int, device: torch.device
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        self.block_size = block_size
        self.device = device
        capacity = 3 * max_num_tokens + 4 * max_num_reqs + 1 + max_num_reqs * max_blocks_per_req
        self.device_buffer = torch.empty(capacity, dtype=torch.int64, device=device)
        on_cpu = device.type == "cpu"
        self.host_buffer = self.device_buffer if on_cpu else torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self._host = self.host_buffer.numpy()
        self._copy_done = None if on_cpu else torch.cuda.Event()
        self._empty_table = torch.zeros(0, 1, dtype=torch.int64, device=device)
        self._empty_lens = torch.zeros(0, dtype=torch.int64, device=device)
        self._empty_mask = torch.zeros(0, 1, 1, block_size, dtype=torch.bool, device=device)

    def stage(
        self,
        input_ids: np.ndarray,
        query_lens: np.ndarray,
        num_computed: np.ndarray,
        block_table: np.ndarray,
        sample_rows: np.ndarray,
    ) -> StagedStep:
        """Lay out and copy one step.

        Args:
            input_ids: [T] int64 tokens of the step, request after request.
            query_lens: [B] scheduled tokens per request; num_computed: [B] tokens already cached.
            block_table: [B, w] int64 block ids (w <= max_blocks_per_req).
            sample_rows: [S] indices of the requests whose last scheduled token is sampled.
        """
        num_reqs, width = block_table.shape
        num_tokens = input_ids.shape[0]
        assert num_tokens <= self.max_num_tokens and num_reqs <= self.max_num_reqs, (num_tokens, num_reqs)
        assert width <= self.max_blocks_per_req, (width, self.max_blocks_per_req)
        layout = step_layout(query_lens, num_computed, block_table, self.block_size)
        decode_reqs = np.flatnonzero(query_lens == 1)
        pieces = (
            input_ids, layout.positions, layout.slot_mapping, layout.query_start_loc, layout.seq_lens,
            layout.query_start_loc[decode_reqs], layout.query_start_loc[1:][sample_rows] - 1, block_table.reshape(-1),
        )
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous step's copy has left the pinned buffer
        bounds = [0]
        for piece in pieces:
            start = bounds[-1]
            self._host[start : start + piece.shape[0]] = piece
            bounds.append(start + piece.shape[0])
        if self._copy_done is not None:
            self.device_buffer[: bounds[-1]].copy_(self.host_buffer[: bounds[-1]], non_blocking=True)
            self._copy_done.record()
        ids, positions, slots, query_start_loc, seq_lens, decode_idx, sample_idx, table = (
            self.device_buffer[a:b] for a, b in zip(bounds[:-1], bounds[1:])
        )
        metadata = AttentionMetadata(
            block_size=self.block_size,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=table.view(num_reqs, width),
            slot_mapping=slots,
            decode_token_idx=decode_idx,
            decode_block_table=self._empty_table,
            decode_seq_lens=self._empty_lens,
            decode_key_mask=self._empty_mask,
            prefills=(),
            prefill_count=int(np.count_nonzero(query_lens > 1)),
        )
        return StagedStep(ids, positions, sample_idx, metadata)


def fetch_to_host(tensors: list[torch.Tensor]) -> list[list]:
    """``tensor.tolist()`` for each tensor, with one synchronisation on an accelerator: every
    tensor is copied non-blocking into pinned memory, then the stream is waited on once."""
    if not tensors or tensors[0].device.type == "cpu":
        return [t.tolist() for t in tensors]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.numel() > 0) for t in tensors]
    for h, t in zip(host, tensors):
        if t.numel():
            h.copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [h.tolist() for h in host]
