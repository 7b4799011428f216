"""AttentionMetadata: the per-step description of where each token's K/V lives and what it attends to.

Built once per engine step by the model runner (vectorised numpy, no loop over tokens) and
shared by all layers. Pure bookkeeping: no model weights here.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np
import torch


@dataclass(frozen=True)
class PrefillSpan:
    """One request whose query has more than one token this step (a prefill chunk).

    token_start/token_end index the flat token dimension; ``num_context`` is the request's
    sequence length after this step (cached prefix + this chunk); ``block_ids`` [num_blocks]
    covers the context. ``attn_mask`` [Lq, num_context] bool is set when the chunk follows a
    cached prefix (None: plain causal, query == context).
    """

    token_start: int
    token_end: int
    num_context: int
    block_ids: torch.Tensor
    attn_mask: torch.Tensor | None


@dataclass(frozen=True)
class AttentionMetadata:
    """Flat-batch attention description (vLLM v1 vocabulary).

    Shapes (B = requests this step, T = tokens this step):
        query_start_loc: [B + 1] int64, cumulative query lengths (``cu_seqlens_q``).
        seq_lens:        [B] int64, context length of each request after this step.
        block_table:     [B, max_blocks] int64, block ids (padding entries are 0).
        slot_mapping:    [T] int64, ``block_id * block_size + offset`` where each new token's K/V goes.
    Derived views for the torch reference backend:
        decode_token_idx: [Bd] int64, flat token index of each single-token (decode) query.
        decode_block_table: [Bd, max_decode_blocks] int64.
        decode_seq_lens: [Bd] int64, keys per decode query.
        decode_key_mask: [Bd, 1, 1, max_decode_blocks * block_size] bool, True where a key is valid.
        prefills: one PrefillSpan per multi-token query.
    Per-token views, built only for the batch-invariant (deterministic) path, where every query
    token is computed exactly like a decode query of its own (None otherwise):
        token_block_table: [T, max_blocks] int64, the block table row of each token's request.
        token_seq_lens: [T] int64, keys each token attends to (its position + 1).
    Device metadata for the Triton backend (``tokenmill.runner.input_buffers``) skips the
    reference views: ``prefills`` is empty, ``prefill_count`` holds the number of multi-token
    queries, and the ``decode_*`` views other than ``decode_token_idx`` are empty.
    """

    block_size: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    decode_token_idx: torch.Tensor
    decode_block_table: torch.Tensor
    decode_seq_lens: torch.Tensor
    decode_key_mask: torch.Tensor
    prefills: tuple[PrefillSpan, ...]
    token_block_table: torch.Tensor | None = None
    token_seq_lens: torch.Tensor | None = None
    prefill_count: int | None = None
    # Hybrid models: tokenmill.linear_attention.state_cache.LinearStateMetadata (state slots of the
    # linear layers), set by the runner; None for attention-only models.
    linear_state: Any = None
    # The row count that picks the step's kernels where the measured plan chooses per row count (the lean
    # decode step's quantized-kernel check); None: the step's tokens. A verify step run as decode rows
    # sets it to its requests, the batch plain decoding would run, so its rows take plain decoding's
    # kernels (the quantized kernel's rows are batch invariant) and equal it bit for bit.
    dispatch_rows: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @cached_property
    def prefill_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefill spans as the C prefill kernel reads them, built once per step (S = len(prefills)):
        (token_start [S], num_query [S], num_context [S], block_ids [S, max span blocks]), int64,
        block ids 0-padded."""
        spans = self.prefills
        width = max((len(s.block_ids) for s in spans), default=1)
        table = torch.zeros(len(spans), width, dtype=torch.int64)
        for i, s in enumerate(spans):
            table[i, : len(s.block_ids)] = s.block_ids
        starts = torch.tensor([s.token_start for s in spans], dtype=torch.int64)
        lens = torch.tensor([s.token_end - s.token_start for s in spans], dtype=torch.int64)
        contexts = torch.tensor([s.num_context for s in spans], dtype=torch.int64)
        return starts, lens, contexts, table

    @property
    def num_prefills(self) -> int:
        """Requests with a multi-token query this step (a host int: no device sync)."""
        return len(self.prefills) if self.prefill_count is None else self.prefill_count


