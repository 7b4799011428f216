"""KVEventCollector: the engine-side buffer of KV events between two publishes.

The block pool, the KV cache manager and the lower tiers report into it (O(1) per block; a
component without a collector pays one ``is None`` test); the publisher takes its contents once per
engine step. Thread-safe, because the disk tier's writer and loader threads report removals too.
Pure Python; never imports torch.
"""
from __future__ import annotations

import threading
from typing import Iterable

from tokenmill.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVEventCollector:
    """Events in the order they happened; consecutive removals (and consecutive hash-only stores) of
    one tier are merged into one event.

    Args:
        block_size: the engine's tokens per block (written into every ``BlockStored``).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._lock = threading.Lock()
        # ("stored", BlockStored) | ("stored_hashes", medium, list) | ("removed", medium, list) | ("cleared", medium)
        self._pending: list[tuple] = []

    def block_stored(self, block_hashes: list[int], parent_block_hash: int | None, token_ids: list[int],
                     extra_keys: tuple = (), lora_id: int | None = None, lora_name: str | None = None,
                     medium: str = "pool") -> None:
        """A chain of blocks cached with their tokens (the primary pool)."""
        event = BlockStored(tuple(block_hashes), parent_block_hash, tuple(token_ids), self.block_size, medium,
                            lora_id, lora_name, tuple(extra_keys))
        with self._lock:
            self._pending.append(("stored", event))

    def hashes_stored(self, block_hashes: Iterable[int], medium: str) -> None:
        """Blocks stored in a lower tier, known by hash only."""
        self._add_hashes("stored_hashes", block_hashes, medium)

    def block_removed(self, block_hashes: Iterable[int], medium: str) -> None:
        """Blocks that left ``medium``."""
        self._add_hashes("removed", block_hashes, medium)

    def _add_hashes(self, kind: str, block_hashes: Iterable[int], medium: str) -> None:
        with self._lock:
            last = self._pending[-1] if self._pending else None
            if last is not None and last[0] == kind and last[1] == medium:
                last[2].extend(block_hashes)
            else:
                self._pending.append((kind, medium, list(block_hashes)))

    def all_cleared(self, medium: str | None = None) -> None:
        """Every block of ``medium`` (None: of every tier) is gone."""
        with self._lock:
            self._pending.append(("cleared", medium))

    def take(self) -> list[KVEvent]:
        """The events reported since the last call, oldest first."""
        with self._lock:
            pending, self._pending = self._pending, []
        events: list[KVEvent] = []
        for item in pending:
            kind = item[0]
            if kind == "stored":
                events.append(item[1])
            elif kind == "stored_hashes":
                events.append(BlockStored(tuple(item[2]), None, None, self.block_size, item[1]))
            elif kind == "removed":
                events.append(BlockRemoved(tuple(item[2]), item[1]))
            else:
                events.append(AllBlocksCleared(item[1]))
        return [e for e in events if not isinstance(e, (BlockStored, BlockRemoved)) or e.block_hashes]
