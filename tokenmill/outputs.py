"""What the engine hands back to callers: RequestOutput, CompletionOutput and Logprob records."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.lora_request import LoRARequest


@dataclass
class Logprob:
    """Log-probability of one token (natural log) and its rank in the distribution (1 = most likely).

    ``decoded_token`` is the token's text alone, or ``bytes:\\xNN...`` when its bytes are not valid
    UTF-8 on their own (see ``tokenmill/token_strings.py``).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's log-probabilities: token id -> Logprob (the sampled/actual token plus top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the ``n`` sequences generated for a request.

    ``text``/``token_ids`` are cumulative; ``delta_text``/``delta_token_ids`` hold what is new
    since the previous RequestOutput of the same request (for streaming).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # matched stop string or stop token id
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request (all its ``n`` sequences) after an engine step.

    ``prompt_logprobs[0]`` is None (the first prompt token has no context).
    ``num_cached_tokens`` counts prompt tokens served from the prefix cache.
    ``lora_request`` is the adapter the request ran with (None: the base model).
    ``kv_transfer_params``: on a KV producer, where a decode worker pulls this prompt's K/V (vLLM's field).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    lora_request: LoRARequest | None = None
    kv_transfer_params: dict | None = None
