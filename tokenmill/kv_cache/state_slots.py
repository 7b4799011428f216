"""StateSlotAllocator: the second pool of hybrid (linear-attention) models, one fixed-size slot per running sequence,
and StateCheckpoints, the prefix cache's linear-state snapshots keyed by block hash.

Pure CPU bookkeeping; never imports torch. A slot id indexes the runner's state tensors (conv state +
recurrent state of every linear layer, ``tokenmill.linear_attention.state_cache``). The KV cache
manager consults it in ``allocate_slots`` (a request is admitted only if both pools can hold it) and
frees the slot in ``free`` (finish, abort, preemption); recompute starts the state from zeros again, or
from a checkpoint when its prefix hits the cache. The allocator is shared with the runner, which takes each
step's checkpoint copies from it (:meth:`StateSlotAllocator.take_step_ops`) before the forward.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tokenmill.config import ConfigError

GIB = 1024**3


def state_bytes_per_sequence(num_linear_layers: int, conv_dim: int, conv_kernel: int, num_v_heads: int,
                             head_k_dim: int, head_v_dim: int, conv_dtype_bytes: int) -> int:
    """Bytes one sequence's state slot holds across a hybrid model's linear layers: per layer the conv state
    (``conv_dim`` x (``conv_kernel`` - 1) in the activation dtype) and the recurrent state (``num_v_heads`` x
    ``head_k_dim`` x ``head_v_dim`` float32). Shared by the runner's pool and `tokenmill plan`."""
    conv = conv_dim * (conv_kernel - 1) * conv_dtype_bytes
    return num_linear_layers * (conv + num_v_heads * head_k_dim * head_v_dim * 4)


def state_pool_sizes(budget_bytes: int | None, bytes_per_sequence: int, max_num_seqs: int,
                     enable_prefix_caching: bool) -> tuple[int, int]:
    """(live slots, prefix-cache checkpoint slots) of a hybrid model's state pool. Shared by the engine and
    `tokenmill plan`.

    ``budget_bytes`` None (no ``state_cache_memory``): ``max_num_seqs`` live slots and, with prefix caching,
    ``max_num_seqs`` checkpoints. Otherwise the pool holds n = floor(budget / bytes_per_sequence) sequences'
    state: min(max_num_seqs, n) live slots (fewer than ``max_num_seqs`` caps how many sequences run at once:
    the scheduler admits a request only when a slot is free) and, with prefix caching, the n - live others as
    checkpoints.

    Raises:
        ConfigError: the budget holds no sequence's state (naming ``state_cache_memory``).
    """
    if budget_bytes is None:
        return max_num_seqs, max_num_seqs if enable_prefix_caching else 0
    n = budget_bytes // bytes_per_sequence
    if n < 1:
        raise ConfigError(f"`state_cache_memory` of {budget_bytes / GIB:.3g} GiB holds no sequence's linear-attention "
                          f"state of {bytes_per_sequence} bytes: raise `state_cache_memory`")
    live = min(max_num_seqs, n)
    return live, n - live if enable_prefix_caching else 0


