"""Speculative decoding (n-gram proposer): exact by construction.

The proposer against a slow reference; the rejection sampler's output distribution (200k draws)
against the target and against a step-by-step reference; greedy outputs token-identical to plain
decoding for k = 1..5 on tiny models of two architectures (with chunked prefill, forced preemption
and prefix hits, no block holding an unverified token ever cached) and on the embedded SmolLM2
with a copy task where most drafts are accepted; deterministic mode bit-identical with and without
speculation (greedy and seeded sampling, log-probabilities included); stop strings, max_tokens,
n > 1, structured outputs; the counters; the config's errors.
"""
from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.sampling.sampler import exponential_race
from tokenmill.server.metrics import EngineStats, ServerMetrics
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram_proposer import propose_ngram, propose_ngram_reference
from tokenmill.spec_decode.rejection_sampler import (
    accept_sampled_prefix, rejection_sample, rejection_sample_reference,
)

# Tiny models with a 64-token vocabulary: their greedy outputs fall into loops, so the n-gram
# proposer's drafts are accepted often enough to exercise every path (multi-token steps, bonus tokens).
ARCHS = ["llama", "qwen3"]


def spec(k: int, **extra) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, **extra}


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    return str(make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), vocab_size=64))


def prompts_for(seed: int, num: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 64) for _ in range(rng.randrange(6, 40))] for _ in range(num)]


def watch_unverified_blocks(llm: LLM) -> list[int]:
    """Before every forward, assert that no cached block of a scheduled request covers a position at
    or past its verified tokens (drafts included), and that each cached block's hash is its own
    tokens'. Returns a list that grows by the number of draft tokens of each step."""
    engine = llm.engine
    kv = engine.kv_cache_manager
    inner = engine.runner.execute_model
    seen: list[int] = []

    def checked(scheduler_output):
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for request in scheduler_output.scheduled_requests:
            blocks = kv.req_to_blocks[request.request_id]
            num_full = request.num_tokens // kv.block_size
            for index, block in enumerate(blocks):
                if block.block_hash is not None and kv.block_pool.get_cached_block(block.block_hash) is block:
                    assert index < num_full, f"block {index} of {request} holds unverified tokens but is cached"
                    assert block.block_hash == request.block_hashes[index]
            if spec_tokens.get(request.request_id):
                assert request.num_computed_tokens == request.num_tokens - 1
        seen.append(sum(len(d) for d in spec_tokens.values()))
        return inner(scheduler_output)

    engine.runner.execute_model = checked
    return seen


def generate_ids(llm: LLM, prompts, params: SamplingParams) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [[c.token_ids for c in o.outputs] for o in outs]


# ---------------------------------------------------------------- the proposer


def test_ngram_proposer_matches_its_reference():
    rng = np.random.default_rng(0)
    for trial in range(400):
        length = int(rng.integers(1, 80))
        tokens = rng.integers(0, int(rng.integers(2, 8)), size=length).astype(np.int64)
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 6))
        fast = propose_ngram(tokens, min_n, max_n, k).tolist()
        assert fast == propose_ngram_reference(tokens.tolist(), min_n, max_n, k), (trial, tokens.tolist())


def test_ngram_proposer_copies_what_followed_the_latest_longest_match():
    tokens = np.array([7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 0, 2, 3], dtype=np.int64)
    assert propose_ngram(tokens, 1, 3, 3).tolist() == [4, 5, 0]  # "2 3" last seen before "4 5 0"
    assert propose_ngram(tokens, 3, 3, 3).tolist() == []  # "0 2 3" never occurred before
    assert propose_ngram(np.array([5], dtype=np.int64), 1, 3, 3).tolist() == []


# ---------------------------------------------------------------- the rejection sampler

