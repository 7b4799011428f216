"""Pydantic models of the HTTP request bodies (OpenAI completions/chat, tokenize, detokenize).

Only shape and type are checked here; value ranges are checked by ``SamplingParams`` and by
``openai_format.build_sampling_params`` so each error names its field once. Unknown fields are
ignored (clients send extras such as ``user``).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with usage and no choices."""

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions (OpenAI names plus vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, strings, token ids, or lists of token ids.

    ``max_tokens`` defaults to 16 as in OpenAI's API; ``logprobs`` is the number of top
    alternatives per position; ``echo`` prepends the prompt (and its log-probabilities).
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextContentPart(BaseModel):
    """One ``{"type": "text", "text": ...}`` part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One conversation turn. ``content`` may be a string or a list of text parts."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str | list[TextContentPart] | None = None

    def text(self) -> str:
        """The content as one string (text parts joined; None is empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` is the newer name of ``max_tokens``
    (it wins when both are set); unset means "up to max_model_len". ``logprobs`` is a switch and
    ``top_logprobs`` the number of alternatives.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    # Not supported yet; accepted only in their "off" form so clients get a clear 400 otherwise.
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: either ``prompt`` (text) or ``messages`` (rendered with the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
