"""Tests for tokenmill.sampling: greedy, seeded reproducibility, top-k/top-p/min-p, penalties,
logit bias, min_tokens and log-probabilities, each checked against a slow reference."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tokenmill.sampling import Sampler, SamplingMetadata, SamplingRow
from tokenmill.sampling.metadata import position_seed
from tokenmill.sampling import top_k_top_p
from tokenmill.sampling.penalties import apply_penalties
from tokenmill.sampling.top_k_top_p import apply_min_p, apply_top_k_top_p
from tokenmill.sampling_params import SamplingParams


def resolved(**kwargs) -> SamplingParams:
    return SamplingParams(**kwargs).with_defaults({})


def make_row(
    seed: int | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    stop: set[int] | None = None,
    **kwargs,
) -> SamplingRow:
    return SamplingRow(
        params=resolved(**kwargs),
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        seed=seed,
        stop_token_ids=stop or set(),
    )


def sample(rows: list[SamplingRow], logits: torch.Tensor):
    metadata = SamplingMetadata.build(rows, logits.shape[1])
    return Sampler(logits.shape[1])(logits.clone(), metadata)


# ---------------------------------------------------------------- greedy


def test_greedy_rows_take_argmax_even_in_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    rows = [make_row(temperature=0.0) if i % 2 == 0 else make_row(temperature=1.0, top_k=5) for i in range(6)]
    out = sample(rows, logits)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids[::2], logits[::2].argmax(-1))
    all_greedy = sample([make_row(temperature=0.0) for _ in range(6)], logits)
    assert torch.equal(all_greedy.sampled_token_ids, logits.argmax(-1))
    assert all_greedy.logprobs is None and all_greedy.top_logprob_ids is None


def test_unused_features_leave_metadata_fields_none():
    metadata = SamplingMetadata.build([make_row(temperature=0.7), make_row(temperature=0.0, top_k=3)], 50)
    assert not metadata.all_greedy and not metadata.all_random
    # top_k is set only on a greedy row, where it is irrelevant.
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.repetition_penalties is None and metadata.output_token_ids is None
    assert metadata.logit_bias is None and metadata.min_tokens_mask is None
    assert metadata.max_num_logprobs is None and metadata.seeds == {}
    used = SamplingMetadata.build([make_row(top_k=3, top_p=0.5, min_p=0.1, logprobs=2), make_row(logprobs=4)], 50)
    assert used.top_k.tolist() == [3, 50] and used.max_top_k == 3
    assert used.top_p.tolist() == [0.5, 1.0] and used.max_num_logprobs == 4


# ---------------------------------------------------------------- seeded reproducibility


def test_seeded_rows_reproduce_across_batch_composition_and_position():
    vocab, steps = 64, 6
    step_logits = [torch.randn(vocab, generator=torch.Generator().manual_seed(100 + s)) for s in range(steps)]
    # top-k without top-p: alone it runs the no-sort path; beside a top-p row, the sort path.
    target = dict(temperature=0.9, top_k=20, min_p=0.01)

    def run(position: int, others: list[dict], seed: int = 1234) -> list[int]:
        seeded = make_row(seed=seed, **target)
        tokens = []
        for s in range(steps):
            rows = [make_row(**kw) for kw in others]
            rows.insert(position, seeded)
            logits = torch.randn(len(rows), vocab)
            logits[position] = step_logits[s]
            tokens.append(int(sample(rows, logits).sampled_token_ids[position]))
        return tokens

    alone = run(0, [])
    others = [
        dict(temperature=1.0),
        dict(seed=7, temperature=1.3, min_p=0.05),
        dict(temperature=0.0),
        dict(temperature=0.5, top_p=0.3),
    ]
    assert run(2, others) == alone
    assert run(4, others) == alone
    assert run(1, others[:2]) == alone
    different = [run(0, [], seed=s) for s in range(5)]
    assert any(tokens != alone for tokens in different)


def test_a_seeded_draw_depends_only_on_the_seed_and_the_position():
    """The draw at sequence position p uses position_seed(seed, p): a row whose prompt already holds
    the earlier output samples what the row with that output samples (how a stream is resumed
    elsewhere); another position or seed draws other noise."""
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(5))
    params = dict(temperature=1.0)

    def token(seed: int, prompt: list[int], output: list[int]) -> int:
        return int(sample([make_row(seed=seed, prompt=prompt, output=output, **params)], logits).sampled_token_ids[0])

    assert token(9, [1, 2, 3], [4, 5]) == token(9, [1, 2, 3, 4, 5], []) == token(9, [7, 7, 7, 7], [8])
    assert len({token(9, [1] * n, []) for n in range(1, 12)}) > 3
    assert len({token(s, [1, 2], []) for s in range(10)}) > 3
    assert position_seed(9, 5) != position_seed(9, 6) and 0 <= position_seed(2**64 - 1, 10**9) < 2**64


def test_seeded_generation_resumes_exactly_from_prompt_plus_output(tmp_path):
    """A seeded request re-sent as prompt + its first k tokens (sequence j of n as seed + j, n = 1)
    continues with exactly the tokens the uninterrupted run produced."""
    from tests.tiny_models import make_tiny_model
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=str(make_tiny_model("llama", tmp_path / "m")), dtype="float32", num_threads=1, num_kv_blocks=64)
    prompt = [5, 17, 300, 42, 9]
    full = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=1.0, top_p=0.9, seed=77, n=2,
                                                                     max_tokens=16, ignore_eos=True))[0]
    for j, completion in enumerate(full.outputs):
        for k in (1, 6):
            resumed = llm.generate({"prompt_token_ids": prompt + completion.token_ids[:k]},
                                   SamplingParams(temperature=1.0, top_p=0.9, seed=77 + j, max_tokens=16 - k,
                                                  ignore_eos=True))[0]
            assert resumed.outputs[0].token_ids == completion.token_ids[k:], (j, k)
    assert full.outputs[0].token_ids != full.outputs[1].token_ids


def test_a_seeded_draw_survives_small_changes_in_the_logits():
    """A request resumed on another worker (prompt + output prefilled) or verified by speculative
    decoding sees logits that differ in their last bits; its seeded draws must not move. The race's
    margin is of the order of the ratios, so 1e-3 of noise on flat logits changes none of 300 draws
    (an inverse-CDF draw of the same seeds changed 20)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 32000, generator=gen) * 0.5
    nudged = logits + 1e-3 * torch.randn(1, 32000, generator=gen)

    def draws(x: torch.Tensor) -> list[int]:
        return [int(sample([make_row(seed=s, temperature=1.0)], x).sampled_token_ids[0]) for s in range(300)]

    assert draws(logits) == draws(nudged)


