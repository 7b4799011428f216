"""Priority scheduling (vLLM's ``--scheduling-policy priority`` and request field ``priority``): exact order
(lower first, ties first come first served), preemption of lower-priority running requests for a waiting
higher-priority one (for a sequence slot and for KV room), the token budget in priority order, no preemption
among equals; block contents stay right through preemptions (a fake forward checks every hit); through the
engine a preempted request resumes from the RAM tier with the tokens of an undisturbed run; fcfs refuses a
priority, the server answers 400 naming the field."""
from __future__ import annotations

import random

import pytest
import torch

from tests.scheduler_helpers import fake_forward, make_request, runner_output, scheduled, step
from tests.server_fixtures import ServerProcess
from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError, SchedulerConfig
from tokenmill.kv_cache import KVCacheManager
from tokenmill.kv_offload import TieredKVStore
from tokenmill.request import RequestStatus
from tokenmill.runner.kv_pool import KVPool
from tokenmill.scheduler import Scheduler
from tokenmill.scheduler.request_queue import FCFSQueue, PriorityQueue

GIB = 1024**3


def make_scheduler(num_blocks=100, block_size=4, caching=False, policy="priority", **cfg) -> Scheduler:
    cfg.setdefault("max_model_len", 512)
    return Scheduler(SchedulerConfig(policy=policy, **cfg), KVCacheManager(num_blocks, block_size, caching))


def prio(request_id: str, prompt: int, priority: int, arrival: float, max_tokens: int = 2):
    request = make_request(request_id, prompt, max_tokens=max_tokens)
    request.priority, request.arrival_time = priority, arrival
    return request


def run_to_end(s: Scheduler, limit: int = 500) -> list[str]:
    """Step until idle; the request ids in the order they finished."""
    finished = []
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return finished
        out = s.schedule()
        finished += [r.request_id for r in s.update_from_output(out, runner_output(out)) if r.is_finished]
    raise AssertionError("did not finish")


def test_queue_orders_by_priority_then_arrival_and_removes_anywhere():
    q = PriorityQueue()
    requests = [prio(name, 3, p, t) for name, p, t in
                [("a", 2, 0.0), ("b", 0, 1.0), ("c", 2, 2.0), ("d", 0, 3.0), ("e", -1, 4.0)]]
    for r in requests:
        q.add(r)
    assert [r.request_id for r in q] == ["e", "b", "d", "a", "c"] and len(q) == 5
    q.remove(requests[1])
    assert [r.request_id for r in q] == ["e", "d", "a", "c"] and q.peek().request_id == "e"
    taken = [q.pop(), q.pop()]
    q.put_back(taken)  # back where they were
    assert [q.pop().request_id for _ in range(4)] == ["e", "d", "a", "c"] and not q
    with pytest.raises(ValueError):
        q.remove(requests[0])
    f = FCFSQueue()
    for r in requests:
        f.add(r)
    taken = [f.pop(), f.pop()]
    f.put_back(taken)
    assert [r.request_id for r in f] == ["a", "b", "c", "d", "e"]


def test_one_slot_runs_requests_in_priority_order_ties_first_come_first_served():
    s = make_scheduler(max_num_seqs=1)
    for name, p, t in [("low", 5, 0.0), ("mid1", 1, 1.0), ("high", 0, 2.0), ("mid2", 1, 3.0), ("low2", 5, 4.0)]:
        s.add_request(prio(name, 6, p, t))
    # "low" is not running yet when the step is planned: the queue decides from the start
    assert run_to_end(s) == ["high", "mid1", "mid2", "low", "low2"]


def test_fcfs_keeps_arrival_order_and_ignores_nothing():
    s = make_scheduler(max_num_seqs=1, policy="fcfs")
    for name, p, t in [("a", 5, 0.0), ("b", 0, 1.0), ("c", 1, 2.0)]:
        s.add_request(prio(name, 6, p, t))
    assert run_to_end(s) == ["a", "b", "c"]