class StateCheckpoints:
    """Linear-layer state snapshots for prefix caching: ``num_slots`` checkpoint slots, each holding the state
    of every linear layer after the first (i + 1) * block_size tokens of a prefix whose block i has hash h,
    for block indices i with (i + 1) % ``interval`` == 0 (block-aligned, every ``interval`` blocks).

    Keyed by the same chained block hash as the KV blocks (equal hash = equal prefix = equal state). Memory is
    bounded by ``num_slots``: a new checkpoint takes a free slot, else the least recently used one; a checkpoint
    is dropped when its KV block is evicted (``drop``) or the prefix cache is reset (``clear``). A slot written
    or read in the current step is never handed to another hash before that step has run, and a checkpoint
    written in this step is not resumable until then (``end_step``). All operations are O(1) but ``reserve``'s
    skip over this step's slots.

    It listens to the block pool (``BlockPoolListener``): an evicted block's checkpoint is dropped unless
    ``drop_on_evict`` is off (with lower KV tiers the block lives on below the pool, and its checkpoint with it
    until the LRU reuses the slot); a prefix-cache reset drops them all.

    Raises:
        ValueError: ``num_slots`` or ``interval`` < 1.
    """

    def __init__(self, num_slots: int, interval: int, drop_on_evict: bool = True) -> None:
        if num_slots < 1 or interval < 1:
            raise ValueError(f"num_slots and state_checkpoint_interval must be >= 1, got {num_slots}, {interval}")
        self.num_slots = num_slots
        self.interval = interval
        self.drop_on_evict = drop_on_evict
        self._lru: OrderedDict[int, int] = OrderedDict()  # block_hash -> slot, least recently used first
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._busy: set[int] = set()  # slots read or written by the step being planned
        self._pending: set[int] = set()  # hashes whose state the step being planned writes
        self._deferred: list[int] = []  # slots dropped while busy: free once the step has run
        self.num_saved = 0  # checkpoints written (counters for logs and tests)
        self.num_restored = 0
        self.num_adopted = 0  # checkpoints read back from a lower KV tier (the disk) or a saved session

    def __len__(self) -> int:
        return len(self._lru)

    def ready_slot(self, block_hash: int) -> int | None:
        """The slot of a checkpoint whose state is already written, or None."""
        if block_hash in self._pending:
            return None
        return self._lru.get(block_hash)

    def use(self, block_hash: int) -> int:
        """Take a ready checkpoint for a restore this step (marks it most recently used)."""
        slot = self._lru[block_hash]
        self._lru.move_to_end(block_hash)
        self._busy.add(slot)
        self.num_restored += 1
        return slot

    def _claim(self, block_hash: int) -> int | None:
        """A slot now holding ``block_hash`` as the most recently used: a free one, else the least recently
        used one this step does not use; None when ``block_hash`` is already held or no slot can be taken."""
        if block_hash in self._lru:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._lru.items() if s not in self._busy), None)
            if victim is None:
                return None
            slot = self._lru.pop(victim)
        self._lru[block_hash] = slot
        return slot

    def reserve(self, block_hash: int) -> int | None:
        """A slot to write the checkpoint of ``block_hash`` into this step, or None: already held (first writer
        wins, as for KV blocks) or every slot is in use by this step."""
        slot = self._claim(block_hash)
        if slot is None:
            return None
        self._busy.add(slot)
        self._pending.add(block_hash)
        self.num_saved += 1
        return slot

    def adopt(self, block_hash: int) -> int | None:
        """A slot for a checkpoint of ``block_hash`` that the caller writes at once, outside any step's forward
        (read back from the disk tier or a saved session), ready from now on; None when ``block_hash`` is
        already held or every slot is in use by the step being planned. Takes a free slot, else the least
        recently used one; the adopted checkpoint becomes the most recently used."""
        slot = self._claim(block_hash)
        if slot is None:
            return None
        self.num_adopted += 1
        return slot

    def drop(self, block_hash: int) -> None:
        """Forget the checkpoint of an evicted block (no-op when it has none); a slot busy this step is freed
        only after the step has run."""
        slot = self._lru.pop(block_hash, None)
        if slot is not None:
            self._pending.discard(block_hash)
            (self._deferred if slot in self._busy else self._free).append(slot)

    def clear(self) -> None:
        """Forget every checkpoint (the prefix cache was reset)."""
        for block_hash in list(self._lru):
            self.drop(block_hash)

    def block_evicted(self, block_id: int, block_hash: int) -> None:
        """The pool reused a cached block (``BlockPoolListener``): its checkpoint leaves with it (``drop_on_evict``)."""
        if self.drop_on_evict:
            self.drop(block_hash)

    def prefix_cache_reset(self) -> None:
        """The pool forgot every hash (``BlockPoolListener``)."""
        self.clear()

    def end_step(self) -> None:
        """The planned step is about to run: its checkpoints count as written from the next plan on."""
        self._busy.clear()
        self._pending.clear()
        self._free.extend(self._deferred)
        self._deferred.clear()

    def check_integrity(self) -> None:
        """Every slot is free or held by exactly one hash."""
        held = list(self._lru.values())
        assert len(set(held)) == len(held), "a checkpoint slot is held twice"
        assert sorted(held + self._free + self._deferred) == list(range(self.num_slots)), \
            "checkpoint slots lost or duplicated"


