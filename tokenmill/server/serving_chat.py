"""``POST /v1/chat/completions``: a conversation rendered with the model's chat template, answered
as OpenAI chat completions (streamed as ``chat.completion.chunk`` deltas or not).

Templating and tokenizing run in a worker thread, never on the event loop. A stream sends each
choice's last content in its own chunk, then a chunk with an empty ``delta`` and the finish reason.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.chat_prompt import ContentSpecialTokensError
from tokenmill.outputs import RequestOutput
from tokenmill.server.async_engine import EngineRequest, RequestStream
from tokenmill.server.errors import APIError
from tokenmill.server.openai_format import build_sampling_params, chat_logprobs, check_length, usage
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage
from tokenmill.server.state import ServerState, sse_stream


def render_chat(
    state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
    allow_special_tokens_in_content: bool | None = None,
) -> list[int]:
    """Prompt token ids of a conversation (the same ones ``LLM.chat`` would use). Blocking: run it
    in a worker thread. ``allow_special_tokens_in_content`` None takes the server's setting."""
    if allow_special_tokens_in_content is None:
        allow_special_tokens_in_content = state.config.allow_special_tokens_in_content
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return state.llm().apply_chat_template(conversation, add_generation_prompt, allow_special_tokens_in_content)
    except ContentSpecialTokensError as exc:
        raise APIError(str(exc), param=exc.param) from None
    except (ValueError, jinja2.TemplateError) as exc:
        raise APIError(f"messages could not be rendered with the chat template: {exc}", param="messages") from None


def _reject_unsupported(body: ChatCompletionRequest) -> None:
    """Structured output and tool calling are not implemented yet: refuse them rather than ignore them."""
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise APIError("response_format other than {'type': 'text'} is not supported yet", param="response_format")
    if body.tools or body.functions:
        field = "tools" if body.tools else "functions"
        raise APIError(f"{field}: tool calling is not supported yet", param=field)
    if body.tool_choice not in (None, "none", "auto"):
        raise APIError("tool_choice is not supported yet", param="tool_choice")


async def _engine_request(body: ChatCompletionRequest, state: ServerState, request_id: str) -> EngineRequest:
    use_completion_name = body.max_completion_tokens is not None
    max_tokens = body.max_completion_tokens if use_completion_name else body.max_tokens
    max_tokens_param = "max_completion_tokens" if use_completion_name else "max_tokens"
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    _reject_unsupported(body)
    params = build_sampling_params(
        body, vocab_size=state.vocab_size, max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        aliases={"logprobs": "top_logprobs", "max_tokens": max_tokens_param},
    )
    token_ids = await asyncio.to_thread(render_chat, state, body.messages, body.add_generation_prompt,
                                        body.allow_special_tokens_in_content)
    check_length(len(token_ids), max_tokens, state.max_model_len, "messages", max_tokens_param)
    return EngineRequest(request_id, token_ids, params, None, body.cache_salt)


async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request, state: ServerState):
    """Validate, queue, and answer (JSON or SSE) one chat completions request."""
    state.check_model(body.model)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    request = await _engine_request(body, state, response_id)
    stream = await state.submit([request], "messages")
    created = int(time.time())
    if body.stream:
        header = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": state.model_name}
        return StreamingResponse(sse_stream(_stream_events(body, state, stream, header), stream),
                                 media_type="text/event-stream")
    output = (await state.collect(stream, raw_request))[response_id]
    choices = await asyncio.to_thread(_choices, body, state, output)  # logprobs of long outputs take a while
    return JSONResponse({"id": response_id, "object": "chat.completion", "created": created,
                         "model": state.model_name, "choices": choices, "usage": usage([output])})


def _choices(body: ChatCompletionRequest, state: ServerState, output: RequestOutput) -> list[dict]:
    choices = []
    for completion in output.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(completion.token_ids, completion.logprobs or [], body.top_logprobs or 0,
                                     state.token_strings)
        choices.append({"index": completion.index, "message": {"role": "assistant", "content": completion.text},
                        "logprobs": logprobs, "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason})
    return choices


async def _stream_events(
    body: ChatCompletionRequest, state: ServerState, stream: RequestStream, header: dict
) -> AsyncIterator[dict]:
    for i in range(body.n):
        yield {**header, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}]}
    finished: set[int] = set()
    final = None
    async for output in stream:
        choices = []
        for completion in output.outputs:
            if completion.index in finished:
                continue
            text = completion.delta_text
            logprobs = None
            if body.logprobs and completion.delta_token_ids:
                logprobs = chat_logprobs(completion.delta_token_ids, completion.delta_logprobs or [],
                                         body.top_logprobs or 0, state.token_strings)
            if text or logprobs:
                choices.append({"index": completion.index, "delta": {"content": text} if text else {},
                                "logprobs": logprobs, "finish_reason": None, "stop_reason": None})
            if completion.finish_reason is not None:  # the finish reason comes alone, after the last content
                finished.add(completion.index)
                choices.append({"index": completion.index, "delta": {}, "logprobs": None,
                                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason})
        final = output
        for choice in choices:  # one choice per chunk, as OpenAI streams them
            yield {**header, "choices": [choice]}
    if body.include_usage and final is not None:
        yield {**header, "choices": [], "usage": usage([final])}
