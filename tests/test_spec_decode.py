"""Speculative decoding: exact by construction, and drafting only where it pays.

The n-gram proposer against a slow reference; the rejection sampler's output distribution (200k
draws) against the target and against a step-by-step reference; greedy outputs token-identical to
plain decoding for k = 1..5 with each proposer, on tiny models of every architecture (chunked
prefill, forced preemption and prefix hits; no block holding an unverified token ever cached) and on
the embedded SmolLM2 (a copy task where most drafts are accepted); deterministic mode bit-identical
with and without speculation (greedy and seeded sampling, log-probabilities included); stop
strings, max_tokens, n > 1, structured outputs; the counters; adaptive verification (the cost
model, the slot plan against brute force, a failing request paused and retried while another keeps
drafting, outputs unchanged); the config's errors.

Cheap by design (CI runs the whole suite under a time limit): one engine per tiny architecture and
one embedded-model engine are shared by the tests of this module; a test changes the speculator's
settings (``set_spec``) instead of loading a model again, and plain-decoding baselines are requests
of the same engine with ``disable_speculative_decoding``.
"""
from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.attention import build_attention_metadata
from tokenmill.runner.verify_rows import verify_rows_layout
from tokenmill.sampling.rejection_sampler import (
    accept_sampled_prefix, rejection_sample, rejection_sample_reference,
)
from tokenmill.sampling.sampler import exponential_race
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.metrics import EngineStats, ServerMetrics
from tokenmill.spec_decode import Speculator
from tokenmill.spec_decode.adaptive import FIRST_PAUSE, AcceptanceEstimate, StepCostModel, plan_num_drafts
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.metrics import SpecDecodingStats
from tokenmill.spec_decode.ngram_proposer import propose_ngram, propose_ngram_reference

# Tiny models with a 64-token vocabulary: their greedy outputs fall into loops, so the n-gram
# proposer's drafts are accepted often enough to exercise every path (multi-token steps, bonus tokens).
ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
VOCAB = 64


