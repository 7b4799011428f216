"""OffloadPlanner: the KV cache manager's side of the lower KV tiers (host RAM, disk).

Pure CPU bookkeeping; never imports torch. It plans, per step, which primary-pool blocks must be
copied out before they are overwritten (write-back of evicted cached blocks) and which freshly
taken blocks must be filled from a lower tier before the forward; the copies themselves are done
by ``tokenmill.kv_offload.TieredKVStore``, which implements ``LowerTiers``.
"""
from __future__ import annotations

from typing import Protocol

from tokenmill.kv_cache.block_pool import BlockPool, KVCacheBlock

RAM_TIER = "ram"  # in host memory now: can be copied into the primary pool this step
DISK_TIER = "disk"  # on disk: must be read back (load_async) before it can be used


class LowerTiers(Protocol):
    """What the KV cache manager asks of the tiers below the primary pool."""

    def lookup(self, block_hashes: list[int]) -> list[str]:
        """Tier (RAM_TIER or DISK_TIER) of each leading block hash held below the primary pool,
        stopping at the first miss. Must not change what is stored (it runs while planning)."""
        ...

    def load_async(self, block_hashes: list[int]) -> None:
        """Start reading these blocks from disk into host memory; later lookups report RAM_TIER."""
        ...


class OffloadPlanner:
    """Turns evictions and lower-tier hits into per-step copy lists.

    Evictions are reported by the pool (this is one of its listeners) in the order they happen; a block that
    was filled from a lower tier in this same step and is evicted again before the step ran is
    neither copied out (its data never arrived) nor loaded (nobody can use it any more).

    Args:
        lower_tiers: the store below the pool.

    The pool is given to each call that takes blocks from it (``extend_hits``, ``cached_blocks``), so the planner
    can be one of the pool's listeners from its construction on.
    """

    def __init__(self, lower_tiers: LowerTiers) -> None:
        self.lower_tiers = lower_tiers
        self._offloads: list[tuple[int, int]] = []  # (block_id, block_hash) to copy out, eviction order
        self._loads: dict[int, int] = {}  # block_id -> block_hash to copy in, this step
        self.loading: dict[str, list[int]] = {}  # request_id -> block hashes on their way back from disk

    def block_evicted(self, block_id: int, block_hash: int) -> None:
        """A cached block is reused (``BlockPoolListener``): queue its copy out, unless it was filled from below
        this same step."""
        if self._loads.pop(block_id, None) is not None:
            return  # filled from a lower tier this step and already evicted: the data is still below
        self._offloads.append((block_id, block_hash))

    def prefix_cache_reset(self) -> None:
        """The pool forgot its hashes (``BlockPoolListener``); what is below stays valid: nothing to do."""

    def is_loading(self, request_id: str) -> bool:
        return request_id in self.loading

    def forget(self, request_id: str) -> None:
        """The request left (finished, aborted or preempted): stop waiting on its loads."""
        self.loading.pop(request_id, None)

    def extend_hits(
        self, pool: BlockPool, request_id: str, block_hashes: list[int], hits: list[KVCacheBlock]
    ) -> list[KVCacheBlock] | None:
        """Continue a prefix hit of ``pool`` (the primary pool) below it.

        ``block_hashes`` are the request's hashes after its primary ``hits``. Returns the extra hit
        blocks (taken from the pool, indexed by hash, queued to be filled this step, left free so
        ``allocate_slots`` takes them like any cached block), or None while some of them are still
        on disk: their load has been started and the request should wait.
        """
        tiers = self.lower_tiers.lookup(block_hashes)
        on_disk = [h for h, tier in zip(block_hashes, tiers) if tier == DISK_TIER]
        if on_disk:
            self.lower_tiers.load_async(on_disk)
            self.loading[request_id] = on_disk
            return None
        self.loading.pop(request_id, None)
        return self._promote(pool, block_hashes[: len(tiers)], hits)

    def _promote(self, pool: BlockPool, block_hashes: list[int], hits: list[KVCacheBlock]) -> list[KVCacheBlock]:
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        num = min(len(block_hashes), pool.num_free_blocks - num_evictable_hits)
        if num <= 0:
            return []
        pool.touch(hits)  # keep the primary hits out of reach of the blocks taken below
        blocks = pool.get_new_blocks(num)
        for block, block_hash in zip(blocks, block_hashes):
            pool.cache_block(block, block_hash)
            self._loads[block.block_id] = block_hash
        pool.free_blocks(list(reversed(blocks)))
        pool.free_blocks(list(reversed(hits)))
        return blocks

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (blocks_to_offload, blocks_to_load), each a list of (block_id, block_hash)."""
        offloads, loads = self._offloads, list(self._loads.items())
        self._offloads, self._loads = [], {}
        return offloads, loads
