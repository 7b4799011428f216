"""LinearStateCache: the state tensors of a hybrid model's linear layers, one slot per running sequence, and the
prefix cache's state checkpoints.

The runner owns it (allocated beside the paged KV pool); the KV cache manager hands out its slot ids and plans
the checkpoint copies (``tokenmill.kv_cache.state_slots``). Each step, :meth:`LinearStateCache.step_metadata`
zeroes the slots of requests that start from their first token, copies checkpoints into the slots of requests
that resume from a prefix hit (:meth:`~LinearStateCache.begin_step`), and describes which slot each request uses
and where its state is saved. The CUDA runner's padded decode steps instead read a fixed description
(:meth:`~LinearStateCache.decode_metadata`, slots from a static buffer, padding rows on a padding slot) that a
CUDA graph captures, with ``begin_step`` before and :meth:`~LinearStateCache.save_decode_checkpoints` after it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tokenmill.kv_cache.state_slots import StateCheckpoints, StateSlotAllocator


@dataclass(frozen=True)
class LinearStateMetadata:
    """Per-step description of the linear layers' work (B requests this step, on the host unless noted).

    conv_state: [num_linear_layers, num_slots, conv_dim, kernel - 1], the last inputs of the short conv.
    recurrent_state: [num_linear_layers, num_slots, num_v_heads, head_k_dim, head_v_dim] float32.
    slot_ids: [B] int64 (device), each request's slot.
    query_start_loc: [B + 1] int64 numpy, as in AttentionMetadata.
    num_computed: [B] int64 numpy, each request's absolute position of its first token this step.
    decode_reqs: [Bd] int64 (device), requests with one token this step (batched recurrent update);
    decode_token_idx: [Bd] int64 (device), their flat token index.
    prefill_reqs: host list of requests with several tokens (chunked delta rule, one request at a time).
    saves: request index -> [(k, checkpoint slot)], ascending k: copy the request's state after its first k
        tokens of this step into the checkpoint tensors (prefix caching's state checkpoints).
    checkpoint_conv / checkpoint_recurrent: the checkpoint tensors, shaped like conv_state / recurrent_state
        with num_checkpoints slots (None without prefix caching).
    batch_invariant: deterministic mode (every token through the token-by-token kernel).
    """

    conv_state: torch.Tensor
    recurrent_state: torch.Tensor
    slot_ids: torch.Tensor
    query_start_loc: np.ndarray
    num_computed: np.ndarray
    decode_reqs: torch.Tensor
    decode_token_idx: torch.Tensor
    prefill_reqs: list[int]
    saves: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    checkpoint_conv: torch.Tensor | None = None
    checkpoint_recurrent: torch.Tensor | None = None
    batch_invariant: bool = False


class LinearStateCache:
    """Conv and recurrent state of every linear layer for ``num_slots`` sequences.

    Args:
        model: a hybrid model exposing ``linear_state_shapes()`` -> (num_linear_layers, conv_dim,
            conv_kernel, num_v_heads, head_k_dim, head_v_dim).
        num_slots: sequences that can run at once (the scheduler's max_num_seqs).
        dtype: conv state dtype (the activations'); the recurrent state is always float32.
        num_padding_slots: extra slots after the live ones that the allocator never hands out (the CUDA runner's
            padded decode rows read and write slot ``num_slots``; ``padding_slot``).
        checkpoints: prefix caching's checkpoint slots (their tensors are allocated here), or None.
    """

    def __init__(self, model, num_slots: int, dtype: torch.dtype, device: torch.device,
                 num_padding_slots: int = 0, checkpoints: StateCheckpoints | None = None) -> None:
        num_layers, conv_dim, kernel, num_heads, dk, dv = model.linear_state_shapes()
        self.slots = StateSlotAllocator(num_slots, checkpoints)
        self.padding_slot = num_slots if num_padding_slots else None
        rows = num_slots + num_padding_slots
        self.conv_state = torch.zeros(num_layers, rows, conv_dim, kernel - 1, dtype=dtype, device=device)
        self.recurrent_state = torch.zeros(num_layers, rows, num_heads, dk, dv, dtype=torch.float32, device=device)
        self.checkpoint_conv: torch.Tensor | None = None  # prefix caching's state checkpoints (allocate_checkpoints)
        self.checkpoint_recurrent: torch.Tensor | None = None
        self.device = device
        self.batch_invariant = False  # deterministic mode (set by the engine hook)
        if checkpoints is not None:
            self.allocate_checkpoints(checkpoints.num_slots)

    def allocate_checkpoints(self, num_checkpoints: int) -> None:
        """Allocate ``num_checkpoints`` prefix-cache state checkpoints, shaped like the live slots (each one more
        sequence's bytes)."""
        shape = (self.conv_state.shape[0], num_checkpoints)
        self.checkpoint_conv = torch.zeros(*shape, *self.conv_state.shape[2:], dtype=self.conv_state.dtype,
                                           device=self.device)
        self.checkpoint_recurrent = torch.zeros(*shape, *self.recurrent_state.shape[2:], dtype=torch.float32,
                                                device=self.device)

    @property
    def bytes_per_sequence(self) -> int:
        """State bytes one running sequence holds across all linear layers."""
        per = self.conv_state[:, 0].numel() * self.conv_state.element_size()
        return per + self.recurrent_state[:, 0].numel() * self.recurrent_state.element_size()

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of the prefix-cache state checkpoints (0 without prefix caching)."""
        if self.checkpoint_conv is None:
            return 0
        return (self.checkpoint_conv.numel() * self.checkpoint_conv.element_size()
                + self.checkpoint_recurrent.numel() * self.checkpoint_recurrent.element_size())

    def checkpoint_payload(self, block_hash: int) -> bytes | None:
        """The prefix-cache checkpoint held for ``block_hash`` as bytes (``bytes_per_sequence`` of them: the conv
        state ``[linear layers, conv_dim, kernel - 1]`` in the activation dtype, then the recurrent state
        ``[linear layers, value heads, head_k_dim, head_v_dim]`` float32), or None when none is ready. The disk
        KV tier stores it after the block's KV bytes."""
        checkpoints = self.slots.checkpoints
        slot = checkpoints.ready_slot(block_hash) if checkpoints is not None else None
        if slot is None:
            return None
        return _tensor_bytes(self.checkpoint_conv[:, slot]) + _tensor_bytes(self.checkpoint_recurrent[:, slot])

    def install_checkpoint(self, block_hash: int, payload: memoryview | bytes) -> bool:
        """Make ``payload`` (``checkpoint_payload``'s layout) the checkpoint of ``block_hash``, resumable from the
        next plan on. Call between planning and the forward or between steps (the disk tier does so when a
        block arrives). Returns False when it is already held or no checkpoint slot is free of this step.

        Raises:
            ValueError: a payload of another size than ``bytes_per_sequence``.
        """
        if len(payload) != self.bytes_per_sequence:
            raise ValueError(f"a state checkpoint holds {self.bytes_per_sequence} bytes, got {len(payload)}")
        checkpoints = self.slots.checkpoints
        slot = checkpoints.adopt(block_hash) if checkpoints is not None else None
        if slot is None:
            return False
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        num_conv = self.checkpoint_conv[:, slot].numel() * self.checkpoint_conv.element_size()
        conv = data[:num_conv].view(self.checkpoint_conv.dtype).view(self.checkpoint_conv[:, slot].shape)
        recurrent = data[num_conv:].view(torch.float32).view(self.checkpoint_recurrent[:, slot].shape)
        self.checkpoint_conv[:, slot] = conv.to(self.device)
        self.checkpoint_recurrent[:, slot] = recurrent.to(self.device)
        return True

    def begin_step(self, requests, query_lens: np.ndarray, num_computed: np.ndarray
                   ) -> tuple[torch.Tensor, dict[int, list[tuple[int, int]]]]:
        """The state work due before a step's forward: zero the slots of requests computing from their first token
        (new, or recomputed after preemption), copy checkpoints into the slots of requests resuming from a prefix
        hit. Returns (each request's slot [B] int64 on the host, the step's checkpoint saves: request index ->
        ascending [(k, checkpoint slot)], the state after its first k tokens of this step)."""
        slot_ids = torch.tensor([self.slots.slot_of(r.request_id) for r in requests], dtype=torch.int64)
        fresh = slot_ids[torch.from_numpy(num_computed == 0)]
        if len(fresh):
            self.conv_state[:, fresh.to(self.device)] = 0
            self.recurrent_state[:, fresh.to(self.device)] = 0
        ops = self.slots.take_step_ops()
        if ops.restores:
            live = torch.tensor([self.slots.slot_of(rid) for rid, _ in ops.restores], device=self.device)
            ckpt = torch.tensor([slot for _, slot in ops.restores], device=self.device)
            self.conv_state[:, live] = self.checkpoint_conv[:, ckpt]
            self.recurrent_state[:, live] = self.checkpoint_recurrent[:, ckpt]
        saves: dict[int, list[tuple[int, int]]] = {}
        if ops.saves:
            index = {r.request_id: i for i, r in enumerate(requests)}
            for rid, position, slot in ops.saves:
                i = index[rid]
                k = position - int(num_computed[i])
                assert 0 < k <= query_lens[i], f"checkpoint at {position} outside {rid}'s chunk"
                saves.setdefault(i, []).append((k, slot))
            for entries in saves.values():
                entries.sort()
        return slot_ids, saves

    def step_metadata(self, metadata, requests, query_lens: np.ndarray, num_computed: np.ndarray):
        """``metadata`` (an AttentionMetadata) with ``linear_state`` set for this step's requests, after
        :meth:`begin_step` (zeroed slots for requests from their first token, checkpoints copied in for requests
        resuming from a prefix hit). The request layout is the flat one of ``query_lens`` [B]."""
        slot_ids, saves = self.begin_step(requests, query_lens, num_computed)
        qsl = np.concatenate(([0], np.cumsum(query_lens))).astype(np.int64)
        decode = np.nonzero(query_lens == 1)[0]
        linear = LinearStateMetadata(
            conv_state=self.conv_state,
            recurrent_state=self.recurrent_state,
            slot_ids=slot_ids.to(self.device),
            query_start_loc=qsl,
            num_computed=num_computed,
            decode_reqs=torch.from_numpy(decode).to(self.device),
            decode_token_idx=torch.from_numpy(qsl[decode]).to(self.device),
            prefill_reqs=np.nonzero(query_lens > 1)[0].tolist(),
            saves=saves,
            checkpoint_conv=self.checkpoint_conv,
            checkpoint_recurrent=self.checkpoint_recurrent,
            batch_invariant=self.batch_invariant,
        )
        return replace(metadata, linear_state=linear)

    def decode_metadata(self, slot_ids: torch.Tensor) -> LinearStateMetadata:
        """The fixed description of a padded decode step of B rows (one token each, row i = token i) whose slots
        are the device buffer ``slot_ids`` [B] (padding rows: ``padding_slot``): every field a fixed-address tensor
        or a constant, so a CUDA graph captured over it replays with whatever the buffer holds. The step's
        zeroing/restores (:meth:`begin_step`) run before it and its checkpoint saves (:meth:`save_decode_checkpoints`)
        after it, outside the graph."""
        rows = slot_ids.shape[0]
        index = torch.arange(rows, dtype=torch.int64, device=slot_ids.device)
        return LinearStateMetadata(
            conv_state=self.conv_state, recurrent_state=self.recurrent_state, slot_ids=slot_ids,
            query_start_loc=np.arange(rows + 1, dtype=np.int64), num_computed=np.zeros(rows, dtype=np.int64),
            decode_reqs=index, decode_token_idx=index, prefill_reqs=[], saves={},
            checkpoint_conv=self.checkpoint_conv, checkpoint_recurrent=self.checkpoint_recurrent,
        )

    def save_decode_checkpoints(self, saves: dict[int, list[tuple[int, int]]], slot_ids: torch.Tensor) -> None:
        """After a one-token-per-request step that ran on :meth:`decode_metadata`: copy the slot of each request
        in ``saves`` (as :meth:`begin_step` returned; its token reached a checkpoint) into that checkpoint, every
        linear layer's conv and recurrent state. ``slot_ids``: [B] host, each request's slot."""
        if not saves:
            return
        live = torch.tensor([int(slot_ids[i]) for i in saves], device=self.device)
        ckpt = torch.tensor([entries[0][1] for entries in saves.values()], device=self.device)
        self.checkpoint_conv[:, ckpt] = self.conv_state[:, live]
        self.checkpoint_recurrent[:, ckpt] = self.recurrent_state[:, live]


def scratch_metadata(metadata, model, query_lens: np.ndarray, dtype: torch.dtype, device: torch.device):
    """``metadata`` with a ``linear_state`` over a throw-away pool, request i on zeroed slot i, no checkpoints (the
    CUDA runner's memory-profiling step, which runs before the real pool exists). ``query_lens``: [B] host, flat
    layout, every request from its first token."""
    num_layers, conv_dim, kernel, num_heads, dk, dv = model.linear_state_shapes()
    num_reqs = len(query_lens)
    qsl = np.concatenate(([0], np.cumsum(query_lens))).astype(np.int64)
    decode = np.nonzero(query_lens == 1)[0]
    linear = LinearStateMetadata(
        conv_state=torch.zeros(num_layers, num_reqs, conv_dim, kernel - 1, dtype=dtype, device=device),
        recurrent_state=torch.zeros(num_layers, num_reqs, num_heads, dk, dv, dtype=torch.float32, device=device),
        slot_ids=torch.arange(num_reqs, device=device), query_start_loc=qsl,
        num_computed=np.zeros(num_reqs, dtype=np.int64), decode_reqs=torch.from_numpy(decode).to(device),
        decode_token_idx=torch.from_numpy(qsl[decode]).to(device), prefill_reqs=np.nonzero(query_lens > 1)[0].tolist())
    return replace(metadata, linear_state=linear)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's raw bytes in C order (copied to the host)."""
    return tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