def spec(k: int, **extra) -> dict:
    """An n-gram config that verifies every draft found (adaptive verification off), unless ``extra`` says otherwise."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "enable_adaptive_verification": False, **extra}


def set_spec(llm: LLM, **fields) -> Speculator:
    """Give the engine's speculator its original settings with ``fields`` changed (no model load);
    counters, per-request estimates and step costs start again. Returns the speculator."""
    speculator = llm.engine.speculator
    speculator.config = replace(llm.engine.config.speculative_config, **fields)
    speculator.stats = SpecDecodingStats(speculator.config.num_speculative_tokens)
    speculator.estimates.clear()
    speculator.cost_model = StepCostModel(max_tokens=256)
    return speculator


def prompts_for(seed: int, num: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(6, 40))] for _ in range(num)]


def watch_unverified_blocks(llm: LLM) -> list[dict[str, tuple[int, int]]]:
    """Before every forward, assert that no cached block of a scheduled request covers a position at
    or past its verified tokens (drafts included), and that each cached block's hash is its own
    tokens'. Returns a list that grows by one dict per step: request id -> (output tokens so far,
    drafts scheduled), for the requests verifying drafts."""
    engine = llm.engine
    kv = engine.kv_cache_manager
    inner = engine.runner.execute_model
    seen: list[dict[str, tuple[int, int]]] = []

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
        seen.append({r.request_id: (r.num_output_tokens, len(spec_tokens[r.request_id]))
                     for r in scheduler_output.scheduled_requests if spec_tokens.get(r.request_id)})
        return inner(scheduler_output)

    engine.runner.execute_model = checked
    return seen


def num_drafts_seen(seen: list[dict]) -> int:
    return sum(n for step in seen for _, n in step.values())


def logprob_maps(output) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in e.items()} for e in output.logprobs]


def assert_same_greedy(got, want) -> None:
    """Same tokens, and log-probabilities equal to 1e-4 (the verify step's rows are computed in one
    batch; plain decoding computes them one step at a time)."""
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        for gc, wc in zip(g.outputs, w.outputs):
            if wc.logprobs is None:
                continue
            got_lp, want_lp = logprob_maps(gc), logprob_maps(wc)
            assert len(got_lp) == len(want_lp)
            for a, b in zip(got_lp, want_lp):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


def plain(params: SamplingParams) -> SamplingParams:
    return replace(params, disable_speculative_decoding=True)


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


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


# ---------------------------------------------------------------- the verify step as decode rows


def test_verify_rows_layout_gives_each_token_its_plain_decoding_position_and_blocks():
    """Request 0 verifies 2 drafts after 9 computed tokens, request 1 decodes one token after 2: the rows
    are what three plain decode steps of request 0 and one of request 1 would schedule."""
    table = np.array([[7, 8, 9], [3, 0, 0]])
    query_lens, computed, blocks = verify_rows_layout(np.array([3, 1]), np.array([9, 2]), table)
    assert query_lens.tolist() == [1, 1, 1, 1]
    assert computed.tolist() == [9, 10, 11, 2]
    assert blocks.tolist() == [[7, 8, 9]] * 3 + [[3, 0, 0]]
    metadata, positions = build_attention_metadata(query_lens, computed, blocks, 4)
    assert positions.tolist() == [9, 10, 11, 2]
    assert metadata.slot_mapping.tolist() == [9 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3, 3 * 4 + 2]
    assert metadata.seq_lens.tolist() == [10, 11, 12, 3] and metadata.num_prefills == 0


# ---------------------------------------------------------------- adaptive verification: the pieces


def test_step_cost_model_interpolates_extrapolates_and_never_decreases():
    costs = StepCostModel(max_tokens=32, window=3, min_samples=1, warmup=0)
    assert np.allclose(costs.relative_costs(1, 3), [1.0, 1.1, 1.2, 1.3])  # nothing seen: the prior per token
    costs.observe(5, 0.030)
    assert costs.has_measured_up_to(5) and not costs.has_measured_up_to(4)  # no drafting at 1..4 tokens yet
    costs.observe(1, 0.010)
    # Sizes not measured are priced optimistically from below (so they get tried), not interpolated.
    assert np.allclose(costs.relative_costs(1, 4), [1.0, 1.1, 1.2, 1.3, 3.0])
    costs.observe(4, 0.026)
    assert np.allclose(costs.relative_costs(1, 4), [1.0, 1.1, 1.2, 2.6, 3.0])
    assert np.allclose(costs.relative_costs(5, 2), [1.0, 1.03, 1.06])  # past the last: prior 0.1 * t(5) / 5, floored
    costs.observe(3, 0.001)  # a fast step: costs still never fall as tokens are added
    rel = costs.relative_costs(1, 4)
    assert np.all(np.diff(rel) >= 0.03 - 1e-12) and rel[-2:] == pytest.approx([2.6, 3.0])
    costs.observe(5, 0.050)  # the median of the window (3 here): one slow step among fast ones does not count
    assert costs.seconds[5] == pytest.approx(0.040)
    costs.observe(5, 0.032)
    assert costs.seconds[5] == pytest.approx(0.032)
    costs.observe(5, 0.033)  # the oldest (0.030) leaves the window
    assert costs.seconds[5] == pytest.approx(0.033)
    costs.observe(33, 1.0)  # beyond the table: ignored
    assert np.isnan(costs.seconds[6:]).all()
    warm = StepCostModel(max_tokens=8)  # the defaults: a size's first step is a warm-up, then 3 steps are needed
    warm.observe(2, 5.0)
    warm.observe(2, 0.5)
    warm.observe(2, 0.02)
    assert not warm.has_measured_up_to(8)
    warm.observe(2, 0.03)
    assert warm.seconds[2] == 0.03  # the median of 0.5, 0.02, 0.03: the slow step is outvoted
    with pytest.raises(ValueError, match="min_samples"):
        StepCostModel(max_tokens=8, window=2, min_samples=3)


def test_step_cost_model_prices_from_recent_steps_and_asks_for_probes():
    """While most steps draft, a one-token step is timed again every probe_interval steps, and prices come
    from the last horizon steps: a one-token price from before a 2x slow-down is not compared with
    five-token prices from after it."""
    costs = StepCostModel(max_tokens=8, window=15, min_samples=3, warmup=0, horizon=100, probe_interval=20)
    assert not costs.needs_probe(1)  # never timed: has_measured_up_to decides, not a probe
    for _ in range(15):
        costs.observe(1, 0.010)
        costs.observe(5, 0.016)
    assert not costs.needs_probe(1) and costs.relative_costs(1, 4)[4] == pytest.approx(1.6)
    probes = 0
    for _ in range(400):  # the machine is 2x slower from here; drafting: five-token steps, probes when asked
        if costs.needs_probe(1):
            costs.observe(1, 0.020)
            probes += 1
        else:
            costs.observe(5, 0.032)
    assert probes == pytest.approx(400 / 21, abs=1)  # one step in probe_interval + 1
    assert costs.seconds[1] == pytest.approx(0.020)  # the old fast samples are past the horizon
    assert costs.relative_costs(1, 4)[4] == pytest.approx(1.6)
    assert not costs.needs_probe(5) and not costs.needs_probe(9)
    stale = StepCostModel(max_tokens=8, min_samples=3, warmup=0, horizon=10)
    for seconds in (0.010, 0.011, 0.012, 0.013):
        stale.observe(2, seconds)
    for _ in range(50):
        stale.observe(3, 0.02)
    stale.observe(2, 0.030)  # one fresh sample is too few: the newest three count
    assert stale.seconds[2] == pytest.approx(0.013)
    for _ in range(10):
        stale.observe(2, 0.010)
    # size 3 was last timed more than horizon steps ago: priced as not measured, from size 2 plus the prior
    assert stale.relative_costs(2, 1)[1] == pytest.approx(1.05)
    # a probe whose step comes out another size is not asked again for a whole interval
    missed = StepCostModel(max_tokens=8, min_samples=1, warmup=0, probe_interval=5)
    missed.observe(1, 0.01)
    for _ in range(5):
        missed.observe(4, 0.02)
    assert missed.needs_probe(1)
    asks = 0
    for _ in range(12):
        missed.observe(3, 0.02)  # the probe step had 3 tokens (a request was prefilling, say)
        asks += missed.needs_probe(1)
    assert asks == 2  # at clock 11 and 16, not on every step


def test_plan_num_drafts_is_the_best_plan_by_brute_force():
    rng = np.random.default_rng(3)
    for _ in range(200):
        num_requests, k = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        survival = [np.cumprod(rng.uniform(0.0, 1.0, k)) for _ in range(num_requests)]
        caps = [int(c) for c in rng.integers(0, k + 1, num_requests)]
        costs = StepCostModel(max_tokens=32, min_samples=1, warmup=0)
        for t in range(1, 33):
            costs.observe(t, 1.0 + float(rng.uniform(0.05, 0.6)) * (t - 1))
        base = num_requests
        rel = costs.relative_costs(base, sum(caps))

        def rate(plan):
            return (base + sum(s[:n].sum() for s, n in zip(survival, plan))) / rel[sum(plan)]

        got = plan_num_drafts(survival, caps, base, costs)
        assert all(0 <= n <= c for n, c in zip(got, caps))
        best = max(rate(p) for p in itertools.product(*[range(c + 1) for c in caps]))
        assert rate(got) == pytest.approx(best)


def test_acceptance_estimate_updates_seen_positions_pauses_and_backs_off():
    estimate = AcceptanceEstimate(4)
    estimate.observe(4, 1)  # position 0 accepted, position 1 rejected, 2 and 3 not reached
    assert estimate.accept.tolist() == pytest.approx([0.775, 0.525, 0.7, 0.7])
    assert estimate.survival().tolist() == pytest.approx(np.cumprod([0.775, 0.525, 0.7, 0.7]).tolist())
    estimate.pause_now(10)
    assert estimate.is_paused(10 + FIRST_PAUSE - 1) and not estimate.is_paused(10 + FIRST_PAUSE)
    assert estimate.accept.tolist() == [0.7] * 4  # a retry starts from the prior
    estimate.pause_now(40)  # the retry accepted nothing: the next pause is twice as long
    assert estimate.is_paused(40 + 2 * FIRST_PAUSE - 1) and not estimate.is_paused(40 + 2 * FIRST_PAUSE)
    estimate.observe(2, 2)
    estimate.pause_now(100)  # this retry accepted a draft: back to the first length
    assert not estimate.is_paused(100 + FIRST_PAUSE)


# ---------------------------------------------------------------- greedy equality on tiny models


@pytest.fixture(scope="module")
def tiny_engines(tmp_path_factory):
    """arch -> the module's one engine for that tiny architecture, built on first use: speculation on
    (every available draft verified), the plain greedy outputs of ``prompts_for(1)`` (logprobs too)
    computed in it with speculation opted out, and a watch over every step's blocks and drafts."""
    built: dict[str, SimpleNamespace] = {}

    def get(arch: str) -> SimpleNamespace:
        if arch not in built:
            path = str(make_tiny_model(arch, tmp_path_factory.mktemp(arch), vocab_size=VOCAB))
            llm = LLM(model=path, dtype="float32", num_threads=1, num_kv_blocks=256, block_size=4,
                      speculative_config=spec(5))
            seen = watch_unverified_blocks(llm)
            prompts = prompts_for(1)
            params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
            base = llm.generate(token_prompts(prompts), plain(params))
            assert not any(seen), "an opted-out request verified drafts"
            built[arch] = SimpleNamespace(arch=arch, path=path, llm=llm, seen=seen, prompts=prompts, params=params,
                                          base=base)
        return built[arch]

    return get