class StepLayout(NamedTuple):
    """Where each token of a flat step batch sits (numpy int64; B requests, T tokens).

    query_start_loc [B + 1], seq_lens [B], positions [T], slot_mapping [T], req_of_token [T].
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    req_of_token: np.ndarray


def step_layout(
    query_lens: np.ndarray, num_computed_tokens: np.ndarray, block_table: np.ndarray, block_size: int
) -> StepLayout:
    """Vectorised positions and slots of a step (arguments as in :func:`build_attention_metadata`)."""
    num_reqs = len(query_lens)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_lens = num_computed_tokens + query_lens

    # positions: for token t of request r, num_computed[r] + (t - query_start[r])
    req_of_token = np.repeat(np.arange(num_reqs), query_lens)  # (T,)
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(
        query_start_loc[:-1] - num_computed_tokens, query_lens
    )
    slot_mapping = block_table[req_of_token, positions // block_size] * block_size + positions % block_size
    return StepLayout(query_start_loc, seq_lens, positions, slot_mapping.astype(np.int64), req_of_token)


def build_attention_metadata(
    query_lens: np.ndarray,
    num_computed_tokens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    per_token: bool = False,
) -> tuple[AttentionMetadata, np.ndarray]:
    """Build the step's metadata and positions.

    Args:
        query_lens: [B] int, tokens scheduled per request this step (num_scheduled_tokens).
        num_computed_tokens: [B] int, tokens already in the KV cache per request.
        block_table: [B, max_blocks] int, each request's block ids (0-padded).
        block_size: tokens per block.
        per_token: also build ``token_block_table`` / ``token_seq_lens`` (deterministic mode).
    Returns:
        (metadata, positions) where positions is [T] int64, each token's position in its sequence.
    """
    query_lens = np.asarray(query_lens, dtype=np.int64)
    num_computed_tokens = np.asarray(num_computed_tokens, dtype=np.int64)
    block_table = np.asarray(block_table, dtype=np.int64)
    query_start_loc, seq_lens, positions, slot_mapping, req_of_token = step_layout(
        query_lens, num_computed_tokens, block_table, block_size
    )

    is_decode = query_lens == 1
    decode_reqs = np.nonzero(is_decode)[0]
    decode_token_idx = query_start_loc[decode_reqs]
    if len(decode_reqs):
        decode_lens = seq_lens[decode_reqs]
        max_blocks = int((decode_lens.max() + block_size - 1) // block_size)
        decode_block_table = block_table[decode_reqs, :max_blocks]
        decode_seq_lens = decode_lens
        key_pos = np.arange(max_blocks * block_size)
        decode_key_mask = (key_pos[None, :] < decode_lens[:, None])[:, None, None, :]
    else:
        decode_block_table = np.zeros((0, 1), dtype=np.int64)
        decode_seq_lens = np.zeros(0, dtype=np.int64)
        decode_key_mask = np.zeros((0, 1, 1, block_size), dtype=bool)

    prefills = []
    for r in np.nonzero(~is_decode & (query_lens > 0))[0]:
        n_blocks = int((seq_lens[r] + block_size - 1) // block_size)
        num_query, num_context = int(query_lens[r]), int(seq_lens[r])
        attn_mask = None
        if num_query != num_context:  # query row i sits at position num_context - num_query + i
            q_pos = torch.arange(num_query).unsqueeze(1) + (num_context - num_query)
            attn_mask = torch.arange(num_context).unsqueeze(0) <= q_pos  # (Lq, Lk)
        prefills.append(
            PrefillSpan(
                token_start=int(query_start_loc[r]),
                token_end=int(query_start_loc[r + 1]),
                num_context=int(seq_lens[r]),
                block_ids=torch.from_numpy(block_table[r, :n_blocks].copy()),
                attn_mask=attn_mask,
            )
        )

    metadata = AttentionMetadata(
        block_size=block_size,
        query_start_loc=torch.from_numpy(query_start_loc),
        seq_lens=torch.from_numpy(seq_lens),
        block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slot_mapping),
        decode_token_idx=torch.from_numpy(decode_token_idx.astype(np.int64)),
        decode_block_table=torch.from_numpy(np.ascontiguousarray(decode_block_table)),
        decode_seq_lens=torch.from_numpy(np.ascontiguousarray(decode_seq_lens, dtype=np.int64)),
        decode_key_mask=torch.from_numpy(np.ascontiguousarray(decode_key_mask)),
        prefills=tuple(prefills),
        token_block_table=torch.from_numpy(block_table[req_of_token]) if per_token else None,
        token_seq_lens=torch.from_numpy(positions + 1) if per_token else None,
    )
    return metadata, positions
