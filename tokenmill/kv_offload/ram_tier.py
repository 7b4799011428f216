"""RamTier: the host-RAM KV tier, a preallocated slab of block slots with LRU eviction by block hash.

Engine thread only. It never reads or writes the primary pool itself; the store hands it block
data to keep and takes back what it evicts.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from tokenmill.kv_offload.stats import TierStats


class RamTier:
    """``capacity_blocks`` slots of one block's bytes each; block_hash -> slot, least recent first.

    Args:
        capacity_blocks: number of slots (>= 1).
        block_bytes: one block's size (``KVPool.block_bytes``: its byte row, scales included).
        pin_memory: page-lock the slab (for fast copies to and from a GPU pool).
    """

    name = "ram"

    def __init__(self, capacity_blocks: int, block_bytes: int, pin_memory: bool = False) -> None:
        assert capacity_blocks >= 1
        self.capacity_blocks = capacity_blocks
        self.slab = torch.empty((capacity_blocks, block_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        self.block_bytes = block_bytes
        self._slots: OrderedDict[int, int] = OrderedDict()  # block_hash -> slot, least recently used first
        self._free_slots = list(range(capacity_blocks - 1, -1, -1))  # pop() gives the lowest slot
        self.stats = TierStats(capacity_blocks=capacity_blocks)
        self.kv_events = None  # a KVEventCollector when KV events are on: stores and evictions are reported

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def hashes(self) -> list[int]:
        """Stored block hashes, least recently used first."""
        return list(self._slots)

    def clear(self) -> None:
        """Forget every stored block (all slots free again); reported as AllBlocksCleared."""
        self._slots.clear()
        self._free_slots = list(range(self.capacity_blocks - 1, -1, -1))
        self.stats.blocks_stored = 0
        if self.kv_events is not None:
            self.kv_events.all_cleared(self.name)

    def block(self, block_hash: int) -> torch.Tensor:
        """A view of one stored block (its recency is left alone)."""
        return self.slab[self._slots[block_hash]]

    def touch(self, block_hash: int) -> None:
        """Mark a stored block most recently used."""
        self._slots.move_to_end(block_hash)

    def read(self, block_hashes: list[int]) -> torch.Tensor:
        """Copies of stored blocks, ``(len(block_hashes), block_bytes)`` uint8; they become most recent."""
        slots = [self._slots[h] for h in block_hashes]
        for h in block_hashes:
            self._slots.move_to_end(h)
        self.stats.bytes_read += len(slots) * self.block_bytes
        return self.slab.index_select(0, torch.tensor(slots, dtype=torch.int64))

    def write(self, block_hashes: list[int], data: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """Store new blocks (``data[i]`` under ``block_hashes[i]``; none may be stored already), most
        recent last. Returns what no longer fits, least recent first, as (block_hash, block data)
        pairs the caller owns: LRU entries pushed out, then any overflow of this write itself."""
        assert not any(h in self._slots for h in block_hashes), "block already stored"
        evicted: list[tuple[int, torch.Tensor]] = []
        overflow = len(block_hashes) - self.capacity_blocks
        if overflow > 0:  # the oldest of this batch go straight down
            evicted += [(h, data[i]) for i, h in enumerate(block_hashes[:overflow])]
            block_hashes, data = block_hashes[overflow:], data[overflow:]
        num_victims = max(0, len(block_hashes) - len(self._free_slots))
        victims = [self._slots.popitem(last=False) for _ in range(num_victims)]
        if victims:
            old = self.slab.index_select(0, torch.tensor([slot for _, slot in victims], dtype=torch.int64))
            evicted = [(h, old[i]) for i, (h, _) in enumerate(victims)] + evicted
            self._free_slots.extend(slot for _, slot in victims)
        slots = [self._free_slots.pop() for _ in block_hashes]
        if slots:
            self.slab.index_copy_(0, torch.tensor(slots, dtype=torch.int64), data.to(self.slab.device))
        for h, slot in zip(block_hashes, slots):
            self._slots[h] = slot
        if self.kv_events is not None:
            if victims:
                self.kv_events.block_removed([h for h, _ in victims], self.name)
            self.kv_events.hashes_stored(block_hashes, self.name)
        self.stats.bytes_written += len(slots) * self.block_bytes
        self.stats.evictions += len(evicted)
        self.stats.blocks_stored = len(self._slots)
        return evicted
