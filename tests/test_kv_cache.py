"""Block pool, free list and prefix-cache bookkeeping: exact block ids, hits and eviction order (no model)."""
from __future__ import annotations

import random

from tests.scheduler_helpers import make_request
from tokenmill.kv_cache import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheManager


def test_free_queue_is_fifo_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 4, 0]
    assert queue.num_free_blocks == 4


def test_pool_allocates_lowest_ids_first_and_frees_to_the_tail():
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(3)
    assert [x.block_id for x in a] == [0, 1] and [x.block_id for x in b] == [2, 3, 4]
    pool.free_blocks(list(reversed(a)))
    assert [x.block_id for x in pool.free_block_queue] == [5, 1, 0]
    pool.check_integrity()


def test_every_listener_the_pool_is_built_with_hears_each_eviction_and_reset_in_order():
    """The lower tiers' planner and a hybrid model's checkpoints both listen (one slot used to hold only one)."""
    from tokenmill.kv_cache.state_slots import StateCheckpoints, StateSlotAllocator

    class Tiers:  # the store below the pool: nothing is below, nothing loads
        def lookup(self, block_hashes):
            return []

        def load_async(self, block_hashes):
            raise AssertionError("nothing is on disk")

    heard = []

    class Recorder:
        def block_evicted(self, block_id, block_hash):
            heard.append(("evicted", block_id, block_hash))

        def prefix_cache_reset(self):
            heard.append(("reset",))

    checkpoints = StateCheckpoints(4, interval=1)
    kv = KVCacheManager(num_blocks=3, block_size=4, lower_tiers=Tiers(),
                        state_slots=StateSlotAllocator(2, checkpoints))
    kv.block_pool.listeners += (Recorder(),)
    assert kv.block_pool.listeners[:2] == (kv.offload, checkpoints)
    pool = kv.block_pool
    blocks = pool.get_new_blocks(2)
    for i, block in enumerate(blocks):
        pool.cache_block(block, 100 + i)
        slot = checkpoints.reserve(100 + i)
        assert slot is not None
    checkpoints.end_step()
    pool.free_blocks(blocks)
    assert len(checkpoints) == 2
    pool.get_new_blocks(3)  # the free block first, then both cached blocks, least recently freed first
    assert heard == [("evicted", 0, 100), ("evicted", 1, 101)]
    assert kv.offload.take_transfers()[0] == [(0, 100), (1, 101)]  # the planner queued both copies out
    assert len(checkpoints) == 0  # and both checkpoints left with their blocks
    pool.free_blocks(pool.blocks)
    assert pool.reset_prefix_cache() and heard[-1] == ("reset",)


def test_prefix_hit_reuses_whole_blocks_and_leaves_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = make_request("a", list(range(100, 110)))  # 10 tokens: 2 full blocks + 2
    hits, n = kv.get_computed_blocks(a)
    assert (hits, n) == ([], 0)
    assert [b.block_id for b in kv.allocate_slots(a, 10)] == [0, 1, 2]
    # Same 8-token prefix, different tail.
    b = make_request("b", list(range(100, 108)) + [5, 6, 7])
    hits, n = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [0, 1] and n == 8
    assert [x.block_id for x in kv.allocate_slots(b, 3, hits)] == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    # A prompt that is exactly the cached 8 tokens hits only 1 block: the last token is recomputed.
    c = make_request("c", list(range(100, 108)))
    hits, n = kv.get_computed_blocks(c)
    assert [x.block_id for x in hits] == [0] and n == 4
    assert kv.prefix_cache_hits == 12 and kv.prefix_cache_queries == 10 + 11 + 8


def test_cache_salt_separates_identical_prompts():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    b = make_request("b", list(range(12)))
    b.cache_salt = "tenant-2"
    assert kv.get_computed_blocks(b) == ([], 0)


def test_eviction_is_lru_and_tail_blocks_go_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", list(range(100, 112)))  # blocks 0,1,2 (all full)
    kv.allocate_slots(a, 12)
    b = make_request("b", list(range(200, 212)))  # blocks 3,4,5
    kv.allocate_slots(b, 12)
    kv.free(a)
    kv.free(b)
    pool = kv.block_pool
    assert [x.block_id for x in pool.free_block_queue] == [2, 1, 0, 5, 4, 3]
    # A hit on a's first block takes it out of the free list; new blocks evict in LRU order.
    a2 = make_request("a2", list(range(100, 104)) + [1, 1, 1, 1, 1])
    hits, n = kv.get_computed_blocks(a2)
    assert [x.block_id for x in hits] == [0] and n == 4
    new = kv.allocate_slots(a2, 5, hits)
    assert [x.block_id for x in new] == [2, 1]
    a_hashes = a.block_hashes
    assert list(pool.evicted_block_hashes) == [a_hashes[2], a_hashes[1]]
    assert pool.get_cached_block(a_hashes[0]).block_id == 0
    kv.check_integrity()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", 8)
    kv.allocate_slots(a, 8)
    b = make_request("b", 12)
    assert kv.allocate_slots(b, 12) is None
    assert kv.block_pool.num_free_blocks == 1 and "b" not in kv.req_to_blocks
    kv.check_integrity()


def test_random_allocate_free_never_leaks():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=64, block_size=4)
    live = {}
    for step in range(2000):
        if live and rng.random() < 0.4:
            req = live.pop(rng.choice(sorted(live)))
            kv.free(req)
        else:
            prefix = [rng.randrange(3)] * rng.randrange(0, 12)
            req = make_request(f"r{step}", prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 20))])
            hits, n = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - n, hits) is not None:
                req.num_computed_tokens = req.num_tokens
                live[req.request_id] = req
        if step % 100 == 0:
            kv.check_integrity()
    for req in live.values():
        kv.free(req)
    kv.check_integrity()
    assert kv.block_pool.num_free_blocks == 64
