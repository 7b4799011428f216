"""KVCacheBlock, the O(1) intrusive LRU free list and the BlockPool that owns every block.

Pure CPU bookkeeping; never imports torch. Free blocks that still hold a cached prefix stay
indexed by hash until they are reused (evicted), least recently freed first. Cached blocks freed by an agent
session's request (``free_blocks(..., keep_until=...)``) wait in a second free list, reused only when the plain
one is empty, until their time is up (then they are the first plain blocks to go).
"""
from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING, Protocol, Sequence

from tokenmill.kv_events.events import MEDIUM_POOL

if TYPE_CHECKING:
    from tokenmill.kv_events.collector import KVEventCollector

EVICTION_HISTORY = 4096  # evicted hashes kept for inspection (tests, /debug)


class BlockPoolListener(Protocol):
    """What follows the pool's prefix-cache index, told of its changes in the order they happen: the lower KV
    tiers' planner (an evicted block is copied out) and a hybrid model's state checkpoints (they leave with their
    block). Given to ``BlockPool`` at construction; any number of them."""

    def block_evicted(self, block_id: int, block_hash: int) -> None:
        """Cached block ``block_id`` is being reused: its hash ``block_hash`` left the index."""

    def prefix_cache_reset(self) -> None:
        """``reset_prefix_cache`` forgot every hash."""