@pytest.fixture(params=ARCHS)
def tiny(request, tiny_engines):
    """Every tiny architecture."""
    return tiny_engines(request.param)


@pytest.fixture(params=["llama", "qwen3"])
def tiny2(request, tiny_engines):
    """Two architectures (with and without q/k norms) for the costlier scenarios."""
    return tiny_engines(request.param)


@pytest.fixture
def tiny_llama(tiny_engines):
    """One architecture, for what does not depend on it (bookkeeping, the runner, the policy)."""
    return tiny_engines("llama")


def test_only_decoding_steps_price_the_step_cost_model(tiny_llama):
    """A short prefill runs another path than a verify step of as many tokens and is far slower; it
    must not price that size (a size priced too high is never planned, so never timed again)."""
    speculator = set_spec(tiny_llama.llm, num_speculative_tokens=4)
    tiny_llama.llm.reset_prefix_cache()
    prefill_only = SamplingParams(temperature=0.0, max_tokens=1)
    tiny_llama.llm.generate(token_prompts([[5, 6, 7]]), prefill_only)  # one step: a 3-token prefill
    assert speculator.cost_model.num_observed.sum() == 0
    tiny_llama.llm.generate(token_prompts([[9, 10, 11]]), SamplingParams(temperature=0.0, max_tokens=6))
    assert speculator.cost_model.num_observed[1] > 0  # its decoding steps were timed


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_is_token_identical_to_plain_decoding(tiny, k):
    stats = set_spec(tiny.llm, num_speculative_tokens=k).stats
    tiny.seen.clear()
    outs = tiny.llm.generate(token_prompts(tiny.prompts), tiny.params)
    assert_same_greedy(outs, tiny.base)
    assert num_drafts_seen(tiny.seen) == stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens > 0, "no draft accepted: the test would not exercise multi-token steps"
    assert max(n for step in tiny.seen for _, n in step.values()) == k
    tiny.llm.engine.check_integrity()


