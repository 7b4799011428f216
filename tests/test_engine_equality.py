"""End-to-end greedy equality with `transformers` on tiny random models of every architecture.

Covers a single request, 16 concurrent requests of mixed lengths, chunked prefill under a tiny
token budget, forced preemption with a tiny KV pool, and prompt log-probabilities (float32).
"""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return str(path), hf


def random_prompts(num: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(num)]


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], max_new_tokens: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def tm_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def test_single_request_matches_transformers(tiny):
    path, hf = tiny
    llm = LLM(model=path, dtype="float32", num_kv_blocks=256)
    prompt = random_prompts(1, seed=1, lo=20, hi=21)[0]
    assert tm_greedy(llm, [prompt]) == [hf_greedy(hf, prompt)]


def test_16_concurrent_mixed_lengths_match_transformers(tiny):
    path, hf = tiny
    llm = LLM(model=path, dtype="float32", num_kv_blocks=512, block_size=4)
    prompts = random_prompts(16, seed=2)
    assert tm_greedy(llm, prompts) == [hf_greedy(hf, p) for p in prompts]
    llm.engine.check_integrity()


def test_chunked_prefill_small_budget_matches_transformers(tiny):
    path, hf = tiny
    llm = LLM(model=path, dtype="float32", num_kv_blocks=512, block_size=4, max_num_batched_tokens=7)
    prompts = random_prompts(6, seed=3, lo=10, hi=30)
    assert tm_greedy(llm, prompts) == [hf_greedy(hf, p) for p in prompts]


def test_forced_preemption_matches_transformers(tiny):
    path, hf = tiny
    # 20 blocks of 4 tokens = 80 token slots for 8 requests of up to ~35 tokens each.
    llm = LLM(model=path, dtype="float32", num_kv_blocks=20, block_size=4, max_num_batched_tokens=64)
    prompts = random_prompts(8, seed=4, lo=8, hi=20)
    got = tm_greedy(llm, prompts)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert got == [hf_greedy(hf, p) for p in prompts]
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_manager.block_pool.num_free_blocks == 20


@torch.inference_mode()
def test_prompt_logprobs_match_transformers(tiny):
    path, hf = tiny
    llm = LLM(model=path, dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=9)
    prompt = random_prompts(1, seed=5, lo=25, hi=26)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        expected = ref[pos - 1, prompt[pos]].item()
        assert abs(entry[prompt[pos]].logprob - expected) < 1e-4
        top = ref[pos - 1].topk(2)
        assert top.indices[0].item() in entry


def test_kv_pool_smaller_than_max_model_len_is_refused_or_clamped(tmp_path):
    path = str(make_tiny_model("llama", tmp_path / "m"))
    with pytest.raises(ValueError, match="KV cache capacity"):
        LLM(model=path, num_kv_blocks=4, block_size=16, max_model_len=256)
    llm = LLM(model=path, num_kv_blocks=4, block_size=16)  # max_model_len follows the pool: 64 tokens
    assert llm.engine.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len"):  # would never fit: refused, not queued forever
        llm.generate({"prompt_token_ids": [100] * 51}, SamplingParams(max_tokens=30))
    out = llm.generate({"prompt_token_ids": [100] * 51}, SamplingParams(max_tokens=13, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 13
