"""Multi-turn benchmark conversations taken from ShareGPT: user turns in order, reply lengths as targets.

Each conversation keeps its first ``num_turns`` human turns that are answered by a gpt turn; a
turn's ``expected_output_len`` is the reference reply's token count (capped). The client sends
the turns one after another, appending the server's answers to the history. Never imports torch.
"""
from __future__ import annotations

import random
from typing import Any

from tokenmill.bench.datasets import SampledRequest, Tokenizer, load_sharegpt


def _exchanges(record: dict[str, Any]) -> list[tuple[str, str]]:
    """(human text, gpt reply) pairs of a ShareGPT record, in order."""
    turns = record.get("conversations") or []
    return [
        (turns[i]["value"], turns[i + 1]["value"])
        for i in range(len(turns) - 1)
        if turns[i].get("from") == "human" and turns[i + 1].get("from") == "gpt"
    ]


def sample_conversations(
    tokenizer: Tokenizer,
    num_conversations: int,
    num_turns: int,
    seed: int,
    max_output_len: int = 128,
    max_total_len: int = 2048,
) -> list[tuple[SampledRequest, ...]]:
    """Sample ShareGPT conversations with at least ``num_turns`` answered human turns.

    Records are shuffled with ``random.Random(seed)``. A conversation is kept when every turn's
    user message has at least one token and all user tokens plus all target reply tokens add up
    to at most ``max_total_len`` (a bound on the last turn's history, chat-template tokens
    aside). Each turn's target is ``min(reply tokens, max_output_len)``, at least 1.

    Raises:
        ValueError: naming the field, for out-of-range arguments, or ``num_conversations`` when
            too few conversations pass.
    """
    for name, value in (("num_conversations", num_conversations), ("num_turns", num_turns),
                        ("max_output_len", max_output_len), ("max_total_len", max_total_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    records = list(load_sharegpt())
    random.Random(seed).shuffle(records)
    sampled: list[tuple[SampledRequest, ...]] = []
    for record in records:
        exchanges = _exchanges(record)
        if len(exchanges) < num_turns:
            continue
        turns = []
        for user_text, reply in exchanges[:num_turns]:
            ids = tokenizer.encode(user_text, add_special_tokens=False)
            out_len = max(1, min(len(tokenizer.encode(reply, add_special_tokens=False)), max_output_len))
            turns.append(SampledRequest(user_text, ids, out_len))
        if any(t.prompt_len < 1 for t in turns):
            continue
        if sum(t.prompt_len + t.expected_output_len for t in turns) > max_total_len:
            continue
        sampled.append(tuple(turns))
        if len(sampled) == num_conversations:
            return sampled
    raise ValueError(
        f"num_conversations must be <= {len(sampled)} (ShareGPT conversations with {num_turns} turns "
        f"within {max_total_len} tokens), got {num_conversations}"
    )
