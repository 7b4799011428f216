"""``POST /v1/chat/completions``: a conversation rendered with the model's chat template, answered
as OpenAI chat completions (streamed as ``chat.completion.chunk`` deltas or not).

Templating and tokenizing run in a worker thread, never on the event loop. A stream sends each
choice's last content in its own chunk, then a chunk with an empty ``delta`` and the finish reason.
Output constraints (``response_format``, ``structured_outputs``) are compiled before queueing. With
``tools``, ``tool_choice`` "required" or a named tool is forced by a constraint and "auto" (with
``--enable-auto-tool-choice``) parsed out of free text; Hermes ``<tool_call>`` blocks become
``message.tool_calls`` (streamed as tool-call deltas) and ``finish_reason`` "tool_calls", except for a
named tool choice, which finishes with "stop" as OpenAI's API does ("length" always stays "length").
``continue_final_message`` leaves the last assistant message open for the model to continue; ``echo``
puts that message's content in front of the answer (both vLLM's).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.chat_prompt import ChatPromptError
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.server.async_engine import EngineRequest, RequestStream
from tokenmill.server.errors import APIError
from tokenmill.server.kv_transfer_params import accept_kv_transfer_params
from tokenmill.server.openai_format import (
    build_sampling_params, build_structured_outputs, chat_logprobs, check_length, usage,
)
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage
from tokenmill.server.state import ServerState, sse_stream
from tokenmill.tool_calling import (
    HermesStreamParser, ToolCallingError, ToolRequest, conversation_for_template, extract_tool_calls, parse_tools,
    template_supports_tools, tool_constraint,
)


def render_chat(
    state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
    allow_special_tokens_in_content: bool | None = None, tool_request: ToolRequest | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """Prompt token ids of a conversation (the same ones ``LLM.chat`` would use). Blocking: run it
    in a worker thread. ``allow_special_tokens_in_content`` None takes the server's setting;
    ``continue_final_message`` as in ``ChatPromptRenderer.render`` (APIError naming it when misused). Tools
    (unless ``tool_choice`` is ``none``) are rendered by the chat template, or as a Hermes system
    block when the template has no tools section (``tokenmill.tool_calling.prompt``)."""
    if allow_special_tokens_in_content is None:
        allow_special_tokens_in_content = state.config.allow_special_tokens_in_content
    tools = tool_request.openai_tools() if tool_request is not None and tool_request.mode != "none" else None
    try:
        conversation, template_tools = conversation_for_template(
            [m.as_dict() for m in messages], tools, template_supports_tools(state.tokenizer.chat_template))
        return state.llm().apply_chat_template(conversation, add_generation_prompt, allow_special_tokens_in_content,
                                               tools=template_tools, continue_final_message=continue_final_message)
    except ToolCallingError as exc:
        raise APIError(str(exc), param=exc.param) from None
    except ChatPromptError as exc:
        raise APIError(str(exc), param=exc.param) from None
    except (ValueError, jinja2.TemplateError) as exc:
        raise APIError(f"messages could not be rendered with the chat template: {exc}", param="messages") from None


def _tool_request(body: ChatCompletionRequest, state: ServerState) -> ToolRequest | None:
    """The request's validated tools, or None without tools (APIError naming the field otherwise)."""
    if body.functions:
        raise APIError("functions is deprecated and not supported; send tools", param="functions")
    state.config.request_limits.check_tools(body.tools)
    try:
        tool_request = parse_tools(body.tools, body.tool_choice)
    except ToolCallingError as exc:
        raise APIError(str(exc), param=exc.param) from None
    if not tool_request.tools:
        return None
    if tool_request.mode == "auto" and not state.config.enable_auto_tool_choice:
        raise APIError('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                       "--tool-call-parser hermes; or send tool_choice \"required\", a named tool or \"none\"",
                       param="tool_choice")
    return tool_request


def _parses_tool_calls(tool_request: ToolRequest | None) -> bool:
    """Whether the output is scanned for Hermes tool calls."""
    return tool_request is not None and tool_request.mode != "none"


def _tool_finish_reason(finish_reason: str, tool_request: ToolRequest) -> str:
    """The finish reason of a choice that holds tool calls: "tool_calls" for "auto" and "required",
    "stop" for a named tool choice (as OpenAI answers, and vLLM since its fix); any other engine
    reason ("length") stays."""
    if finish_reason == "stop" and tool_request.mode != "named":
        return "tool_calls"
    return finish_reason


def _echo_text(body: ChatCompletionRequest) -> str:
    """What ``echo`` puts in front of every choice's content: the last message's content when it is
    the assistant's (vLLM's rule); empty otherwise."""
    last = body.messages[-1]
    return last.text() if body.echo and last.role == "assistant" else ""