@dataclass
class StateStepOps:
    """Checkpoint copies of one step, for the runner: ``restores`` (request_id, checkpoint slot) copy a checkpoint
    into the request's live slot before the forward; ``saves`` (request_id, token position p, checkpoint slot)
    copy the request's state after its first p tokens (p inside this step's chunk) into a checkpoint."""

    restores: list[tuple[str, int]] = field(default_factory=list)
    saves: list[tuple[str, int, int]] = field(default_factory=list)


class StateSlotAllocator:
    """O(1) allocation of ``num_slots`` state slots keyed by request id.

    ``checkpoints`` (given when prefix caching is on) holds the state snapshots; the KV cache manager
    asks :meth:`resumable_blocks` how much of a prefix hit the linear layers can resume, and :meth:`plan_saves`
    where a scheduled chunk crosses a checkpoint.

    Raises:
        ValueError: ``num_slots`` < 1.
    """

    def __init__(self, num_slots: int, checkpoints: StateCheckpoints | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._slot_of: dict[str, int] = {}
        self.checkpoints = checkpoints
        self._hit: dict[str, int] = {}  # request_id -> block hash of the checkpoint its prefix hit resumes from
        self._ops = StateStepOps()

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def has_slot(self, request_id: str) -> bool:
        return request_id in self._slot_of

    def can_hold(self, request_id: str) -> bool:
        """Whether the request has a slot or one is free for it."""
        return request_id in self._slot_of or bool(self._free)

    def allocate(self, request_id: str, resume: bool = False) -> int:
        """The request's slot, taking a free one on first call; raises AssertionError when none is free.

        ``resume``: the request was just admitted with a prefix hit; its slot gets the checkpoint
        :meth:`resumable_blocks` found (a restore this step)."""
        slot = self._slot_of.get(request_id)
        if slot is None:
            assert self._free, "no free state slot (check can_hold first)"
            slot = self._free.pop()
            self._slot_of[request_id] = slot
        if resume:
            block_hash = self._hit.pop(request_id)
            self._ops.restores.append((request_id, self.checkpoints.use(block_hash)))
        return slot

    def slot_of(self, request_id: str) -> int:
        return self._slot_of[request_id]

    def free(self, request_id: str) -> None:
        """Return the request's slot (no-op when it holds none)."""
        self._hit.pop(request_id, None)
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def resumable_blocks(self, request_id: str, block_hashes: list[int], num_hit_blocks: int) -> int:
        """How many leading blocks of a prefix hit of ``num_hit_blocks`` blocks the linear layers can resume
        after: the largest multiple n of the checkpoint interval, n <= num_hit_blocks, whose block n - 1 has
        a written checkpoint (0: none). Remembers it for :meth:`allocate` (``resume=True``)."""
        self._hit.pop(request_id, None)
        ck = self.checkpoints
        if ck is None:
            return 0
        n = num_hit_blocks - num_hit_blocks % ck.interval
        while n > 0:
            if ck.ready_slot(block_hashes[n - 1]) is not None:
                self._hit[request_id] = block_hashes[n - 1]
                return n
            n -= ck.interval
        return 0

    def plan_saves(self, request_id: str, block_hashes: list[int], start: int, end: int, block_size: int) -> None:
        """Checkpoints for the block-aligned positions p, start < p <= end, every ``interval`` blocks, that this
        step computes (tokens start..end - 1 of the request; ``block_hashes`` cover them)."""
        ck = self.checkpoints
        if ck is None:
            return
        step = ck.interval * block_size
        for p in range((start // step + 1) * step, end + 1, step):
            slot = ck.reserve(block_hashes[p // block_size - 1])
            if slot is not None:
                self._ops.saves.append((request_id, p, slot))

    def take_step_ops(self) -> StateStepOps:
        """This step's checkpoint copies (the runner calls this once per step, before the forward)."""
        ops, self._ops = self._ops, StateStepOps()
        if self.checkpoints is not None:
            self.checkpoints.end_step()
        return ops

    def check_integrity(self) -> None:
        """Every slot is either free or held by exactly one request."""
        held = list(self._slot_of.values())
        assert len(set(held)) == len(held), "a state slot is held twice"
        assert sorted(held + self._free) == list(range(self.num_slots)), "state slots lost or duplicated"
        if self.checkpoints is not None:
            self.checkpoints.check_integrity()
