"""SamplingParams: the user-facing knobs of one request's generation, validated on construction."""
from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

# Largest number of top log-probabilities a request may ask for (OpenAI caps top_logprobs at 20).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's ``StructuredOutputsParams``); exactly one field set.

    Attributes:
        json: a JSON schema (dict or JSON text); the output is one JSON value valid against it,
            written with compact separators (``,`` and ``:``, no free whitespace).
        regex: the output fully matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, as GBNF/EBNF (``root ::= ...``) or Lark (``start: ...``).
        json_object: True: the output is any JSON object (``response_format: {"type": "json_object"}``).
        tool_calls: OpenAI tool calls in the Hermes format, ``{"tools": [{"name": str, "parameters":
            JSON schema}, ...], "parallel": bool}``: the output is one or more (``parallel``; else
            exactly one) blocks ``<tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>``
            back to back (no separator: the model then ends after a call more readily), NAME one of
            the tools and ARGS compact JSON valid against its ``parameters``. Used for
            ``tool_choice: "required"`` and a named tool choice.

    Raises:
        ValueError: naming ``structured_outputs`` when no field or more than one is set, or a field
            has the wrong type. Whether a schema, regex or grammar is valid is checked when it is
            compiled (``tokenmill.structured_output``), not here.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    tool_calls: dict | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "tool_calls")

    def __post_init__(self) -> None:
        set_kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object, tool_calls; "
                f"got {set_kinds or 'none'}"
            )
        kind = set_kinds[0]
        value = getattr(self, kind)
        expected = {"json": (str, dict), "regex": str, "choice": list, "grammar": str, "json_object": bool,
                    "tool_calls": dict}[kind]
        if not isinstance(value, expected):
            raise ValueError(f"structured_outputs.{kind} has the wrong type: {type(value).__name__}")
        if kind == "choice" and (not value or not all(isinstance(c, str) for c in value)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """The name of the one field that is set (``json``, ``regex``, ...)."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> str:
        """The constraint as text (JSON values as compact JSON, keys in their given order): with :attr:`kind`, the
        key of the compiled-constraint cache."""
        value: Any = getattr(self, self.kind)
        if isinstance(value, str):
            return value
        return _json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy. ``None`` fields take the model's
    ``generation_config.json`` default (see :meth:`with_defaults`).

    Raises:
        ValueError: naming the field, when a value is out of range.
    """

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    disable_speculative_decoding: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if self.n < 1:
            raise bad("n", "must be >= 1")
        # Comparisons are written so that NaN fails them.
        if self.temperature is not None and not (0 <= self.temperature < math.inf):
            raise bad("temperature", "must be a finite number >= 0")
        if self.top_p is not None and not (0 < self.top_p <= 1):
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k is not None and self.top_k < 0:
            raise bad("top_k", "must be >= 0 (0 disables it)")
        if not (0 <= self.min_p <= 1):
            raise bad("min_p", "must be in [0, 1]")
        if not (-2 <= self.presence_penalty <= 2):
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not (-2 <= self.frequency_penalty <= 2):
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty is not None and not (0 < self.repetition_penalty < math.inf):
            raise bad("repetition_penalty", "must be a finite number > 0")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**63):
            raise bad("seed", "must fit in a signed 64-bit integer")
        if self.logit_bias is not None and not all(-100 <= v <= 100 for v in self.logit_bias.values()):
            raise bad("logit_bias", "values must be numbers in [-100, 100]")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise bad("max_tokens", "must be >= 0")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be in [0, {MAX_LOGPROBS}]")
        if self.stop is not None and any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        if not isinstance(self.disable_speculative_decoding, bool):
            raise bad("disable_speculative_decoding", "must be true or false")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    @cached_property
    def stop_token_id_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a frozenset, built once (the engine looks a token up in it at every step)."""
        return frozenset(self.stop_token_ids or ())

    @property
    def greedy(self) -> bool:
        return self.temperature is not None and self.temperature == 0.0

    def with_defaults(self, generation_config: dict) -> "SamplingParams":
        """Fill ``None`` fields from a model's generation config (dict of generation_config.json)."""
        temperature = self.temperature
        if temperature is None:
            do_sample = generation_config.get("do_sample", True)
            temperature = float(generation_config.get("temperature", 1.0)) if do_sample else 0.0
        top_p = self.top_p if self.top_p is not None else float(generation_config.get("top_p", 1.0))
        top_k = self.top_k if self.top_k is not None else int(generation_config.get("top_k", 0) or 0)
        rep = self.repetition_penalty
        if rep is None:
            rep = float(generation_config.get("repetition_penalty", 1.0))
        return replace(self, temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=rep)
