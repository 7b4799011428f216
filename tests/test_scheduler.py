"""Scheduler on CPU without weights: exact tokens per step, chunked prefill, preemption and no leaks."""
from __future__ import annotations

import random

from tests.scheduler_helpers import EOS, make_request, scheduled, step
from tokenmill.config import SchedulerConfig
from tokenmill.kv_cache import KVCacheManager
from tokenmill.request import RequestStatus
from tokenmill.scheduler import Scheduler


def make_scheduler(num_blocks=100, block_size=4, caching=False, **cfg) -> Scheduler:
    cfg.setdefault("max_model_len", 512)
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, block_size, caching))


def test_chunked_prefill_mixes_with_decode_under_one_budget():
    s = make_scheduler(max_num_batched_tokens=64)
    a, b, c = make_request("a", 100, max_tokens=3), make_request("b", 50), make_request("c", 10)
    for r in (a, b, c):
        s.add_request(r)
    assert scheduled(step(s)) == {"a": 64}
    assert scheduled(step(s)) == {"a": 36, "b": 28}
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0
    assert scheduled(step(s)) == {"a": 1, "b": 22, "c": 10}
    assert scheduled(step(s)) == {"a": 1, "b": 1, "c": 1}
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.output_token_ids == [7, 7, 7]
    # a's blocks came back; b holds 13 blocks (51 tokens), c holds 3 (11 tokens)
    assert s.kv_cache_manager.block_pool.num_free_blocks == 100 - 13 - 3


def test_max_num_seqs_caps_running_requests():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 5))
    assert scheduled(step(s)) == {"r0": 5, "r1": 5}
    assert s.num_waiting == 1


def test_eos_and_stop_token_ids_finish_requests():
    s = make_scheduler(max_num_batched_tokens=100)
    a = make_request("a", 5, max_tokens=10)
    b = make_request("b", 5, max_tokens=10, stop_token_ids=[42])
    c = make_request("c", 5, max_tokens=2, ignore_eos=True)
    for r in (a, b, c):
        s.add_request(r)
    step(s, token={"a": EOS, "b": 42, "c": EOS})
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason is None
    assert b.status == RequestStatus.FINISHED_STOPPED and b.stop_reason == 42
    assert c.status == RequestStatus.RUNNING
    step(s, token=EOS)
    assert c.status == RequestStatus.FINISHED_LENGTH_CAPPED and c.output_token_ids == [EOS, EOS]


def test_preemption_evicts_newest_and_recomputes():
    # 6 blocks of 4 tokens. a and b (7-token prompts) take 2 blocks each; decode growth runs out.
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=100)
    a, b = make_request("a", 7, max_tokens=8), make_request("b", 7, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    assert scheduled(step(s)) == {"a": 7, "b": 7}
    step(s)  # computes position 7: 8 tokens, still 2 blocks each
    assert s.kv_cache_manager.block_pool.num_free_blocks == 2
    step(s)  # position 8 needs a third block each: pool full
    assert s.kv_cache_manager.block_pool.num_free_blocks == 0
    for _ in range(3):  # positions 9..11 fit in the third blocks
        step(s)
    out = s.schedule()  # position 12 needs a fourth block: b (newest) is preempted for a
    assert out.preempted_req_ids == {"b"} and scheduled(out) == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting.peek() is b
    from tests.scheduler_helpers import runner_output
    s.update_from_output(out, runner_output(out))
    while s.has_unfinished_requests():
        step(s)
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert s.num_preemptions_total >= 1
    s.kv_cache_manager.check_integrity()
    assert s.kv_cache_manager.block_pool.num_free_blocks == 6


def test_abort_frees_blocks_of_waiting_and_running_requests():
    s = make_scheduler(max_num_batched_tokens=8)
    a, b = make_request("a", 20), make_request("b", 6)
    s.add_request(a)
    s.add_request(b)
    step(s)
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.block_pool.num_free_blocks == 100


def test_prefix_hit_skips_cached_tokens():
    s = make_scheduler(caching=True, max_num_batched_tokens=100)
    s.add_request(make_request("a", 18))
    step(s)
    b = make_request("b", list(range(10, 26)) + [1, 2, 3])
    s.add_request(b)
    out = step(s)
    assert scheduled(out)["b"] == 19 - 16 and b.num_cached_tokens == 16


def test_random_workload_with_aborts_never_leaks():
    rng = random.Random(1)
    s = make_scheduler(num_blocks=40, caching=True, max_num_batched_tokens=32, max_num_seqs=8)
    n = 0
    for it in range(600):
        if rng.random() < 0.3:
            prefix = [5] * rng.choice([0, 8, 16])
            s.add_request(make_request(f"r{n}", prefix + [rng.randrange(100) for _ in range(rng.randrange(1, 30))],
                                       max_tokens=rng.randrange(1, 12)))
            n += 1
        if s.requests and rng.random() < 0.1:
            s.finish_requests([rng.choice(sorted(s.requests))], RequestStatus.FINISHED_ABORTED)
        step(s, token=rng.randrange(3, 100))
        for r in s.running:
            assert r.num_computed_tokens <= r.num_tokens
        if not s.has_unfinished_requests():
            s.kv_cache_manager.check_integrity()
    while s.has_unfinished_requests():
        step(s)
    s.kv_cache_manager.check_integrity()
    assert s.kv_cache_manager.block_pool.num_free_blocks == 40
