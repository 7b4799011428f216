"""Translation between OpenAI request fields and tokenmill types: SamplingParams, length checks,
log-probabilities in the completions and chat formats, usage, and SSE framing.

Pure functions over the engine's outputs; never touches the engine.
"""
from __future__ import annotations

import json
import math

from tokenmill.outputs import Logprob, PositionLogprobs, RequestOutput
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server.errors import APIError, field_error
from tokenmill.server.protocol import SamplingRequest
from tokenmill.server.request_limits import RequestLimits
from tokenmill.token_strings import TokenString, TokenStrings

MAX_N = 128  # most sequences one request may ask for
MAX_STOP_STRINGS = RequestLimits.max_stop_strings  # the default of --max-stop-strings
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one bias
_NEG_INF_LOGPROB = -9999.0  # JSON has no -inf


def build_structured_outputs(request: SamplingRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field that holds it (for error messages), from
    ``response_format`` (``json_object`` / ``json_schema``) or ``structured_outputs``; (None, None)
    when unconstrained. Whether the constraint compiles is checked later (``ServerState.check_constraint``).

    Raises:
        APIError: both fields set, or ``structured_outputs`` not setting exactly one constraint.
    """
    response_format, structured = request.response_format, request.structured_outputs
    constrained_format = response_format is not None and response_format.type != "text"
    if constrained_format and structured is not None:
        raise APIError("send one output constraint: response_format or structured_outputs, not both",
                       param="structured_outputs")
    if structured is not None:
        fields = {name: value for name, value in (
            ("json", structured.json_), ("regex", structured.regex), ("choice", structured.choice),
            ("grammar", structured.grammar), ("json_object", structured.json_object),
        ) if value is not None and value is not False}
        if len(fields) != 1:
            raise APIError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                           f"got {sorted(fields) or 'none'}", param="structured_outputs")
        ((kind, value),) = fields.items()
        if kind == "choice" and not value:
            raise APIError("structured_outputs.choice must list at least one string", param="structured_outputs.choice")
        return StructuredOutputsParams(**{kind: value}), f"structured_outputs.{kind}"
    if not constrained_format:
        return None, None
    assert response_format is not None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise APIError("response_format.json_schema needs a schema (response_format of type json_schema)",
                       param="response_format.json_schema")
    return StructuredOutputsParams(json=response_format.json_schema.schema_), "response_format.json_schema.schema"


def build_sampling_params(
    request: SamplingRequest,
    *,
    vocab_size: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    aliases: dict[str, str] | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    limits: RequestLimits | None = None,
) -> SamplingParams:
    """SamplingParams for a request, or an APIError naming the request field at fault.

    ``aliases`` maps SamplingParams field names to the request's names (chat's
    ``top_logprobs`` is ``logprobs`` here). ``structured_outputs``: the output constraint
    (``build_structured_outputs``, or a tool-call constraint). ``limits``: the server's
    ``--max-stop-strings``, ``--max-stop-token-ids``, ``--max-logit-bias`` (None: the defaults).
    """
    limits = limits or RequestLimits()
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    limits.check_stop(stop, request.stop_token_ids)
    limits.check_logit_bias(request.logit_bias)
    if request.n > MAX_N:
        raise APIError(f"n must be <= {MAX_N}, got {request.n}", param="n")
    for token_id in request.stop_token_ids or ():
        if not 0 <= token_id < vocab_size:
            raise APIError(f"stop_token_ids must be in [0, {vocab_size}), got {token_id}", param="stop_token_ids")
    logit_bias = None
    if request.logit_bias:
        logit_bias = {}
        for key, bias in request.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise APIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
            if not 0 <= token_id < vocab_size:
                raise APIError(f"logit_bias token id must be in [0, {vocab_size}), got {token_id}", param="logit_bias")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise APIError(f"logit_bias values must be in [-100, 100], got {bias}", param="logit_bias")
            logit_bias[token_id] = bias
    try:
        return SamplingParams(
            n=request.n, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
            min_p=request.min_p, seed=request.seed, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
            logit_bias=logit_bias, max_tokens=max_tokens, min_tokens=request.min_tokens,
            ignore_eos=request.ignore_eos, stop=stop, stop_token_ids=request.stop_token_ids,
            include_stop_str_in_output=request.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=request.skip_special_tokens,
            structured_outputs=structured_outputs, disable_speculative_decoding=request.disable_speculative_decoding,
        )
    except ValueError as exc:
        raise field_error(str(exc), aliases) from None


def check_length(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, prompt_param: str, max_tokens_param: str
) -> None:
    """Reject prompts that cannot fit (with room for at least one token) and over-long max_tokens."""
    if num_prompt_tokens >= max_model_len:
        raise APIError(
            f"{prompt_param} is {num_prompt_tokens} tokens long, but this model's max_model_len is "
            f"{max_model_len} tokens, so at most {max_model_len - 1} prompt tokens fit",
            param=prompt_param, code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(
            f"{prompt_param} ({num_prompt_tokens} tokens) + {max_tokens_param} ({max_tokens}) = "
            f"{num_prompt_tokens + max_tokens} tokens exceeds this model's max_model_len of {max_model_len}",
            param=max_tokens_param, code="context_length_exceeded",
        )


def _logprob_value(logprob: Logprob) -> float:
    value = logprob.logprob
    return _NEG_INF_LOGPROB if math.isinf(value) or math.isnan(value) else value


class CompletionLogprobs:
    """Builds the completions ``logprobs`` object (tokens, token_logprobs, top_logprobs, text_offset).

    Positions are appended in order (prompt positions first when echoing); ``take()`` returns
    what was appended since the previous ``take()``, with ``text_offset`` continuing across calls.
    Tokens are shown as ``TokenStrings`` shows them (text, or a ``bytes:`` marker); a partial
    token's ``text_offset`` is where the character it belongs to starts.
    """

    def __init__(self, token_strings: TokenStrings) -> None:
        self._strings = token_strings
        self._offset = 0
        self._pending = b""  # bytes of partial tokens that do not form a whole character yet
        self._reset()

    def _reset(self) -> None:
        self._new: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def append(self, token_ids: list[int], entries: list[PositionLogprobs | None]) -> None:
        """Add positions: token ids and their engine log-probability entries (None: no context)."""
        for token_id, entry in zip(token_ids, entries):
            token = self._strings(token_id)
            self._new["tokens"].append(token.text)
            self._new["text_offset"].append(self._offset)
            self._advance(token)
            if entry is None:  # the first prompt token has no context
                self._new["token_logprobs"].append(None)
                self._new["top_logprobs"].append(None)
                continue
            self._new["token_logprobs"].append(_logprob_value(entry[token_id]))
            self._new["top_logprobs"].append({self._strings.text(tid): _logprob_value(lp) for tid, lp in entry.items()})

    def _advance(self, token: TokenString) -> None:
        """Move ``text_offset`` past a token: by its text, or once its bytes complete a character."""
        if not token.is_partial and not self._pending:
            self._offset += len(token.text)
            return
        self._pending += token.raw_bytes if token.raw_bytes is not None else token.text.encode("utf-8")
        try:
            text = self._pending.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.reason == "unexpected end of data":
                return  # the next token may complete the character
            text = self._pending.decode("utf-8", errors="replace")
        self._offset += len(text)
        self._pending = b""

    def take(self) -> dict:
        """The logprobs object of the positions appended since the last take()."""
        new = self._new
        self._reset()
        return new


def chat_logprobs(
    token_ids: list[int], entries: list[PositionLogprobs], top_logprobs: int, token_strings: TokenStrings
) -> dict:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}, ...]}``.

    ``token`` is the text, or a ``bytes:`` marker for a token that is not valid UTF-8 alone;
    ``bytes`` is the token's raw bytes either way.
    """

    def item(token_id: int, logprob: Logprob) -> dict:
        token = token_strings(token_id)
        raw = None if token.raw_bytes is None else list(token.raw_bytes)
        return {"token": token.text, "logprob": _logprob_value(logprob), "bytes": raw}

    content = []
    for token_id, entry in zip(token_ids, entries):
        top = sorted(((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= top_logprobs),
                     key=lambda pair: pair[1].rank)
        content.append({**item(token_id, entry[token_id]), "top_logprobs": [item(t, lp) for t, lp in top]})
    return {"content": content}


def usage(outputs: list[RequestOutput]) -> dict:
    """OpenAI usage over the finished outputs of one HTTP request (one per prompt)."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)},
    }


def sse(payload: dict) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