def test_a_token_of_negligible_probability_is_never_drawn():
    """One token holds all but ~5e-13 of the mass over 128256 tokens: 1000 seeded draws all take it.
    (Float32 uniforms drew u = 0, noise 0, once in 2^24 values: a random token won 14 of these draws.)"""
    vocab = 128256
    logits = torch.zeros(50, vocab)
    logits[:, 7] = 40.0
    for batch in range(20):
        rows = [make_row(seed=50 * batch + i, temperature=1.0, prompt=[1, 2, 3]) for i in range(50)]
        assert sample(rows, logits).sampled_token_ids.tolist() == [7] * 50, batch


def test_greedy_seeded_row_draws_nothing_and_seeded_rows_key_by_position():
    rows = [make_row(seed=3, temperature=0.0), make_row(temperature=1.0), make_row(seed=3, temperature=1.0, output=[5])]
    metadata = SamplingMetadata.build(rows, 32)
    assert metadata.seeds == {2: position_seed(3, 1)}  # the greedy row has no seed to draw with


# ---------------------------------------------------------------- filtering

KNOWN_PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])


@pytest.mark.parametrize(
    ("filters", "allowed"),
    [
        (dict(top_k=3), [0, 1, 2]),
        (dict(top_p=0.75), [0, 1, 2]),  # 0.4 + 0.25 < 0.75 <= 0.4 + 0.25 + 0.15
        (dict(top_p=0.1), [0]),  # the top token always stays
        (dict(min_p=0.2), [0, 1, 2, 3]),  # p >= 0.08
        (dict(top_k=3, top_p=0.8), [0, 1]),  # top-p on the top-k renormalised [.5, .3125, .1875]
        (dict(top_k=5, min_p=0.3), [0, 1, 2]),  # p >= 0.12
    ],
)
def test_filters_never_emit_disallowed_tokens_and_match_renormalised_probs(filters, allowed):
    num_draws = 20000
    perm = torch.randperm(KNOWN_PROBS.numel(), generator=torch.Generator().manual_seed(0))
    logits = KNOWN_PROBS[perm].log()  # shuffled so token id != rank
    allowed_ids = perm.argsort()[allowed]  # where the allowed ranks landed
    torch.manual_seed(0)
    rows = [make_row(temperature=1.0, **filters)] * num_draws  # one unseeded row, many draws
    tokens = sample(rows, logits.expand(num_draws, -1).clone()).sampled_token_ids
    assert torch.isin(tokens, allowed_ids).all()
    freq = torch.bincount(tokens, minlength=logits.numel()).float() / num_draws
    expected = torch.zeros_like(freq)
    expected[allowed_ids] = KNOWN_PROBS[allowed] / KNOWN_PROBS[allowed].sum()
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_top_p_stops_as_soon_as_mass_reaches_p_and_always_keeps_the_top_token():
    # Powers of two: the float32 cumulative sums are exact, so 0.5 + 0.25 reaches 0.75 exactly.
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    kept = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.75])).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    # 1 - 1e-9 rounds to 1.0 in float32: without the guard even the top token would be dropped.
    big = torch.randn(4, 5000, generator=torch.Generator().manual_seed(2))
    out = sample([make_row(temperature=1.0, top_p=1e-9) for _ in range(4)], big)
    assert torch.equal(out.sampled_token_ids, big.argmax(-1))


