"""Automatic prefix caching: identical outputs with caching on and off, exact hit accounting,
multi-turn KV reuse and pool integrity under random aborts."""
from __future__ import annotations

import random

import pytest

from tests.scheduler_helpers import make_request, scheduled, step
from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import SchedulerConfig
from tokenmill.kv_cache import KVCacheManager
from tokenmill.request import RequestStatus
from tokenmill.scheduler import Scheduler


NUM_BLOCKS = 32  # 128 token slots for up to 8 running requests of ~70 tokens: forces preemption


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


def shared_prefix_workload(seed: int, num: int = 24):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 60))] for _ in range(3)]
    prompts, params = [], []
    for i in range(num):
        prefix = rng.choice(prefixes)
        prompts.append({"prompt_token_ids": prefix + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 12))]})
        params.append(SamplingParams(temperature=0, max_tokens=rng.randrange(4, 12), n=rng.choice([1, 1, 2]),
                                     prompt_logprobs=1 if i % 7 == 0 else None))
    return prompts, params


def run(path: str, caching: bool, prompts, params):
    llm = LLM(model=path, dtype="float32", enable_prefix_caching=caching, num_kv_blocks=NUM_BLOCKS, block_size=4,
              max_num_batched_tokens=24, max_num_seqs=8)
    outs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_manager.block_pool.num_free_blocks == NUM_BLOCKS
    return llm, outs


def test_outputs_identical_with_caching_on_and_off(tiny_llama):
    prompts, params = shared_prefix_workload(seed=0)
    llm_on, on = run(tiny_llama, True, prompts, params)
    _, off = run(tiny_llama, False, prompts, params)
    for a, b in zip(on, off):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        if a.prompt_logprobs is not None:
            for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                for tid, lp in x.items():
                    assert abs(lp.logprob - y[tid].logprob) < 1e-5
    # The workload is small for its pool: caching must have hit and preemption must have happened.
    assert sum(o.num_cached_tokens for o in on) > 0
    assert llm_on.engine.kv_cache_manager.prefix_cache_hits > 0
    assert llm_on.engine.scheduler.num_preemptions_total > 0


def test_exact_hits_and_eviction_order_through_the_scheduler():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    a = make_request("a", list(range(100, 113)), max_tokens=1)  # 13 tokens: blocks 0..3
    s.add_request(a)
    step(s)
    assert not s.has_unfinished_requests()
    # a's 3 full blocks are cached (its 4th holds the last prompt token only).
    assert len(kv.block_pool.cached_block_hash_to_block) == 3
    b = make_request("b", list(range(100, 108)) + [1, 2, 3], max_tokens=1)
    s.add_request(b)
    out = step(s)
    assert scheduled(out) == {"b": 3} and b.num_cached_tokens == 8
    # A 20-token request needs 5 blocks; the free list holds b's + a's blocks: the LRU ones go first.
    c = make_request("c", list(range(300, 320)), max_tokens=1)
    s.add_request(c)
    step(s)
    evicted = list(kv.block_pool.evicted_block_hashes)
    assert evicted == [a.block_hashes[2]]  # a's unshared third block was freed first
    assert kv.prefix_cache_hits == 8 and kv.prefix_cache_queries == 13 + 11 + 20
    kv.check_integrity()


def test_three_turn_chat_computes_only_new_tokens(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    messages = [{"role": "user", "content": "Hello there, how are you today?"}]
    previous: list[int] | None = None
    for turn in range(3):
        prompt = llm.apply_chat_template(messages)
        out = llm.chat(messages, params)[0]
        if previous is not None:
            # KV that exists: the previous prompt and answer, except the answer's last token.
            common = 0
            while common < min(len(previous), len(prompt)) and previous[common] == prompt[common]:
                common += 1
            expected = (min(common, len(prompt) - 1) // 4) * 4
            assert out.num_cached_tokens == expected
            assert len(prompt) - out.num_cached_tokens <= (len(prompt) - len(previous)) + 2 * 4
        answer = out.outputs[0].token_ids
        previous = prompt + answer[:-1]
        messages = messages + [
            {"role": "assistant", "content": out.outputs[0].text},
            {"role": "user", "content": f"Tell me more, part {turn + 2}."},
        ]


def test_2000_random_requests_with_aborts_keep_the_pool_intact():
    rng = random.Random(7)
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=16, max_model_len=128), kv)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 24))] for _ in range(5)]
    added = 0
    while added < 2000 or s.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4)):
            if added < 2000:
                prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 16))]
                s.add_request(make_request(f"r{added}", prompt, max_tokens=rng.randrange(1, 10)))
                added += 1
        if s.requests and rng.random() < 0.2:
            s.finish_requests([rng.choice(sorted(s.requests))], RequestStatus.FINISHED_ABORTED)
        step(s, token=rng.randrange(3, 1000))
        if not s.has_unfinished_requests():
            kv.check_integrity()
    kv.check_integrity()
    assert kv.block_pool.num_free_blocks == 64 and not kv.req_to_blocks
    assert kv.prefix_cache_hits > 0