NUM_DRAWS = 200_000


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "one_hot"])
def test_rejection_sampler_output_is_distributed_as_the_target(one_hot):
    """Each output position, given the ones before it were drafts that were accepted, follows p."""
    g = torch.Generator().manual_seed(0)
    vocab, k = 6, 2
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, dim=-1)  # [K + 1, V]
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, dim=-1)  # [K, V]
    if one_hot:  # the n-gram proposer: a fixed draft (one-hot q)
        drafts = torch.tensor([[int(p[0].argmax()), int(p[1].argmin())]]).expand(NUM_DRAWS, k)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[j], NUM_DRAWS, replacement=True, generator=g) for j in range(k)], 1)
        draft_probs = q.expand(NUM_DRAWS, k, vocab)
    out, num_accepted = rejection_sample(
        p.expand(NUM_DRAWS, k + 1, vocab), drafts, draft_probs, torch.full((NUM_DRAWS,), k),
        torch.rand(NUM_DRAWS, k, generator=g), torch.empty(NUM_DRAWS, k + 1, vocab).exponential_(generator=g),
    )
    assert total_variation(out[:, 0], p[0]) < 0.01
    second = num_accepted >= 1
    assert second.sum() > NUM_DRAWS // 10
    assert total_variation(out[second, 1], p[1]) < 0.01
    assert torch.equal(out[:, 0][second], drafts[:, 0][second])  # an accepted position outputs its draft

    # The step-by-step reference agrees (fewer draws: it is a Python loop).
    num_ref = 5_000
    ref = [rejection_sample_reference(p, drafts[i].tolist(), None if one_hot else q, g) for i in range(num_ref)]
    ref_first = torch.tensor([r[0] for r in ref])
    assert total_variation(ref_first, p[0]) < 0.04
    fast_counts = torch.bincount(out[:, 0], minlength=vocab).double() / NUM_DRAWS
    ref_counts = torch.bincount(ref_first, minlength=vocab).double() / num_ref
    assert 0.5 * (fast_counts - ref_counts).abs().sum() < 0.04
    ref_accept = sum(len(r) > 1 for r in ref) / num_ref
    assert abs(ref_accept - second.double().mean().item()) < 0.035


def test_sampling_every_position_and_keeping_the_matching_prefix_is_rejection_sampling():
    """What the engine does for one-hot proposals: draw x_j ~ p_j at each position (the sampler's
    exponential race), accept drafts while x_j equals them, output x at the first mismatch."""
    g = torch.Generator().manual_seed(1)
    vocab, draws = 5, NUM_DRAWS // 2
    p = torch.softmax(torch.randn(2, vocab, generator=g), dim=-1)
    draft = int(p[0].argmax())
    torch.manual_seed(2)
    sampled = exponential_race(p.repeat(draws, 1, 1).reshape(draws * 2, vocab).clone(), {}).view(draws, 2)
    accepted = sampled[:, 0] == draft  # accept_sampled_prefix, vectorised (checked on a slice below)
    for row in sampled[:2000].tolist():
        assert accept_sampled_prefix(row, [draft]) == int(row[0] == draft)
    assert total_variation(sampled[:, 0], p[0]) < 0.01  # the first output token is x_0 either way
    assert abs(accepted.double().mean().item() - p[0, draft].item()) < 0.01  # P(accept) = p(d)
    rejected = sampled[~accepted, 0]  # a rejection outputs x_0 ~ normalize(max(p - onehot(d), 0))
    residual = p[0].clone()
    residual[draft] = 0
    assert total_variation(rejected, residual / residual.sum()) < 0.01
    assert total_variation(sampled[accepted, 1], p[1]) < 0.01  # after an accepted draft: x_1 ~ p_1


# ---------------------------------------------------------------- greedy equality on tiny models