def test_unfiltered_sampling_matches_softmax_with_temperature():
    num_draws = 20000
    logits = KNOWN_PROBS.log()
    torch.manual_seed(1)
    rows = [make_row(temperature=0.5)] * num_draws
    tokens = sample(rows, logits.expand(num_draws, -1).clone()).sampled_token_ids
    freq = torch.bincount(tokens, minlength=logits.numel()).float() / num_draws
    assert torch.allclose(freq, torch.softmax(logits / 0.5, -1), atol=0.015)


def reference_keep(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Slow per-token reference for top-k then top-p then min-p on one row of logits."""
    order = sorted(range(row.numel()), key=lambda i: -float(row[i]))
    kept = order[:top_k] if top_k > 0 else order
    probs = torch.softmax(row[kept].double(), -1).tolist()
    nucleus, mass = [], 0.0
    for token, p in zip(kept, probs):
        nucleus.append(token)
        mass += p
        if mass >= top_p:
            break
    probs = torch.softmax(row[nucleus].double(), -1).tolist()
    return {t for t, p in zip(nucleus, probs) if p >= min_p * max(probs)}


def test_vectorised_filters_match_slow_reference_over_grid():
    gen = torch.Generator().manual_seed(5)
    for vocab in (7, 33, 200):
        settings = [(0, 1.0, 0.0), (1, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.5, 0.0), (10, 0.9, 0.0),
                    (0, 1.0, 0.1), (4, 0.7, 0.05), (vocab, 0.3, 0.2), (0, 0.99, 0.01)]
        logits = torch.randn(len(settings), vocab, generator=gen) * 3
        top_k = torch.tensor([k if 0 < k < vocab else vocab for k, _, _ in settings])
        top_p = torch.tensor([p for _, p, _ in settings])
        min_p = torch.tensor([m for _, _, m in settings])
        max_top_k = max(int(k) for k in top_k if k < vocab)
        for use_top_p in (True, False):  # False exercises the no-sort top-k path
            filtered = apply_top_k_top_p(logits.clone(), top_k, top_p if use_top_p else None, max_top_k)
            filtered = apply_min_p(filtered, min_p)
            for i, (k, p, m) in enumerate(settings):
                expected = reference_keep(logits[i], k, p if use_top_p else 1.0, m)
                kept = set(torch.nonzero(filtered[i].isfinite()).flatten().tolist())
                assert kept == expected, (vocab, settings[i], use_top_p)
                assert torch.equal(filtered[i][list(kept)], logits[i][list(kept)])


def test_top_p_cut_from_a_few_candidates_equals_the_full_sort(monkeypatch):
    """Rows whose nucleus runs past the candidates are sorted: any candidate count gives the same
    tokens, and they match the slow reference (flat rows keep thousands of tokens, peaked rows few)."""
    gen = torch.Generator().manual_seed(8)
    vocab = 5000
    scales = [0.05, 5.0, 0.3, 5.0, 1.0, 0.05, 2.0]
    logits = torch.randn(len(scales), vocab, generator=gen) * torch.tensor(scales).unsqueeze(1)
    top_p = torch.tensor([0.9, 0.9, 0.99, 0.3, 1.0, 0.5, 0.95])
    top_k = torch.tensor([vocab, vocab, vocab, 40, vocab, 3000, 100])
    results = {}
    for candidates in (1, 4, 64, 256, vocab):
        monkeypatch.setattr(top_k_top_p, "TOP_P_CANDIDATES", candidates)
        results[candidates] = apply_top_k_top_p(logits.clone(), top_k, top_p, 3000).isfinite()
    for candidates, kept in results.items():
        assert torch.equal(kept, results[vocab]), candidates
    for i in range(len(scales)):
        k = int(top_k[i]) if top_k[i] < vocab else 0
        expected = reference_keep(logits[i], k, float(top_p[i]), 0.0)
        assert set(torch.nonzero(results[vocab][i]).flatten().tolist()) == expected, i
    assert int(results[vocab][0].sum()) > 256 and int(results[vocab][1].sum()) < 64  # both paths ran
    assert bool(results[vocab][4].all())  # top_p = 1 keeps every token


def test_top_p_keeps_tokens_tied_with_the_last_one_of_the_nucleus():
    logits = torch.tensor([[0.5, 0.2, 0.2, 0.1]]).log()
    kept = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.6])).isfinite()
    assert kept.tolist() == [[True, True, True, False]]  # the nucleus ends at the first 0.2; its tie stays


# ---------------------------------------------------------------- penalties


def reference_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    out = logits.clone()
    for i, row in enumerate(rows):
        p = row.params
        for token in set(row.prompt_token_ids) | set(row.output_token_ids):
            value = float(out[i, token])
            out[i, token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token, count in Counter(row.output_token_ids).items():
            out[i, token] -= p.frequency_penalty * count + p.presence_penalty
    return out


@pytest.mark.parametrize(
    "penalty",
    [
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.7),
        dict(frequency_penalty=0.5),
        dict(frequency_penalty=-1.2),
        dict(presence_penalty=0.8),
        dict(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=-0.4),
    ],
)
def test_penalties_match_reference_formula(penalty):
    vocab = 20
    rows = [
        make_row(prompt=[1, 2, 3, 3], output=[3, 4, 4, 4, 9], **penalty),
        make_row(prompt=[5], output=[], **penalty),  # empty output: only the prompt counts
        make_row(prompt=[0, 7], output=[7, 7, 19], temperature=0.0),  # no penalty on this row
        make_row(prompt=list(range(10)), output=[12, 0, 12], **penalty),
    ]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(3)) * 2
    processed = logits.clone()
    apply_penalties(processed, SamplingMetadata.build(rows, vocab))
    expected = reference_penalties(logits, rows)
    assert torch.allclose(processed, expected, atol=1e-6)
    assert torch.equal(processed[2], logits[2])
    assert not torch.equal(processed, logits)


def test_penalties_with_all_outputs_empty():
    rows = [make_row(prompt=[2, 2], frequency_penalty=1.0, repetition_penalty=2.0)]
    logits = torch.tensor([[1.0, -1.0, 4.0, -3.0]])
    processed = logits.clone()
    apply_penalties(processed, SamplingMetadata.build(rows, 4))
    assert processed.tolist() == [[1.0, -1.0, 2.0, -3.0]]


# ---------------------------------------------------------------- logit bias and min_tokens


def test_logit_bias_adds_to_its_row_only_and_steers_greedy():
    logits = torch.zeros(2, 10)
    logits[:, 0] = 5.0
    rows = [make_row(temperature=0.0, logit_bias={7: 10.0, 1: -2.5}, logprobs=0), make_row(temperature=0.0, logprobs=0)]
    out = sample(rows, logits)
    assert out.sampled_token_ids.tolist() == [7, 0]
    processed = logits.clone()
    processed[0, 7] += 10.0
    processed[0, 1] -= 2.5
    assert torch.allclose(out.logprobs, torch.log_softmax(processed, -1)[[0, 1], [7, 0]])
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingMetadata.build([make_row(logit_bias={10: 1.0})], 10)


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = torch.zeros(3, 8)
    logits[:, 2] = 9.0  # EOS is the favourite
    logits[:, 5] = 8.0  # a stop token, second favourite
    stop = {2, 5, 100}  # 100 is outside the vocabulary: ignored
    rows = [
        make_row(temperature=0.0, min_tokens=3, output=[1, 1], stop=stop, logprobs=1),
        make_row(temperature=0.0, min_tokens=3, output=[1, 1, 1], stop=stop),
        make_row(temperature=1.0, min_tokens=3, output=[], stop=stop),
    ]
    out = sample(rows, logits)
    assert out.sampled_token_ids[0] not in (2, 5) and out.sampled_token_ids[1] == 2
    assert out.sampled_token_ids[2] not in (2, 5)
    assert out.logprobs is not None and out.top_logprobs[0, 0] > float("-inf")
    full = torch.log_softmax(logits[0].clone().index_fill_(0, torch.tensor([2, 5]), float("-inf")), -1)
    assert torch.allclose(out.top_logprobs[0], full.max().reshape(1))


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_log_softmax_of_processed_logits_with_ranks_and_sorted_top_k():
    vocab = 40
    rows = [
        make_row(temperature=0.7, top_k=5, prompt=[1, 2], output=[2, 3, 3], repetition_penalty=1.2,
                 frequency_penalty=0.4, logit_bias={11: 1.5}, logprobs=3, seed=9),
        make_row(temperature=0.0, logprobs=5),
        make_row(temperature=1.3, top_p=0.8),  # asks for none; still gets the batch's k
    ]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(11))
    out = sample(rows, logits)
    processed = reference_penalties(logits, rows)
    processed[0, 11] += 1.5
    expected = torch.log_softmax(processed, -1)  # no temperature, no top-k/top-p
    tokens = out.sampled_token_ids
    assert torch.allclose(out.logprobs, expected.gather(1, tokens[:, None]).squeeze(1), atol=1e-5)
    for i in range(len(rows)):
        order = expected[i].argsort(descending=True).tolist()
        assert out.sampled_ranks[i] == order.index(int(tokens[i])) + 1
    assert out.sampled_ranks[1] == 1  # greedy
    assert out.top_logprob_ids.shape == (3, 5) and out.top_logprob_ids.dtype == torch.int64
    assert torch.equal(out.top_logprob_ids, expected.argsort(-1, descending=True)[:, :5])
    assert torch.allclose(out.top_logprobs, expected.gather(1, out.top_logprob_ids), atol=1e-5)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert math.isclose(float(out.top_logprobs[0].exp().sum()), float(expected[0].topk(5).values.exp().sum()),
                        rel_tol=1e-5)


def test_zero_logprobs_gives_empty_top_k_but_sampled_logprob():
    logits = torch.randn(2, 16)
    out = sample([make_row(temperature=0.0, logprobs=0), make_row(temperature=0.0)], logits)
    assert out.top_logprob_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1).max(-1).values)
    assert out.sampled_ranks.tolist() == [1, 1]
