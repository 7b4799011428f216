"""SamplingParams: the user-facing knobs of one request's generation, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

# Largest number of top log-probabilities a request may ask for (OpenAI caps top_logprobs at 20).
MAX_LOGPROBS = 20


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