def test_waiting_higher_priority_preempts_a_running_one_for_its_slot():
    s = make_scheduler(max_num_seqs=2)
    low, mid = prio("low", 6, 5, 0.0, max_tokens=20), prio("mid", 6, 3, 1.0, max_tokens=20)
    s.add_request(low)
    s.add_request(mid)
    step(s)
    step(s)
    high = prio("high", 6, 0, 2.0, max_tokens=3)
    s.add_request(high)
    out = s.schedule()
    assert out.preempted_req_ids == {"low"}  # the lowest priority, not the newest
    assert scheduled(out) == {"mid": 1, "high": 6}
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert [r.request_id for r in s.running] == ["high", "mid"]  # in priority order: high admitted ahead of mid
    s.update_from_output(out, runner_output(out))
    assert run_to_end(s)[:1] == ["high"]
    assert low.is_finished and low.num_output_tokens == 20 and low.num_preemptions == 1


def test_equal_priority_never_preempts_a_running_request():
    s = make_scheduler(max_num_seqs=1)
    first = prio("first", 6, 1, 0.0, max_tokens=5)
    s.add_request(first)
    step(s)
    s.add_request(prio("second", 6, 1, 1.0))
    out = s.schedule()
    assert not out.preempted_req_ids and scheduled(out) == {"first": 1}


def test_waiting_higher_priority_preempts_lower_ones_for_kv_room():
    # 8 blocks of 4 tokens: low (20-token prompt, 5 blocks + growth) leaves too little for high's 16 tokens
    s = make_scheduler(num_blocks=8, max_num_batched_tokens=64)
    low = prio("low", 20, 2, 0.0, max_tokens=8)
    s.add_request(low)
    step(s)
    step(s)  # 21 tokens computed: 6 blocks, 2 free
    assert s.kv_cache_manager.block_pool.num_free_blocks == 2
    high = prio("high", 16, 0, 1.0, max_tokens=2)
    s.add_request(high)
    out = s.schedule()
    assert out.preempted_req_ids == {"low"} and scheduled(out) == {"high": 16}
    s.update_from_output(out, runner_output(out))
    assert run_to_end(s) == ["high", "low"]
    assert low.num_output_tokens == 8
    s.kv_cache_manager.check_integrity(idle=True)


def test_the_budget_goes_to_higher_priority_running_requests_first():
    s = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    low = prio("low", 60, 4, 0.0, max_tokens=2)  # a long prefill, chunked
    s.add_request(low)
    assert scheduled(step(s)) == {"low": 16}
    high = prio("high", 10, 0, 1.0, max_tokens=3)
    s.add_request(high)
    assert scheduled(step(s)) == {"high": 10, "low": 6}  # high admitted ahead of the running low
    assert scheduled(step(s)) == {"high": 1, "low": 15}


def test_a_full_pool_preempts_the_lowest_priority_running_request_not_the_newest():
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=100, max_num_seqs=3)
    a, b = prio("a", 7, 1, 0.0, max_tokens=8), prio("b", 7, 9, 1.0, max_tokens=8)
    c = prio("c", 3, 0, 2.0, max_tokens=8)
    for r in (a, b, c):
        s.add_request(r)
    for _ in range(5):
        out = step(s)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == {"b"}  # lowest priority (c arrived last)


def test_block_contents_stay_right_through_priority_preemptions():
    """A fake forward writes f(block hash) into each block it completes and checks that every block a request
    counts as computed holds f(its hash), under random priorities, a small pool (many preemptions), prefix
    sharing and a RAM tier."""
    num_blocks, block_size = 12, 4
    kv_cache = torch.zeros(1, 2, num_blocks, block_size, 1, 2)
    store = TieredKVStore(KVPool.over(kv_cache), ram_blocks=16, disk=None, max_staged_blocks=64)
    kv = KVCacheManager(num_blocks, block_size, lower_tiers=store)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=40, policy="priority"), kv)
    rng = random.Random(5)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(8, 20))] for _ in range(4)]

    added = checked = 0
    for tick in range(6000):
        if added < 100 and rng.random() < 0.3:
            request = make_request(f"r{added}", rng.choice(prefixes) + [rng.randrange(1000) for _ in range(3)],
                                   max_tokens=rng.randrange(1, 10))
            request.priority = rng.randrange(4)
            s.add_request(request)
            added += 1
        if not s.has_unfinished_requests():
            if added >= 100:
                break
            continue
        out = s.schedule()
        store.transfer(out.blocks_to_offload, out.blocks_to_load)
        if out.is_empty:
            store.wait_for_loads(timeout=5)
            continue
        checked += fake_forward(out, kv_cache, block_size)
        s.update_from_output(out, runner_output(out, rng.randrange(3, 1000)))
    assert added == 100 and not s.has_unfinished_requests()
    kv.check_integrity(idle=True)
    assert s.num_preemptions_total > 10 and checked > 200
    store.close(kv.cached_blocks())