def test_greedy_with_chunked_prefill_and_preemption(tiny2):
    """A 7-token step budget (prompts prefilled in chunks, drafts cut to fit) and a 40-block pool
    (requests preempted and recomputed), at k = 3."""
    blocks = 40
    llm = LLM(model=tiny2.path, dtype="float32", num_threads=1, num_kv_blocks=blocks, block_size=4,
              max_num_batched_tokens=7, speculative_config=spec(2))
    seen = watch_unverified_blocks(llm)
    stats = set_spec(llm, num_speculative_tokens=3).stats
    assert_same_greedy(llm.generate(token_prompts(tiny2.prompts), tiny2.params), tiny2.base)
    assert num_drafts_seen(seen) == stats.num_draft_tokens and stats.num_accepted_tokens > 0
    assert llm.engine.scheduler.num_preemptions_total > 0
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_manager.block_pool.num_free_blocks == blocks


def test_prefix_hits_n_and_stop_strings_with_speculation(tiny2):
    """Shared prefixes hit the cache, n = 2 sequences, a stop string completed in the middle of a
    multi-token step cuts the output there, max_tokens is never exceeded."""
    llm = tiny2.llm
    stats = set_spec(llm, num_speculative_tokens=5).stats
    prompts = prompts_for(2, num=3)
    prompts = prompts + [prompts[0] + [5, 6, 7, 8, 9, 10, 11, 12]]  # a prefix hit on prompt 0's blocks
    greedy = SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True, n=2)
    base = llm.generate(token_prompts(prompts), plain(greedy))
    text = base[1].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True, stop=[stop])
    base_stop = llm.generate(token_prompts(prompts[1:2]), plain(stopped))[0].outputs[0]

    outs = llm.generate(token_prompts(prompts), greedy)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in base]
    assert all(len(c.token_ids) == 37 for o in outs for c in o.outputs)
    assert outs[3].num_cached_tokens > 0
    got_stop = llm.generate(token_prompts(prompts[1:2]), stopped)[0].outputs[0]
    assert (got_stop.text, got_stop.token_ids, got_stop.finish_reason) == (
        base_stop.text, base_stop.token_ids, base_stop.finish_reason)
    assert got_stop.finish_reason == "stop" and stop not in got_stop.text
    assert stats.num_accepted_tokens > 0
    llm.engine.check_integrity()


