"""Decode steps at padded batch sizes over static buffers: what CUDA graphs capture and replay.

A decode-only step of B requests runs at the smallest captured batch size ("bucket") >= B. Rows
B..bucket-1 are padding: input id 0 at position 0, K/V written to slot 0 of a padding block the
KV cache manager never hands out, a block table row pointing at that block, seq_len 1. Every
input lives at a fixed address (``DecodeBuffers``) so a graph captured over
:func:`run_padded_decode` replays correctly; the same function runs eagerly on any device.
Hybrid models' padding rows also read and write a padding slot of the linear-attention state
pool. Owns no model weights, no KV tensors and no state pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.layer import KVCache


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes: 1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs``
    (which is added when it is not one), ascending."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def choose_bucket(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest size in ``sizes`` (ascending) that holds ``num_reqs`` rows; None if none does."""
    for size in sizes:
        if size >= num_reqs:
            return size
    return None


@dataclass
class PaddedDecodeInputs:
    """Host (numpy int64) contents of the static decode inputs for one bucket of ``bucket`` rows.

    input_ids / positions / slot_mapping / seq_lens: [bucket]; block_table: [bucket, max_blocks].
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray

    @classmethod
    def zeros(cls, bucket: int, max_blocks: int) -> PaddedDecodeInputs:
        """Fresh zeroed arrays (tests; the runner writes into views of its pinned buffer)."""
        rows = [np.zeros(bucket, dtype=np.int64) for _ in range(4)]
        return cls(*rows, np.zeros((bucket, max_blocks), dtype=np.int64))


def pad_decode_inputs(
    out: PaddedDecodeInputs,
    input_ids: np.ndarray,
    positions: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    padding_block_id: int,
) -> None:
    """Write B real decode rows plus padding into ``out`` (one bucket's rows, bucket >= B).

    Args:
        out: arrays of the bucket's size; every entry a kernel can read is overwritten (block
            table columns past a row's context are left as they were: nothing reads them).
        input_ids: [B] the token each request feeds this step.
        positions: [B] its position (= tokens already in the KV cache).
        block_table: [B, w] block ids, w <= out.block_table.shape[1], covering position + 1 tokens.
        block_size: tokens per block.
        padding_block_id: the reserved block padding rows write to and read from.
    """
    num_reqs, width = block_table.shape
    bucket = out.input_ids.shape[0]
    assert num_reqs <= bucket and width <= out.block_table.shape[1], (num_reqs, bucket, width)
    rows = np.arange(num_reqs)
    out.input_ids[:num_reqs] = input_ids
    out.input_ids[num_reqs:] = 0
    out.positions[:num_reqs] = positions
    out.positions[num_reqs:] = 0
    out.seq_lens[:num_reqs] = positions + 1
    out.seq_lens[num_reqs:] = 1
    out.block_table[:num_reqs, :width] = block_table
    out.block_table[num_reqs:, 0] = padding_block_id
    out.slot_mapping[:num_reqs] = block_table[rows, positions // block_size] * block_size + positions % block_size
    out.slot_mapping[num_reqs:] = padding_block_id * block_size


class DecodeBuffers:
    """The static inputs of padded decode steps, sized for ``max_batch_size`` rows.

    One int64 device tensor holds input_ids, positions, slot_mapping, seq_lens, sample_idx (rows
    whose logits are wanted; read outside any graph), state_slots (hybrid models: each row's
    linear-attention state slot, padding rows ``padding_state_slot``) [max_batch_size] each and the
    block table [max_batch_size, max_blocks]; on an accelerator a pinned host twin with the same
    layout is filled and copied with one non-blocking copy per step. ``reference_views`` also keeps
    the key mask the torch reference backend reads (CPU only). ``linear_state``, when set (hybrid
    models), maps a bucket's rows of ``state_slots`` to the ``AttentionMetadata.linear_state`` of
    its steps (``LinearStateCache.decode_metadata``).
    """

    def __init__(
        self,
        max_batch_size: int,
        max_blocks: int,
        block_size: int,
        padding_block_id: int,
        device: torch.device,
        reference_views: bool = False,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.padding_block_id = padding_block_id
        self.device = device
        n = max_batch_size
        self._table_offset = 6 * n
        size = self._table_offset + n * max_blocks
        self.static = torch.zeros(size, dtype=torch.int64, device=device)
        on_cpu = device.type == "cpu"
        self._host = self.static if on_cpu else torch.zeros(size, dtype=torch.int64, pin_memory=True)
        self._copy_done = None if on_cpu else torch.cuda.Event()
        views = self.static[: 6 * n].view(6, n)  # (6, n): ids, positions, slots, seq_lens, sample_idx, state slots
        (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.sample_idx,
         self.state_slots) = views.unbind(0)
        self.padding_state_slot = 0  # set with ``linear_state`` (the state pool's padding slot)
        self.linear_state: Callable[[torch.Tensor], Any] | None = None
        self.block_table = self.static[self._table_offset :].view(n, max_blocks)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int64, device=device)  # one token per row
        self.token_idx = torch.arange(n, dtype=torch.int64, device=device)
        self.key_mask = (
            torch.zeros(n, 1, 1, max_blocks * block_size, dtype=torch.bool, device=device) if reference_views else None
        )
        host = self._host.numpy()
        host_rows = host[: 6 * n].reshape(6, n)
        self._host_inputs = PaddedDecodeInputs(
            host_rows[0], host_rows[1], host_rows[2], host_rows[3], host[self._table_offset :].reshape(n, max_blocks)
        )
        self._host_sample_idx = host_rows[4]
        self._host_state_slots = host_rows[5]
        self._metadata: dict[int, AttentionMetadata] = {}
        # Every row starts as padding, so graphs can be captured before any real step.
        self.load(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 1), np.int64), n, np.zeros(0, np.int64))

    def host_rows(self, bucket: int) -> PaddedDecodeInputs:
        """Views of the host buffer for the first ``bucket`` rows."""
        h = self._host_inputs
        return PaddedDecodeInputs(
            h.input_ids[:bucket], h.positions[:bucket], h.slot_mapping[:bucket], h.seq_lens[:bucket],
            h.block_table[:bucket],
        )

    def load(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        block_table: np.ndarray,
        bucket: int,
        sample_idx: np.ndarray,
        state_slots: np.ndarray | None = None,
    ) -> None:
        """Fill the first ``bucket`` rows: B real rows (input_ids/positions [B], block_table [B, w])
        then padding; ``sample_idx`` [S] lists the rows whose logits the step needs; ``state_slots``
        [B] (hybrid models) each row's linear-attention state slot."""
        assert bucket <= self.max_batch_size
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous step's copy has left the pinned buffer
        pad_decode_inputs(
            self.host_rows(bucket), input_ids, positions, block_table, self.block_size, self.padding_block_id
        )
        self._host_sample_idx[: len(sample_idx)] = sample_idx
        num_reqs = len(input_ids)
        if state_slots is not None:
            self._host_state_slots[:num_reqs] = state_slots
        self._host_state_slots[num_reqs:bucket] = self.padding_state_slot
        if self._copy_done is not None:
            end = self._table_offset + bucket * self.max_blocks
            self.static[:end].copy_(self._host[:end], non_blocking=True)
            self._copy_done.record()
        if self.key_mask is not None:
            keys = torch.arange(self.key_mask.shape[-1], device=self.device)
            self.key_mask[:bucket, 0, 0] = keys[None, :] < self.seq_lens[:bucket, None]

    def metadata(self, bucket: int) -> AttentionMetadata:
        """AttentionMetadata over the first ``bucket`` rows: views of the static buffers, built once."""
        if bucket not in self._metadata:
            table = self.block_table[:bucket]
            seq_lens = self.seq_lens[:bucket]
            key_mask = self.key_mask[:bucket] if self.key_mask is not None else torch.zeros(
                bucket, 1, 1, 0, dtype=torch.bool, device=self.device
            )
            self._metadata[bucket] = AttentionMetadata(
                block_size=self.block_size,
                query_start_loc=self.query_start_loc[: bucket + 1],
                seq_lens=seq_lens,
                block_table=table,
                slot_mapping=self.slot_mapping[:bucket],
                decode_token_idx=self.token_idx[:bucket],
                decode_block_table=table,
                decode_seq_lens=seq_lens,
                decode_key_mask=key_mask,
                prefills=(),
                linear_state=None if self.linear_state is None else self.linear_state(self.state_slots[:bucket]),
            )
        return self._metadata[bucket]

    def set_linear_state(self, linear_state: Callable[[torch.Tensor], Any], padding_state_slot: int) -> None:
        """Give every bucket's metadata a ``linear_state`` built by ``linear_state(state_slots[:bucket])`` (hybrid
        models, once the state pool exists; before any graph is captured) and fill padding rows' state slots with
        ``padding_state_slot``."""
        self.linear_state = linear_state
        self.padding_state_slot = padding_state_slot
        self._metadata.clear()
        self.load(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 1), np.int64), self.max_batch_size,
                  np.zeros(0, np.int64))


def run_padded_decode(
    model: torch.nn.Module, kv_caches: list[KVCache], buffers: DecodeBuffers, bucket: int
) -> torch.Tensor:
    """One decode forward over the first ``bucket`` rows of ``buffers`` -> hidden [bucket, hidden].

    Pure device work with no host synchronisation and no data-dependent host decisions, so a CUDA
    graph can capture it; also the eager path (CPU, ``--enforce-eager``).
    """
    return model(buffers.input_ids[:bucket], buffers.positions[:bucket], kv_caches, buffers.metadata(bucket))