def test_unknown_policy_is_refused():
    with pytest.raises(ConfigError, match="scheduling_policy"):
        SchedulerConfig(policy="lifo")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


def test_engine_preempted_request_resumes_from_the_ram_tier_with_the_same_tokens(tiny_llama):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    rng = random.Random(1)
    low_prompt = [rng.randrange(100, 1000) for _ in range(40)]
    high_prompt = [rng.randrange(100, 1000) for _ in range(60)]
    with LLM(tiny_llama, dtype="float32", num_threads=1, block_size=4, num_kv_blocks=26, max_model_len=96,
             max_num_batched_tokens=128, kv_offload_memory=64 * 4 * 2048 / GIB) as ref_llm:
        undisturbed = [o.outputs[0].token_ids for o in ref_llm.generate([low_prompt, high_prompt], greedy)]
    with LLM(tiny_llama, dtype="float32", num_threads=1, block_size=4, num_kv_blocks=26, max_model_len=96,
             max_num_batched_tokens=128, kv_offload_memory=64 * 4 * 2048 / GIB,
             scheduling_policy="priority") as llm:
        engine = llm.engine
        engine.add_request("low", {"prompt_token_ids": low_prompt}, greedy, priority=5)
        outputs: dict[str, list[int]] = {}
        for _ in range(10):  # low: prompt and 9 tokens, 13 of the 26 blocks
            engine.step()
        engine.add_request("high", {"prompt_token_ids": high_prompt}, greedy, priority=0)
        ram_hits_before = engine.kv_store.tier_stats()["ram"]["hits"]
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
        assert engine.scheduler.num_preemptions_total >= 1
        assert engine.kv_store.tier_stats()["ram"]["hits"] > ram_hits_before  # resumed from RAM, not recomputed
        engine.kv_cache_manager.check_integrity(idle=True)
        with pytest.raises(ValueError, match="integer"):
            engine.add_request("bad", {"prompt_token_ids": low_prompt}, greedy, priority=1.5)
    assert outputs == {"low": undisturbed[0], "high": undisturbed[1]}


def test_engine_fcfs_refuses_a_priority(tiny_llama):
    with LLM(tiny_llama, dtype="float32", num_threads=1, block_size=4, num_kv_blocks=32, max_model_len=64) as llm:
        with pytest.raises(ValueError, match="scheduling_policy"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), priority=[1])
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), priority=[0])[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def priority_server(tmp_path_factory):
    proc = ServerProcess(None, ["--scheduling-policy", "priority", "--max-num-seqs", "1", "--max-model-len", "1024"],
                         tmp_path_factory.mktemp("logs") / "server.log").wait_healthy()
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


def test_server_runs_a_high_priority_request_ahead_of_a_running_low_priority_stream(priority_server):
    """One sequence slot: the high-priority request can only finish first if the low one was preempted."""
    client = priority_server.client()
    low = client.completions.create(model=None, prompt="Count slowly:", max_tokens=400, temperature=0, stream=True,
                                    extra_body={"priority": 10, "ignore_eos": True})
    chunks = iter(low)
    assert next(chunks).choices[0].text is not None  # low is running
    high = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, extra_body={"priority": -1, "ignore_eos": True})
    assert high.choices[0].finish_reason == "length"
    rest = list(chunks)  # low was still streaming when high finished, and completes after it
    assert rest and rest[-1].choices[0].finish_reason == "length"
    assert priority_server.metrics()["tokenmill:num_preemptions_total"] >= 1
