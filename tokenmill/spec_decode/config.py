"""SpeculativeConfig: vLLM's ``--speculative-config`` (same field names), validated on construction.

Pure data; imports nothing from the engine.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from tokenmill.config_error import ConfigError, config_from_value

SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's ``speculative_config``; docs/spec_decode.md).

    Args:
        method: ``ngram`` (prompt lookup over the request's own prompt and output, no model) or
            ``draft_model`` (a smaller model with the same vocabulary drafts greedily, over its own paged
            KV cache).
        num_speculative_tokens: k, the most draft tokens proposed and verified per request per step.
        prompt_lookup_min: shortest n-gram (the request's last n tokens) the ``ngram`` proposer matches.
        prompt_lookup_max: longest n-gram, tried first. Unset, they are 2 and 5 (an unset max is at
            least the min, an unset min at most the max).
        model: the draft model (path or GGUF file) of ``draft_model``.
        disable_by_batch_size: no drafts in a step that runs more requests than this (None: never
            off). At large batches a step is compute-bound and verifying rejected drafts costs time.
        enable_adaptive_verification: choose per step how many drafts each request verifies from its
            running acceptance and the measured cost of a step by token count, pausing a request whose
            drafts do not pay (``spec_decode.adaptive``; vLLM's field name). False: every available
            draft, up to ``num_speculative_tokens``, is verified.

    Raises:
        ConfigError: an unknown method or key, a count out of range, min above max, a ``model``
            with ``ngram`` or none with ``draft_model``, a non-boolean ``enable_adaptive_verification``.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None
    enable_adaptive_verification: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"`speculative_config` method must be one of {list(SPEC_METHODS)}, got {self.method!r}")
        for name, maximum, optional in (("num_speculative_tokens", MAX_SPECULATIVE_TOKENS, False),
                                        ("prompt_lookup_min", None, True), ("prompt_lookup_max", None, True),
                                        ("disable_by_batch_size", None, True)):
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1 or (
                    maximum is not None and value > maximum):
                bound = ">= 1" if maximum is None else f"in [1, {maximum}]"
                raise ConfigError(f"`speculative_config` {name} must be an integer {bound}, got {value!r}")
        if not isinstance(self.enable_adaptive_verification, bool):
            raise ConfigError("`speculative_config` enable_adaptive_verification must be true or false, got "
                              f"{self.enable_adaptive_verification!r}")
        if self.lookup_min > self.lookup_max:
            raise ConfigError(f"`speculative_config` prompt_lookup_min ({self.lookup_min}) must be <= "
                              f"prompt_lookup_max ({self.lookup_max})")
        if self.method == "ngram" and self.model is not None:
            raise ConfigError("`speculative_config` model is for method 'draft_model'; 'ngram' needs no model")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ConfigError("`speculative_config` model (a path or GGUF file) is required by method 'draft_model'")

    @property
    def lookup_min(self) -> int:
        """The shortest n-gram matched (resolved default)."""
        if self.prompt_lookup_min is not None:
            return self.prompt_lookup_min
        return min(2, self.prompt_lookup_max) if self.prompt_lookup_max is not None else 2

    @property
    def lookup_max(self) -> int:
        """The longest n-gram matched (resolved default)."""
        if self.prompt_lookup_max is not None:
            return self.prompt_lookup_max
        return max(5, self.prompt_lookup_min) if self.prompt_lookup_min is not None else 5

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a config, a dict, its JSON text (``'{"method": "ngram", "num_speculative_tokens": 3}'``),
        or None (speculation off: returns None).

        Raises:
            ConfigError: not JSON, not an object, an unknown key or a bad value.
        """
        if value is None:
            return None
        return config_from_value(cls, value, "speculative_config", '{"method": "ngram", "num_speculative_tokens": 3}')