@pytest.fixture(scope="module")
def tiny_baseline(tiny):
    """Plain greedy outputs of the scenarios below (no speculation), computed once per model."""
    llm = LLM(model=tiny, dtype="float32", num_threads=1, num_kv_blocks=256, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    prompts = prompts_for(1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return prompts, params, outs


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_is_token_identical_to_plain_decoding(tiny, tiny_baseline, k):
    prompts, params, base = tiny_baseline
    # k = 2: chunked prefill under a 7-token budget; k = 4: a pool so small that requests are preempted.
    budget = 7 if k == 2 else 1024
    blocks = 24 if k == 4 else 256
    llm = LLM(model=tiny, dtype="float32", num_threads=1, num_kv_blocks=blocks, block_size=4,
              max_num_batched_tokens=budget, speculative_config=spec(k))
    drafts = watch_unverified_blocks(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for got, want in zip(outs, base):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        got_lp = [{t: lp.logprob for t, lp in e.items()} for e in got.outputs[0].logprobs]
        want_lp = [{t: lp.logprob for t, lp in e.items()} for e in want.outputs[0].logprobs]
        assert len(got_lp) == len(want_lp)
        for a, b in zip(got_lp, want_lp):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    stats = llm.engine.speculator.stats
    assert sum(drafts) == stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens > 0, "no draft accepted: the test would not exercise multi-token steps"
    if k == 4:
        assert llm.engine.scheduler.num_preemptions_total > 0
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_manager.block_pool.num_free_blocks == blocks


def test_prefix_hits_n_and_stop_strings_with_speculation(tiny):
    """Shared prefixes hit the cache, n = 2 sequences, a stop string completed in the middle of a
    multi-token step cuts the output there, max_tokens is never exceeded."""
    prompts = prompts_for(2, num=3)
    prompts = prompts + [prompts[0] + [5, 6, 7, 8, 9, 10, 11, 12]]  # a prefix hit on prompt 0's blocks
    plain = LLM(model=tiny, dtype="float32", num_threads=1, num_kv_blocks=256, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True, n=2)
    base = plain.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    text = base[1].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True, stop=[stop])
    base_stop = plain.generate([{"prompt_token_ids": prompts[1]}], stopped)[0].outputs[0]

    llm = LLM(model=tiny, dtype="float32", num_threads=1, num_kv_blocks=256, block_size=4, speculative_config=spec(5))
    watch_unverified_blocks(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in base]
    assert all(len(c.token_ids) == 37 for o in outs for c in o.outputs)
    assert outs[3].num_cached_tokens > 0
    got_stop = llm.generate([{"prompt_token_ids": prompts[1]}], stopped)[0].outputs[0]
    assert (got_stop.text, got_stop.token_ids, got_stop.finish_reason) == (
        base_stop.text, base_stop.token_ids, base_stop.finish_reason)
    assert got_stop.finish_reason == "stop" and stop not in got_stop.text
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
    llm.engine.check_integrity()


def test_counters_add_up_and_opt_out_and_batch_size_switch(tiny):
    llm = LLM(model=tiny, dtype="float32", num_threads=1, num_kv_blocks=256, block_size=4,
              speculative_config=spec(4, disable_by_batch_size=2))
    stats = llm.engine.speculator.stats
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts_for(3, num=2)], params)
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens <= 4 * stats.num_drafts
    per_pos = stats.num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    # The server's /metrics export of the same counters (vLLM's names).
    text = ServerMetrics("tiny", lambda: EngineStats(spec_decode=stats.snapshot())).render().decode()
    scraped = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line.startswith("tokenmill:spec_decode")}
    assert scraped['tokenmill:spec_decode_num_drafts_total{model_name="tiny"}'] == stats.num_drafts
    assert scraped['tokenmill:spec_decode_num_draft_tokens_total{model_name="tiny"}'] == stats.num_draft_tokens
    assert scraped['tokenmill:spec_decode_num_accepted_tokens_total{model_name="tiny"}'] == stats.num_accepted_tokens
    assert [scraped[f'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{p}"}}']
            for p in range(4)] == per_pos
    before = stats.snapshot()
    # Three requests running together exceed disable_by_batch_size: no drafts while they do.
    llm.generate([{"prompt_token_ids": p} for p in prompts_for(4, num=3)], SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True))
    assert stats.snapshot() == before
    opted_out = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, disable_speculative_decoding=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts_for(3, num=2)], opted_out)
    assert stats.snapshot() == before