async def _engine_request(
    body: ChatCompletionRequest, state: ServerState, request_id: str, lora_request: LoRARequest | None
) -> tuple[EngineRequest, ToolRequest | None]:
    use_completion_name = body.max_completion_tokens is not None
    max_tokens = body.max_completion_tokens if use_completion_name else body.max_tokens
    max_tokens_param = "max_completion_tokens" if use_completion_name else "max_tokens"
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    tool_request = _tool_request(body, state)
    constraint, constraint_param = build_structured_outputs(body)
    tool_calls = None if tool_request is None else tool_constraint(tool_request, body.parallel_tool_calls)
    if tool_calls is not None:
        if constraint is not None:
            raise APIError(f"tool_choice {tool_request.mode!r} forces tool calls; it cannot be combined with "
                           f"{constraint_param.split('.')[0]}", param="tool_choice")
        constraint, constraint_param = tool_calls, "tools"
    params = build_sampling_params(
        body, vocab_size=state.vocab_size, max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        aliases={"logprobs": "top_logprobs", "max_tokens": max_tokens_param}, structured_outputs=constraint,
        limits=state.config.request_limits,
    )
    state.config.request_limits.check_num_seqs(1, body.n)
    state.check_priority(body.priority)
    await asyncio.to_thread(state.check_constraint, constraint, constraint_param)
    token_ids = await asyncio.to_thread(render_chat, state, body.messages, body.add_generation_prompt,
                                        body.allow_special_tokens_in_content, tool_request,
                                        body.continue_final_message)
    check_length(len(token_ids), max_tokens, state.max_model_len, "messages", max_tokens_param)
    state.config.request_limits.check_num_tokens(
        [state.max_model_len - len(token_ids) if max_tokens is None else max_tokens], body.n, max_tokens_param)
    kv_transfer_params = accept_kv_transfer_params(state, body.kv_transfer_params)  # signed by the PD router only
    return (EngineRequest(request_id, token_ids, params, None, body.cache_salt, lora_request, kv_transfer_params,
                          body.priority),
            tool_request)


async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request, state: ServerState):
    """Validate, queue, and answer (JSON or SSE) one chat completions request."""
    state.check_queue()
    lora_request = state.check_model(body.model)
    model = body.model or state.model_name
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    request, tool_request = await _engine_request(body, state, response_id, lora_request)
    session_id = state.session_of(raw_request, body.user)
    if session_id is not None:
        request = dataclasses.replace(request, session_id=session_id)
    stream = await state.submit([request], "messages", raw_request)
    created = int(time.time())
    metadata = {"weight_version": stream.weight_version}  # SGLang's field: the weights that made it (docs/rl.md)
    if body.stream:
        header = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                  "metadata": metadata}
        return StreamingResponse(sse_stream(_stream_events(body, state, stream, header, tool_request,
                                                   request.prompt_token_ids), stream),
                                 media_type="text/event-stream")
    output = (await state.collect(stream, raw_request))[response_id]
    choices = await asyncio.to_thread(_choices, body, state, output, tool_request)  # long logprobs take a while
    body_json = {"id": response_id, "object": "chat.completion", "created": created, "model": model,
                 "choices": choices, "usage": usage([output]), "metadata": metadata}
    if body.return_token_ids:
        body_json["prompt_token_ids"] = output.prompt_token_ids
    if output.kv_transfer_params is not None:  # a KV producer's lease (vLLM's field)
        body_json["kv_transfer_params"] = output.kv_transfer_params
    return JSONResponse(body_json)


def _choices(
    body: ChatCompletionRequest, state: ServerState, output: RequestOutput, tool_request: ToolRequest | None
) -> list[dict]:
    choices = []
    echo = _echo_text(body)
    for completion in output.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(completion.token_ids, completion.logprobs or [], body.top_logprobs or 0,
                                     state.token_strings)
        message: dict = {"role": "assistant", "content": echo + completion.text}
        finish_reason = completion.finish_reason
        if _parses_tool_calls(tool_request):
            extracted = extract_tool_calls(completion.text)
            if extracted.tool_calls:
                content = extracted.content if not echo else echo + (extracted.content or "")
                message = {"role": "assistant", "content": content,
                           "tool_calls": [call.to_openai() for call in extracted.tool_calls]}
                finish_reason = _tool_finish_reason(finish_reason, tool_request)
        choice = {"index": completion.index, "message": message, "logprobs": logprobs,
                  "finish_reason": finish_reason, "stop_reason": completion.stop_reason}
        if body.return_token_ids:
            choice["token_ids"] = completion.token_ids
        choices.append(choice)
    return choices


async def _stream_events(
    body: ChatCompletionRequest, state: ServerState, stream: RequestStream, header: dict,
    tool_request: ToolRequest | None = None, prompt_token_ids: list[int] | None = None,
) -> AsyncIterator[dict]:
    parsers = {i: HermesStreamParser() for i in range(body.n)} if _parses_tool_calls(tool_request) else None
    prompt_ids = {"prompt_token_ids": prompt_token_ids} if body.return_token_ids else {}
    echo = _echo_text(body)
    for i in range(body.n):
        yield {**header, **prompt_ids, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]}
        if echo:  # the continued message's own text first, as vLLM streams it
            yield {**header, "choices": [{"index": i, "delta": {"content": echo}, "logprobs": None,
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
            finish_reason = completion.finish_reason
            if parsers is None:
                deltas = [{"content": text}] if text else []
            else:  # tool calls come as OpenAI tool-call deltas, the rest as content
                parser = parsers[completion.index]
                deltas = parser.feed(text) if text else []
                if finish_reason is not None:
                    deltas += parser.finish()
                    if parser.has_tool_calls:
                        finish_reason = _tool_finish_reason(finish_reason, tool_request)
            token_ids = completion.delta_token_ids if body.return_token_ids else None
            if (logprobs or token_ids) and not deltas:
                deltas = [{}]
            for delta in deltas:
                choice = {"index": completion.index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": None, "stop_reason": None}
                if token_ids is not None:  # the step's new tokens ride on its first delta
                    choice["token_ids"] = token_ids
                    token_ids = []
                choices.append(choice)
                logprobs = None
            if finish_reason is not None:  # the finish reason comes alone, after the last content
                finished.add(completion.index)
                choices.append({"index": completion.index, "delta": {}, "logprobs": None,
                                "finish_reason": finish_reason, "stop_reason": completion.stop_reason})
        final = output
        for choice in choices:  # one choice per chunk, as OpenAI streams them
            yield {**header, "choices": [choice]}
    if body.include_usage and final is not None:
        yield {**header, "choices": [], "usage": usage([final])}