def test_counters_add_up_and_opt_out_and_batch_size_switch(tiny_llama):
    stats = set_spec(tiny_llama.llm, num_speculative_tokens=4, disable_by_batch_size=2).stats
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    tiny_llama.llm.generate(token_prompts(prompts_for(3, num=2)), params)
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
    tiny_llama.llm.generate(token_prompts(prompts_for(4, num=3)), SamplingParams(temperature=0.0, max_tokens=3,
                                                                           ignore_eos=True))
    assert stats.snapshot() == before
    tiny_llama.llm.generate(token_prompts(prompts_for(3, num=2)), plain(params))
    assert stats.snapshot() == before


def test_cuda_runner_verifies_drafts_in_eager_steps(tiny_llama):
    """The CUDA runner's code on CPU (reference attention backend): verify steps run eagerly, plain
    decode steps through the padded decode; tokens equal plain decoding."""
    from tokenmill.runner.cuda_runner import CudaModelRunner

    llm = LLM(model=tiny_llama.path, dtype="float32", num_threads=1, num_kv_blocks=256, block_size=4, max_num_seqs=8,
              speculative_config=spec(3))
    engine = llm.engine
    engine.runner = runner = CudaModelRunner(engine.loaded, engine.config.cache, engine.scheduler_config,
                                             attention_backend="torch")
    outs = llm.generate(token_prompts(tiny_llama.prompts), tiny_llama.params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in tiny_llama.base]
    assert engine.speculator.stats.num_accepted_tokens > 0
    assert runner.num_general_steps > 0 and runner.num_padded_decode_steps > 0
    engine.check_integrity()


# ---------------------------------------------------------------- adaptive verification in the engine


def frozen_costs(per_token: float) -> StepCostModel:
    """A cost model that prices each extra token at ``per_token`` of a one-token step and ignores what
    the engine measures (so a test's drafting does not depend on this machine's speed)."""
    costs = StepCostModel(max_tokens=256, window=1, min_samples=1, warmup=0, horizon=10**9, probe_interval=10**9)
    for t in range(1, 257):
        costs.observe(t, 1.0 + per_token * (t - 1))
    costs.observe = lambda num_tokens, seconds: None  # the engine's measurements are ignored from here on
    return costs


