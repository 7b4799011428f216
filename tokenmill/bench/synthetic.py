"""Synthetic benchmark workloads built from random tokens: the shared-prefix dataset.

Requests fall into groups; every request of a group starts with the group's long prefix (a
system prompt, a few-shot block, a document) followed by its own short question. This is the
workload prefix caching is for. Never imports torch; only needs an HF-style tokenizer.
"""
from __future__ import annotations

import random

from tokenmill.bench.datasets import SampledRequest, Tokenizer


def regular_vocab(tokenizer: Tokenizer) -> list[int]:
    """Token ids of the tokenizer's regular vocabulary (special tokens excluded)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [i for i in range(tokenizer.vocab_size) if i not in special]


def sample_shared_prefix(
    tokenizer: Tokenizer,
    num_prompts: int,
    num_groups: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int,
) -> list[SampledRequest]:
    """``num_prompts`` requests spread round-robin over ``num_groups`` shared prefixes, then shuffled.

    Prefix and suffix are ``prefix_len`` / ``suffix_len`` random regular tokens, decoded to text
    and joined with a newline, so every request of a group sends the same prefix text. Each
    request's ``prompt_token_ids`` is the tokenizer's encoding of the full prompt text (what a
    server with the same tokenizer sees), and it asks for ``output_len`` tokens.

    Raises:
        ValueError: naming the field, for out-of-range arguments.
    """
    for name, value in (("num_prompts", num_prompts), ("num_groups", num_groups), ("prefix_len", prefix_len),
                        ("suffix_len", suffix_len), ("output_len", output_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_groups > num_prompts:
        raise ValueError(f"num_groups must be <= num_prompts ({num_prompts}), got {num_groups}")
    rng = random.Random(seed)
    vocab = regular_vocab(tokenizer)
    prefixes = [tokenizer.decode(rng.choices(vocab, k=prefix_len)) for _ in range(num_groups)]
    requests = []
    for i in range(num_prompts):
        suffix = tokenizer.decode(rng.choices(vocab, k=suffix_len))
        prompt = f"{prefixes[i % num_groups]}\n{suffix}"
        requests.append(SampledRequest(prompt, tokenizer.encode(prompt), output_len))
    rng.shuffle(requests)
    return requests