class KVCacheBlock:
    """Metadata of one KV block: id, reference count, prefix-cache hash, free-list links."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "keep_until", "session")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.keep_until: float | None = None  # in the session free list until then (a clock reading)
        self.session: str | None = None  # the session that freed it there

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    Front = next to evict (least recently freed). popleft, append and remove are O(1).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} is not in the free list"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the front: the next to be evicted."""
        self._insert_after(self._head, block)

    def _insert_after(self, before: KVCacheBlock, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        after = before.next_free
        before.next_free = block
        block.prev_free = before
        block.next_free = after
        after.prev_free = block
        self.num_free_blocks += 1

    def first(self) -> KVCacheBlock | None:
        """The front block (the next to be evicted), or None when empty."""
        block = self._head.next_free
        return None if block is self._tail else block

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def contains(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None


class BlockPool:
    """All KV blocks, the free list and the prefix-cache index (block_hash -> block).

    Args:
        num_blocks: size of the pool.
        enable_caching: keep hashes of freed full blocks for reuse.
        listeners: told of every eviction of a cached hash and every reset (``BlockPoolListener``), in order.
        kv_events: where cached hashes leaving the pool are reported (KV events), or None.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, listeners: Sequence[BlockPoolListener] = (),
                 kv_events: KVEventCollector | None = None) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Cached blocks an agent session freed, kept until their ``keep_until`` (oldest first), reused only after
        # every plain free block; the blocks each session keeps there.
        self.session_block_queue = FreeKVCacheBlockQueue([])
        self.session_blocks: Counter[str] = Counter()
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}
        # The most recent evictions, oldest first (bounded: a long-running server evicts forever).
        self.evicted_block_hashes: deque[int] = deque(maxlen=EVICTION_HISTORY)
        self.listeners: tuple[BlockPoolListener, ...] = tuple(listeners)
        self.kv_events = kv_events  # KV events (tokenmill.kv_events); None: off

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (plain and session-kept: both can be allocated)."""
        return self.free_block_queue.num_free_blocks + self.session_block_queue.num_free_blocks

    @property
    def num_session_blocks(self) -> int:
        """Free blocks kept for agent sessions (``free_blocks(..., keep_until=...)``)."""
        return self.session_block_queue.num_free_blocks

    def iter_free(self):
        """Every free block: the plain list (next to evict first), then the session-kept one."""
        yield from self.free_block_queue
        yield from self.session_block_queue

    def expire_sessions(self, now: float) -> None:
        """Session-kept blocks whose time is up become plain free blocks, the first to be evicted."""
        queue = self.session_block_queue
        expired = []
        while (block := queue.first()) is not None and block.keep_until <= now:
            queue.remove(block)
            self._leave_session(block)
            expired.append(block)
        for block in reversed(expired):  # the oldest ends up in front
            self.free_block_queue.appendleft(block)

    def _leave_session(self, block: KVCacheBlock) -> None:
        session = block.session
        block.keep_until = block.session = None
        if session is not None:
            self.session_blocks[session] -= 1
            if not self.session_blocks[session]:
                del self.session_blocks[session]

    def _take_free(self, block: KVCacheBlock) -> None:
        """Take a free block out of whichever free list holds it."""
        if block.keep_until is not None:
            self.session_block_queue.remove(block)
            self._leave_session(block)
        else:
            self.free_block_queue.remove(block)

    def usage(self) -> float:
        """Fraction of blocks referenced by running requests (0.0 – 1.0)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the front of the free list, evicting their cached hashes."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            if self.free_block_queue.num_free_blocks:
                block = self.free_block_queue.popleft()
            else:  # only session-kept blocks are left: the oldest goes (its K/V to a lower tier, if any)
                block = self.session_block_queue.popleft()
                self._leave_session(block)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            self.evicted_block_hashes.append(block.block_hash)
            if self.kv_events is not None:
                self.kv_events.block_removed((block.block_hash,), MEDIUM_POOL)
            for listener in self.listeners:
                listener.block_evicted(block.block_id, block.block_hash)
        block.block_hash = None

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; free ones leave the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._take_free(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> bool:
        """Index a full block by its hash (first writer wins; a duplicate keeps its own content).
        Returns whether the block was indexed now."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def discard_cached(self, blocks: list[KVCacheBlock]) -> None:
        """Forget the hashes of blocks whose K/V was never written (a failed step indexed them when it was
        planned). No listener hears of it: nothing may keep a copy of them below the pool. O(len(blocks))."""
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                continue
            block.block_hash = None
            if self.cached_block_hash_to_block.get(block_hash) is block:
                del self.cached_block_hash_to_block[block_hash]
                if self.kv_events is not None:
                    self.kv_events.block_removed((block_hash,), MEDIUM_POOL)

    def import_cached_blocks(self, block_hashes: list[int]) -> list[KVCacheBlock] | None:
        """Index blocks whose content arrives from outside the pool (a restored session, a KV transfer):
        for each hash not cached yet, take a free block (evicting the least recently used), index it
        under the hash and leave it free and cached, the chain's head evicted last.

        All or nothing: None (and nothing changed) when the new hashes outnumber the free blocks.
        Returns the blocks taken, in ``block_hashes`` order, with ``ref_cnt`` 0; the caller writes
        their K/V before the next step runs. Hashes already cached keep their block (same hash, same
        content) and are skipped.
        """
        if not self.enable_caching:
            return None
        wanted = [h for h in dict.fromkeys(block_hashes) if h not in self.cached_block_hash_to_block]
        if len(wanted) > self.num_free_blocks:
            return None
        blocks = self.get_new_blocks(len(wanted))
        for block, block_hash in zip(blocks, wanted):
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
        self.free_blocks(list(reversed(blocks)))
        return blocks

    def free_blocks(self, ordered_blocks: list[KVCacheBlock], keep_until: float | None = None,
                    session: str | None = None) -> None:
        """Drop one reference each; blocks reaching 0 join the tail of the free list in the
        given order (earlier in the list = evicted sooner). With ``keep_until`` (a clock reading, as
        ``expire_sessions`` is given) cached ones go to the session-kept list instead, counted for ``session``."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if keep_until is not None and block.block_hash is not None:
                    block.keep_until, block.session = keep_until, session
                    self.session_block_queue.append(block)
                    if session is not None:
                        self.session_blocks[session] += 1
                else:
                    self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (only when no block is in use). Returns whether it ran."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.expire_sessions(float("inf"))  # no hash left to keep
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.kv_events is not None:
            self.kv_events.all_cleared(MEDIUM_POOL)
        for listener in self.listeners:
            listener.prefix_cache_reset()
        return True

    def check_integrity(self) -> None:
        """Assert free + in-use == total, no referenced block in the free list, index consistent."""
        in_free = 0
        for block in self.iter_free():
            assert block.ref_cnt == 0, f"{block} is free but referenced"
            in_free += 1
        assert in_free == self.num_free_blocks, "free-list length mismatch"
        for block in self.session_block_queue:
            assert block.keep_until is not None and block.block_hash is not None, f"{block} kept without a hash"
        assert sum(self.session_blocks.values()) <= self.num_session_blocks, "session block counts mismatch"
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert in_free + in_use == self.num_blocks, f"leak: free {in_free} + used {in_use} != {self.num_blocks}"
        for h, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == h, f"index points at {block} for hash {h}"