class ScriptedSpeculator(Speculator):
    """Proposes from the known plain-decoding output of each prompt: the true next tokens (every
    draft accepted) for prompts in ``good``, the same with a wrong first token (every draft rejected)
    for the rest. Stands in for a proposer whose acceptance is known in advance."""

    def __init__(self, config, max_model_len, future: dict[tuple, list[int]], good: set[tuple]) -> None:
        super().__init__(config, max_model_len)
        self.future, self.good = future, good

    def propose_drafts(self, requests, limits):
        drafts = []
        for request, k in zip(requests, limits):
            key = tuple(request.prompt_token_ids)
            nxt = self.future[key][request.num_output_tokens : request.num_output_tokens + k]
            drafts.append(nxt if key in self.good or not nxt else [(nxt[0] + 1) % VOCAB] + nxt[1:])
        return drafts


def test_adaptive_verification_pauses_a_failing_request_and_keeps_outputs(tiny_llama):
    """Two requests in one batch under a fixed step cost (each extra token 25% of a one-token step):
    the one whose drafts are all rejected verifies a few, is paused, retried after FIRST_PAUSE output
    tokens and paused for longer; the one whose drafts are all accepted drafts at every step. Outputs
    equal plain decoding; with adaptive verification off the failing request verifies at every step."""
    llm, k = tiny_llama.llm, 4
    good, bad = tiny_llama.prompts[0], tiny_llama.prompts[1]
    future = {tuple(p): o.outputs[0].token_ids for p, o in zip(tiny_llama.prompts, tiny_llama.base)}

    def run(adaptive: bool):
        config = replace(llm.engine.config.speculative_config, num_speculative_tokens=k,
                         enable_adaptive_verification=adaptive)
        speculator = ScriptedSpeculator(config, llm.engine.max_model_len, future, {tuple(good)})
        speculator.cost_model = frozen_costs(0.25)
        saved, llm.engine.speculator = llm.engine.speculator, speculator
        try:
            tiny_llama.seen.clear()
            outs = llm.generate(token_prompts([good, bad]), tiny_llama.params)
        finally:
            llm.engine.speculator = saved
        assert_same_greedy(outs, tiny_llama.base[:2])
        ids = [o.request_id for o in outs]
        verified = [[step[rid] for step in tiny_llama.seen if rid in step] for rid in ids]  # (output length, drafts) per verify
        return speculator, verified

    speculator, (good_steps, bad_steps) = run(adaptive=True)
    good_drafts = sum(n for _, n in good_steps)
    assert speculator.stats.num_accepted_tokens == good_drafts >= 30  # the good one: most tokens from drafts
    bad_steps = [out for out, _ in bad_steps]
    assert 2 <= len(bad_steps) <= 8, bad_steps  # the bad one: a few verifies, of 48 steps
    gaps = np.diff(bad_steps)
    assert gaps.max() >= FIRST_PAUSE and speculator.num_paused_total >= 2  # paused, retried, paused again
    llm.engine.check_integrity()

    _, (_, bad_always) = run(adaptive=False)
    assert len(bad_always) >= 40


# ---------------------------------------------------------------- deterministic mode


def test_deterministic_mode_is_bit_identical_with_and_without_speculation(tmp_path):
    path = str(make_tiny_model("qwen3", tmp_path / "qwen3", dtype=torch.bfloat16, vocab_size=VOCAB))
    prompts = prompts_for(5, num=3)
    cases = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3),
             SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=40, ignore_eos=True, logprobs=3,
                            repetition_penalty=1.1, n=2)]
    llm = LLM(model=path, dtype="bfloat16", deterministic=True, num_threads=1, num_kv_blocks=256, block_size=4,
              max_num_batched_tokens=32, enable_prefix_caching=False, speculative_config=spec(4))

    def run(opt_out: bool):
        results = []
        for params in cases:
            for o in llm.generate(token_prompts(prompts), replace(params, disable_speculative_decoding=opt_out)):
                results.append([(c.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in c.logprobs],
                                 c.cumulative_logprob) for c in o.outputs])
        return results

    without = run(opt_out=True)
    assert llm.engine.speculator.stats.num_draft_tokens == 0
    assert run(opt_out=False) == without
    assert llm.engine.speculator.stats.num_accepted_tokens > 0


# ---------------------------------------------------------------- the draft-model proposer


