"""The embedded SmolLM2-135M-Instruct GGUF end to end: greedy chat output equals transformers'
(loaded from the same GGUF, float32) and engine features behave on the real model."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three colours of the rainbow.",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=1024, kv_cache_memory=0.25, quantization="none")


@pytest.fixture(scope="module")
def hf_model(hf_smollm2):
    return hf_smollm2


@torch.inference_mode()
def test_greedy_chat_matches_transformers_for_32_tokens(llm, hf_model):
    conversations = [[{"role": "user", "content": c}] for c in CHATS]
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=32, min_tokens=32))  # like min_new_tokens
    for conv, out in zip(conversations, outs):
        prompt = llm.apply_chat_template(conv)
        ids = torch.tensor([prompt])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                                min_new_tokens=32, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_seeded_sampling_reproduces_and_n_gives_distinct_samples(llm):
    params = SamplingParams(temperature=1.0, seed=1234, n=3, max_tokens=20, ignore_eos=True)
    a = llm.generate("Tell me a story about a dragon.", params)[0]
    b = llm.generate("Tell me a story about a dragon.", params)[0]
    texts = [o.text for o in a.outputs]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert texts == [o.text for o in b.outputs]
    assert len(set(texts)) > 1
    # The seeded request gives the same text when batched with other, unseeded requests.
    mixed = llm.generate(["Hello", "Tell me a story about a dragon.", "Why is the sky blue?"],
                         [SamplingParams(temperature=1.0, max_tokens=20), params, SamplingParams(temperature=0.7, max_tokens=20)])
    assert [o.text for o in mixed[1].outputs] == texts


def test_stop_string_spanning_tokens_ends_generation(llm):
    params = SamplingParams(temperature=0, max_tokens=64, stop=["\n3."])
    out = llm.generate("List three fruits:\n1.", params)[0].outputs[0]
    full = llm.generate("List three fruits:\n1.", SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "\n3."
    assert "\n3." in full.text
    assert out.text == full.text[: full.text.index("\n3.")]


def test_max_tokens_zero_returns_prompt_logprobs_only(llm):
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)


def test_over_length_prompt_is_rejected_and_engine_keeps_working(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [100] * 1030}, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate({"prompt_token_ids": [100] * 1000}, SamplingParams(max_tokens=100))
    assert llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids
    llm.engine.check_integrity()


def test_non_finite_and_out_of_range_sampling_values_are_refused():
    for kwargs, field in (({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
                          ({"repetition_penalty": float("nan")}, "repetition_penalty"), ({"seed": 2**70}, "seed"),
                          ({"logit_bias": {5: 1000.0}}, "logit_bias")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_non_prompt_objects_are_a_value_error(llm):
    with pytest.raises(ValueError, match="prompt must be"):
        llm.generate(5)
    with pytest.raises(ValueError, match="prompt must be"):
        llm.generate(["Hi", 5])