def test_cuda_runner_verifies_drafts_in_eager_steps(tiny, tiny_baseline):
    """The CUDA runner's code on CPU (reference attention backend): verify steps run eagerly, plain
    decode steps through the padded decode; tokens equal plain decoding."""
    from tokenmill.runner.cuda_runner import CudaModelRunner

    prompts, params, base = tiny_baseline
    llm = LLM(model=tiny, dtype="float32", num_threads=1, num_kv_blocks=256, block_size=4, max_num_seqs=8,
              speculative_config=spec(3))
    engine = llm.engine
    engine.runner = runner = CudaModelRunner(engine.loaded, engine.config.cache, engine.scheduler_config,
                                             attention_backend="torch")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert engine.speculator.stats.num_accepted_tokens > 0
    assert runner.num_general_steps > 0 and runner.num_padded_decode_steps > 0
    engine.check_integrity()


# ---------------------------------------------------------------- deterministic mode


def test_deterministic_mode_is_bit_identical_with_and_without_speculation(tmp_path):
    path = str(make_tiny_model("qwen3", tmp_path / "qwen3", dtype=torch.bfloat16, vocab_size=64))
    prompts = prompts_for(5, num=3)
    cases = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3),
             SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=40, ignore_eos=True, logprobs=3,
                            repetition_penalty=1.1, n=2)]

    def run(speculative_config):
        llm = LLM(model=path, dtype="bfloat16", deterministic=True, num_threads=1, num_kv_blocks=256, block_size=4,
                  max_num_batched_tokens=32, speculative_config=speculative_config)
        results = []
        for params in cases:
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params):
                results.append([(c.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in c.logprobs],
                                 c.cumulative_logprob) for c in o.outputs])
        return results, llm

    plain, _ = run(None)
    spec_out, llm = run(spec(4))
    assert spec_out == plain
    assert llm.engine.speculator.stats.num_accepted_tokens > 0


# ---------------------------------------------------------------- the draft-model proposer


def test_draft_model_proposer_is_exact_and_frees_its_pool(tmp_path):
    """A tiny random Llama drafts for another (the target itself as its own draft accepts every
    draft; a different random model almost none): outputs equal plain decoding, greedy and seeded,
    in deterministic mode bit for bit, and the draft's KV pool is empty afterwards."""
    target = str(make_tiny_model("llama", tmp_path / "target", dtype=torch.bfloat16, vocab_size=64))
    other = str(make_tiny_model("llama", tmp_path / "draft", dtype=torch.bfloat16, vocab_size=64, seed=11,
                                num_hidden_layers=1))
    prompts = prompts_for(6, num=2)
    cases = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True, logprobs=2)]

    def run(speculative_config, num_kv_blocks=128):
        llm = LLM(model=target, dtype="bfloat16", deterministic=True, num_threads=1, num_kv_blocks=num_kv_blocks,
                  block_size=4, speculative_config=speculative_config)
        outs, greedy_stats = [], None
        for params in cases:
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params):
                outs.append([(c.token_ids, [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs])
                             for c in o.outputs])
            if llm.engine.speculator is not None and greedy_stats is None:
                greedy_stats = llm.engine.speculator.stats.snapshot()
        return outs, llm, greedy_stats

    plain, _, _ = run(None)
    got, llm, greedy = run({"method": "draft_model", "model": target, "num_speculative_tokens": 3})
    assert got == plain
    stats, pool = llm.engine.speculator.stats, llm.engine.speculator.pool
    assert greedy["num_draft_tokens"] > 0 and stats.num_draft_tokens > greedy["num_draft_tokens"]
    # Its own argmax: every greedy draft is accepted; seeded rows keep the drafts their draws equal.
    assert greedy["num_accepted_tokens"] == greedy["num_draft_tokens"]
    assert stats.num_accepted_tokens > greedy["num_accepted_tokens"]
    assert not pool.blocks and len(pool.free) == 128
    llm.engine.check_integrity()

    other_llm = LLM(model=target, dtype="bfloat16", deterministic=True, num_threads=1, num_kv_blocks=128, block_size=4,
                    speculative_config={"method": "draft_model", "model": other, "num_speculative_tokens": 3})
    greedy_plain = plain[: len(prompts)]
    got_other = [[(c.token_ids, [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs]) for c in o.outputs]
                 for o in other_llm.generate([{"prompt_token_ids": p} for p in prompts], cases[0])]
    assert got_other == greedy_plain
    assert other_llm.engine.speculator.stats.num_draft_tokens > 0
    other_llm.engine.check_integrity()
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(model=target, dtype="bfloat16", num_threads=1, num_kv_blocks=64, block_size=4, speculative_config={
            "method": "draft_model", "model": str(make_tiny_model("llama", tmp_path / "v", vocab_size=96))})