def test_draft_model_proposer_is_exact_for_k_1_to_5_and_frees_its_pool(tmp_path):
    """A tiny random Llama drafts for itself (every greedy draft accepted, k = 1..5) and a different
    random model drafts for it (almost none accepted): outputs equal plain decoding, greedy and
    seeded, in deterministic mode bit for bit, and the draft's KV pool is empty afterwards."""
    target = str(make_tiny_model("llama", tmp_path / "target", dtype=torch.bfloat16, vocab_size=VOCAB))
    other = str(make_tiny_model("llama", tmp_path / "draft", dtype=torch.bfloat16, vocab_size=VOCAB, seed=11,
                                num_hidden_layers=1))
    prompts = prompts_for(6, num=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True, logprobs=2)

    def outputs(llm, params):
        return [[(c.token_ids, logprob_maps(c)) for c in o.outputs] for o in llm.generate(token_prompts(prompts), params)]

    llm = LLM(model=target, dtype="bfloat16", deterministic=True, num_threads=1, num_kv_blocks=128, block_size=4,
              speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3,
                                  "enable_adaptive_verification": False})
    want_greedy, want_seeded = outputs(llm, plain(greedy)), outputs(llm, plain(seeded))
    for k in range(1, 6):
        stats = set_spec(llm, num_speculative_tokens=k).stats
        assert outputs(llm, greedy) == want_greedy
        # Its own argmax: every greedy draft is accepted.
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens, k
    stats = set_spec(llm, num_speculative_tokens=3).stats
    assert outputs(llm, seeded) == want_seeded
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # seeded rows keep the drafts their draws equal
    pool = llm.engine.speculator.pool
    assert not pool.blocks and len(pool.free) == 128
    llm.engine.check_integrity()

    other_llm = LLM(model=target, dtype="bfloat16", deterministic=True, num_threads=1, num_kv_blocks=128, block_size=4,
                    speculative_config={"method": "draft_model", "model": other, "num_speculative_tokens": 3})
    assert outputs(other_llm, greedy) == want_greedy
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
    return LLM(num_threads=1, max_model_len=1024, kv_cache_memory=0.06,  # ~2.7k tokens; the draft pool is as large
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})


def plain_and_speculative(llm: LLM, messages: list[dict], params: SamplingParams):
    stats = llm.engine.speculator.stats
    before = stats.snapshot()
    want = llm.chat(messages, plain(params))[0].outputs[0]
    assert stats.snapshot() == before, "the opted-out request verified drafts"
    return want, llm.chat(messages, params)[0].outputs[0]


COPY_TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
             "All that glitters is not gold. Actions speak louder than words.")
COPY_MESSAGES = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{COPY_TEXT}"}]


@pytest.fixture(scope="module")
def smollm2_copy(smollm2):
    """The copy task's plain greedy output (24 tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    return params, smollm2.chat(COPY_MESSAGES, plain(params))[0].outputs[0]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_smollm2_copy_task_accepts_most_drafts_and_matches_plain_decoding(smollm2, smollm2_copy, k):
    stats = set_spec(smollm2, num_speculative_tokens=k, enable_adaptive_verification=False).stats
    params, want = smollm2_copy
    got = smollm2.chat(COPY_MESSAGES, params)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    assert stats.acceptance_rate > 0.5, stats
    smollm2.engine.check_integrity()


def test_verify_rows_take_plain_decodings_kernels_whatever_the_plan_says_at_their_row_count(smollm2):
    """The measured plan may dequantize for torch's GEMM at a verify step's row count (forced here for
    every count from 2 rows); a verify step run as decode rows still takes the kernel plain decoding
    takes at its batch of one request, so its log-probabilities are plain decoding's bit for bit."""
    quants = [m.quant for m in smollm2.engine.runner.model.modules()
              if getattr(m, "quant", None) is not None and m.quant.dequantize_table]
    assert quants, "the plan dequantizes at no row count here; this test forces it where it does"
    saved = [q.dequantize_table for q in quants]
    stats = set_spec(smollm2, num_speculative_tokens=4, enable_adaptive_verification=False).stats
    try:
        for q in quants:
            q.dequantize_table = (False, False) + (True,) * (len(q.dequantize_table) - 2)
        params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0)
        outputs = []
        for run in (plain(params), params):  # each prefills the whole prompt alike: no prefix-cache hit
            smollm2.reset_prefix_cache()
            outputs.append(smollm2.chat(COPY_MESSAGES, run)[0].outputs[0])
        want, got = outputs
    finally:
        for q, table in zip(quants, saved):
            q.dequantize_table = table
    assert stats.num_accepted_tokens >= 8, stats
    assert got.token_ids == want.token_ids
    assert [{t: lp.logprob for t, lp in p.items()} for p in got.logprobs] == \
        [{t: lp.logprob for t, lp in p.items()} for p in want.logprobs]


