"""StateSlotAllocator: the second pool of hybrid (linear-attention) models, one fixed-size slot per running sequence.

Pure CPU bookkeeping; never imports torch. A slot id indexes the runner's state tensors (conv state +
recurrent state of every linear layer, ``tokenmill.linear_attention.state_cache``). The KV cache
manager consults it in ``allocate_slots`` (a request is admitted only if both pools can hold it) and
frees the slot in ``free`` (finish, abort, preemption); recompute starts the state from zeros again.
"""
from __future__ import annotations


def state_bytes_per_sequence(num_linear_layers: int, conv_dim: int, conv_kernel: int, num_v_heads: int,
                             head_k_dim: int, head_v_dim: int, conv_dtype_bytes: int) -> int:
    """Bytes one sequence's state slot holds across a hybrid model's linear layers: per layer the conv state
    (``conv_dim`` x (``conv_kernel`` - 1) in the activation dtype) and the recurrent state (``num_v_heads`` x
    ``head_k_dim`` x ``head_v_dim`` float32). Shared by the runner's pool and `tokenmill plan`."""
    conv = conv_dim * (conv_kernel - 1) * conv_dtype_bytes
    return num_linear_layers * (conv + num_v_heads * head_k_dim * head_v_dim * 4)


class StateSlotAllocator:
    """O(1) allocation of ``num_slots`` state slots keyed by request id.

    Raises:
        ValueError: ``num_slots`` < 1.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._slot_of: dict[str, int] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def has_slot(self, request_id: str) -> bool:
        return request_id in self._slot_of

    def can_hold(self, request_id: str) -> bool:
        """Whether the request has a slot or one is free for it."""
        return request_id in self._slot_of or bool(self._free)

    def allocate(self, request_id: str) -> int:
        """The request's slot, taking a free one on first call; raises AssertionError when none is free."""
        slot = self._slot_of.get(request_id)
        if slot is None:
            assert self._free, "no free state slot (check can_hold first)"
            slot = self._free.pop()
            self._slot_of[request_id] = slot
        return slot

    def slot_of(self, request_id: str) -> int:
        return self._slot_of[request_id]

    def free(self, request_id: str) -> None:
        """Return the request's slot (no-op when it holds none)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_integrity(self) -> None:
        """Every slot is either free or held by exactly one request."""
        held = list(self._slot_of.values())
        assert len(set(held)) == len(held), "a state slot is held twice"
        assert sorted(held + self._free) == list(range(self.num_slots)), "state slots lost or duplicated"
