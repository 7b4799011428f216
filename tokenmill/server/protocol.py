"""Pydantic models of the HTTP request bodies (OpenAI completions/chat, tokenize, detokenize).

Only shape and type are checked here; value ranges are checked by ``SamplingParams`` and by
``openai_format.build_sampling_params`` so each error names its field once. Types are strict, as
in OpenAI's API: ``"1"``, ``true`` or ``1.0`` for an integer, ``"yes"`` or ``1`` for a boolean are
refused (an integer is a valid number for a float field). Every string that can reach the
tokenizer or the chat template is ``Text``: valid Unicode, no lone surrogates. Unknown fields
are ignored (clients send extras such as ``user``).
"""
from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(value: str) -> str:
    """Refuse a string that is not valid Unicode (a lone UTF-16 surrogate, which JSON's ``\\uD800``
    escapes can produce): the tokenizer cannot encode it."""
    match = _LONE_SURROGATE.search(value)
    if match is not None:
        raise ValueError(f"text must be valid Unicode: lone surrogate U+{ord(match.group()):04X} "
                         f"at index {match.start()}")
    return value


Text = Annotated[str, AfterValidator(check_text)]
_STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with usage and no choices."""

    model_config = _STRICT

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is accepted; the schema is
    always enforced exactly)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: Text | None = None
    description: Text | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""

    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """``structured_outputs`` (vLLM's field): exactly one of ``json`` (a JSON schema), ``regex``,
    ``choice``, ``grammar`` (GBNF or Lark) or ``json_object``; checked in ``openai_format``."""

    model_config = _STRICT

    json_: dict | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions (OpenAI names plus vLLM's extras)."""

    model_config = _STRICT

    model: Text | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[Text, float] | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: Text | None = Field(default=None, max_length=1024)  # hashed into every block: bounded (issue 41)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids in the response
    disable_speculative_decoding: bool = False  # this request verifies no draft tokens (docs/spec_decode.md)
    kv_transfer_params: dict | None = None  # vLLM's: prefill/decode disaggregation (docs/pd_disaggregation.md)
    # vLLM's: under --scheduling-policy priority, lower runs first (docs/scheduling.md); 0 otherwise
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)
    # OpenAI's end-user id; with the X-Session-Id header (first) it names the agent session (--session-kv-ttl)
    user: Text | None = Field(default=None, max_length=256)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, strings, token ids, or lists of token ids.

    ``max_tokens`` defaults to 16 as in OpenAI's API; ``logprobs`` is the number of top
    alternatives per position; ``echo`` prepends the prompt (and its log-probabilities).
    """

    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: Text | None = None
    best_of: int | None = None


class TextContentPart(BaseModel):
    """One ``{"type": "text", "text": ...}`` part of a message's content."""

    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: Text


class ToolCallFunction(BaseModel):
    """``function`` of an assistant message's tool call: the name and the arguments as JSON text."""

    model_config = _STRICT

    name: Text
    arguments: Text


class MessageToolCall(BaseModel):
    """One entry of an assistant message's ``tool_calls``."""

    model_config = _STRICT

    id: Text | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One conversation turn. ``content`` may be a string or a list of text parts; an assistant
    turn may carry ``tool_calls`` and a ``tool`` turn answers one (``tool_call_id``)."""

    model_config = _STRICT

    role: Literal["system", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Text | None = None

    def text(self) -> str:
        """The content as one string (text parts joined; None is empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_dict(self) -> dict:
        """The turn as the chat template sees it (OpenAI shape; unset fields left out)."""
        message: dict = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` is the newer name of ``max_tokens``
    (it wins when both are set); unset means "up to max_model_len". ``logprobs`` is a switch and
    ``top_logprobs`` the number of alternatives. ``allow_special_tokens_in_content``: parse
    special-token strings in message contents into control tokens (None: the server's
    ``--allow-special-tokens-in-content`` setting; off, they are plain text).
    ``continue_final_message`` (vLLM's): the prompt ends inside the last message, an assistant
    one, and the model continues it (needs ``add_generation_prompt: false``); ``echo`` (vLLM's):
    the answer's content starts with that last assistant message's content.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    # OpenAI tools, validated by tokenmill.tool_calling.parse_tools (400s name the exact field);
    # the deprecated ``functions`` is refused.
    tools: list | None = None
    tool_choice: Text | dict | None = None
    parallel_tool_calls: bool = True
    functions: list | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    allow_special_tokens_in_content: bool | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: either ``prompt`` (text) or ``messages`` (rendered with the chat template,
    with ``add_generation_prompt``, ``continue_final_message`` and ``allow_special_tokens_in_content``
    as in chat completions)."""

    model_config = _STRICT

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    allow_special_tokens_in_content: bool | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text."""

    model_config = _STRICT

    model: Text | None = None
    tokens: list[int]