def test_smollm2_adaptive_verification_keeps_drafting_on_the_copy_task(smollm2, smollm2_copy):
    """Adaptive verification (the default) where a step is bound by reading the weights (each extra
    token 10% of a one-token step): the copy task's drafts pay, so they keep being verified."""
    speculator = set_spec(smollm2, num_speculative_tokens=4, enable_adaptive_verification=True)
    speculator.cost_model = frozen_costs(0.1)
    params, want = smollm2_copy
    got = smollm2.chat(COPY_MESSAGES, params)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert speculator.stats.acceptance_rate > 0.5 and speculator.stats.num_accepted_tokens >= 8, speculator.stats


def test_structured_output_with_speculation_is_valid_json_and_equals_plain(smollm2):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    messages = [{"role": "user", "content": 'Reply with JSON like {"name":"Alice Smith","age":30} for Alice Smith, '
                                            "who is 30, copying that exact form."}]
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    stats = set_spec(smollm2, num_speculative_tokens=4, enable_adaptive_verification=False).stats
    want, got = plain_and_speculative(smollm2, messages, params)
    assert got.token_ids == want.token_ids
    value = json.loads(got.text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert stats.num_draft_tokens > 0, "no draft was verified under the constraint"


def test_smollm2_draft_model_is_exact_for_k_1_to_5(smollm2):
    """The draft-model proposer on the embedded model: the same GGUF, loaded again as the draft of the
    module's engine, drafts for it (its greedy drafts are the target's argmax up to rounding, so most are
    accepted); outputs equal plain decoding. A short plain-text prompt: the draft prefills it anew for
    every request."""
    from tokenmill.models.default_model import default_model_path

    engine = smollm2.engine
    config = SpeculativeConfig(method="draft_model", model=str(default_model_path()), num_speculative_tokens=1,
                               enable_adaptive_verification=False)
    speculator = engine._build_speculator(config, engine.max_model_len)  # loads the draft only
    saved, engine.speculator = engine.speculator, speculator
    try:
        prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        want = smollm2.generate(prompt, plain(params))[0].outputs[0].token_ids
        for k in range(1, 6):
            speculator.config = replace(config, num_speculative_tokens=k)
            speculator.stats = stats = SpecDecodingStats(k)
            assert smollm2.generate(prompt, params)[0].outputs[0].token_ids == want, k
            assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.5, (k, stats)
        assert not speculator.pool.blocks
        engine.check_integrity()
    finally:
        engine.speculator = saved


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("value, field", [
    ({"method": "medusa"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "model": "x.gguf"}, "model"),
    ({"method": "draft_model"}, "model"),
    ({"enable_adaptive_verification": "yes"}, "enable_adaptive_verification"),
    ({"lookahead": 3}, "unknown keys"),
    ("{not json", "must be JSON"),
])
def test_speculative_config_errors_name_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_value(value)


def test_speculative_config_defaults():
    config = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 2}')
    assert (config.lookup_min, config.lookup_max, config.num_speculative_tokens) == (2, 5, 2)
    assert config.enable_adaptive_verification is True
    assert SpeculativeConfig.from_value({"prompt_lookup_max": 1}).lookup_min == 1
    assert SpeculativeConfig.from_value(None) is None
    with pytest.raises(ValueError, match="disable_speculative_decoding"):
        SamplingParams(disable_speculative_decoding="yes")