# ---------------------------------------------------------------- the embedded model and structured output


@pytest.fixture(scope="module")
def smollm2():
    """One engine with speculation; requests with ``disable_speculative_decoding`` decode plainly in it
    (asserted through the counters), so the embedded model is loaded once."""
    return LLM(num_threads=1, max_model_len=1024, speculative_config={"method": "ngram", "num_speculative_tokens": 4})


def plain_and_speculative(llm: LLM, messages: list[dict], params: SamplingParams):
    stats = llm.engine.speculator.stats
    before = stats.snapshot()
    plain = llm.chat(messages, replace(params, disable_speculative_decoding=True))[0].outputs[0]
    assert stats.snapshot() == before, "the opted-out request verified drafts"
    return plain, llm.chat(messages, params)[0].outputs[0]


COPY_TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
             "All that glitters is not gold. Actions speak louder than words.")


def test_smollm2_copy_task_accepts_most_drafts_and_matches_plain_decoding(smollm2):
    messages = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{COPY_TEXT}"}]
    stats = smollm2.engine.speculator.stats
    want, got = plain_and_speculative(smollm2, messages, SamplingParams(temperature=0.0, max_tokens=40))
    assert got.token_ids == want.token_ids and got.text == want.text
    assert stats.acceptance_rate > 0.5, stats
    smollm2.engine.check_integrity()


def test_structured_output_with_speculation_is_valid_json_and_equals_plain(smollm2):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    messages = [{"role": "user", "content": 'Reply with JSON like {"name":"Alice Smith","age":30} for Alice Smith, '
                                            "who is 30, copying that exact form."}]
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    stats = smollm2.engine.speculator.stats
    before = stats.num_draft_tokens
    want, got = plain_and_speculative(smollm2, messages, params)
    assert got.token_ids == want.token_ids
    value = json.loads(got.text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert stats.num_draft_tokens > before, "no draft was verified under the constraint"


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("value, field", [
    ({"method": "medusa"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "model": "x.gguf"}, "model"),
    ({"method": "draft_model"}, "model"),
    ({"lookahead": 3}, "unknown keys"),
    ("{not json", "must be JSON"),
])
def test_speculative_config_errors_name_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_value(value)


def test_speculative_config_defaults():
    config = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 2}')
    assert (config.lookup_min, config.lookup_max, config.num_speculative_tokens) == (2, 5, 2)
    assert SpeculativeConfig.from_value({"prompt_lookup_max": 1}).lookup_min == 1
    assert SpeculativeConfig.from_value(None) is None
    with pytest.raises(ValueError, match="disable_speculative_decoding"):
        SamplingParams(disable_speculative_decoding="yes")
