"""``POST /v1/completions``: prompts (text or token ids, one or many) to OpenAI text completions.

Choice ``index`` is ``prompt_index * n + sequence_index``. With ``echo`` the prompt text (and,
with ``logprobs``, the prompt tokens' log-probabilities, the first one null) comes first.
Tokenizing runs in a worker thread, never on the event loop. A stream sends each choice's last
text in its own chunk, then a chunk with empty text and the finish reason.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.server.async_engine import EngineRequest, RequestStream
from tokenmill.server.errors import APIError
from tokenmill.server.kv_transfer_params import accept_kv_transfer_params
from tokenmill.server.openai_format import (
    CompletionLogprobs, build_sampling_params, build_structured_outputs, check_length, usage,
)
from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.state import ServerState, sse_stream


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def _engine_requests(
    body: CompletionRequest, state: ServerState, response_id: str, lora_request: LoRARequest | None
) -> list[EngineRequest]:
    """Validate and tokenize every prompt (blocking: run it in a worker thread)."""
    if body.suffix is not None:
        raise APIError("suffix is not supported (no fill-in-the-middle); leave it unset", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(f"best_of is not supported (got {body.best_of}); use n", param="best_of")
    constraint, constraint_param = build_structured_outputs(body)
    params = build_sampling_params(
        body, vocab_size=state.vocab_size, max_tokens=body.max_tokens, logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if body.echo else None, structured_outputs=constraint,
        limits=state.config.request_limits,
    )
    prompts = _prompt_list(body.prompt)
    state.config.request_limits.check_num_seqs(len(prompts), body.n)  # before any work per prompt
    state.check_priority(body.priority)
    state.check_constraint(constraint, constraint_param)
    if not prompts:
        raise APIError("prompt must not be empty", param="prompt")
    engine = state.llm().engine
    if body.kv_transfer_params is not None and len(prompts) > 1:
        raise APIError("kv_transfer_params needs a single prompt", param="kv_transfer_params")
    kv_transfer_params = accept_kv_transfer_params(state, body.kv_transfer_params)  # signed by the PD router only
    requests = []
    for i, prompt in enumerate(prompts):
        try:
            text, token_ids = engine.tokenize_prompt(prompt)
        except ValueError as exc:
            raise APIError(f"{exc}" if len(prompts) == 1 else f"prompt {i}: {exc}", param="prompt") from None
        check_length(len(token_ids), body.max_tokens, engine.max_model_len, "prompt", "max_tokens")
        if text is None and body.echo:
            text = state.decode(token_ids)
        request_id = response_id if len(prompts) == 1 else f"{response_id}-{i}"
        requests.append(EngineRequest(request_id, token_ids, params, text, body.cache_salt, lora_request,
                                      kv_transfer_params, body.priority))
    state.config.request_limits.check_num_tokens(
        [engine.max_model_len - len(r.prompt_token_ids) if body.max_tokens is None else body.max_tokens
         for r in requests], body.n, "max_tokens")
    return requests


async def create_completion(body: CompletionRequest, raw_request: Request, state: ServerState):
    """Validate, queue, and answer (JSON or SSE) one completions request."""
    state.check_queue()
    lora_request = state.check_model(body.model)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    requests = await asyncio.to_thread(_engine_requests, body, state, response_id, lora_request)
    session_id = state.session_of(raw_request, body.user)
    if session_id is not None:
        requests = [dataclasses.replace(r, session_id=session_id) for r in requests]
    stream = await state.submit(requests, "prompt", raw_request)
    header = {"id": response_id, "object": "text_completion", "created": int(time.time()),
              "model": body.model or state.model_name,
              "metadata": {"weight_version": stream.weight_version}}  # SGLang's field (docs/rl.md); every chunk
    if body.stream:
        events = _stream_events(body, state, requests, stream, header)
        return StreamingResponse(sse_stream(events, stream), media_type="text/event-stream")
    finals = await state.collect(stream, raw_request)
    choices = await asyncio.to_thread(_choices, body, state, requests, finals)  # long logprobs take a while
    response = {**header, "choices": choices, "usage": usage([finals[r.request_id] for r in requests])}
    if finals[requests[0].request_id].kv_transfer_params is not None:  # a KV producer's lease (vLLM's field)
        response["kv_transfer_params"] = finals[requests[0].request_id].kv_transfer_params
    return JSONResponse(response)


def _choices(
    body: CompletionRequest, state: ServerState, requests: list[EngineRequest], finals: dict[str, RequestOutput]
) -> list[dict]:
    choices = []
    for i, request in enumerate(requests):
        output = finals[request.request_id]
        for completion in output.outputs:
            text = completion.text
            logprobs = None
            if body.logprobs is not None:
                builder = CompletionLogprobs(state.token_strings)
                if body.echo:
                    builder.append(output.prompt_token_ids, output.prompt_logprobs or [])
                builder.append(completion.token_ids, completion.logprobs or [])
                logprobs = builder.take()
            if body.echo:
                text = request.prompt + text
            choice = {"index": i * body.n + completion.index, "text": text, "logprobs": logprobs,
                      "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
            if body.return_token_ids:
                choice.update(prompt_token_ids=output.prompt_token_ids, token_ids=completion.token_ids)
            choices.append(choice)
    return choices


async def _stream_events(
    body: CompletionRequest, state: ServerState, requests: list[EngineRequest], stream: RequestStream, header: dict
) -> AsyncIterator[dict]:
    prompt_index = {r.request_id: i for i, r in enumerate(requests)}
    builders: dict[tuple[int, int], CompletionLogprobs] = {}
    started: set[tuple[int, int]] = set()
    finished: set[tuple[int, int]] = set()
    finals: dict[str, RequestOutput] = {}
    async for output in stream:
        p = prompt_index[output.request_id]
        choices = []
        for completion in output.outputs:
            key = (p, completion.index)
            if key in finished:
                continue
            echo_now = body.echo and key not in started
            text = (requests[p].prompt + completion.delta_text) if echo_now else completion.delta_text
            logprobs = None
            if body.logprobs is not None:
                builder = builders.setdefault(key, CompletionLogprobs(state.token_strings))
                if echo_now:
                    builder.append(output.prompt_token_ids, output.prompt_logprobs or [])
                builder.append(completion.delta_token_ids, completion.delta_logprobs or [])
                logprobs = builder.take()
                if not logprobs["tokens"]:
                    logprobs = None
            index = p * body.n + completion.index
            if text or logprobs or (body.return_token_ids and completion.delta_token_ids):
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None,
                          "stop_reason": None}
                if body.return_token_ids:  # the prompt in a choice's first chunk, then each chunk's new tokens
                    if key not in started:
                        choice["prompt_token_ids"] = output.prompt_token_ids
                    choice["token_ids"] = completion.delta_token_ids
                started.add(key)
                choices.append(choice)
            if completion.finish_reason is not None:  # the finish reason comes alone, after the last text
                started.add(key)
                finished.add(key)
                choices.append({"index": index, "text": "", "logprobs": None,
                                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason})
        if output.finished:
            finals[output.request_id] = output
        for choice in choices:  # one choice per chunk, as OpenAI streams them
            yield {**header, "choices": [choice]}
    if body.include_usage:
        yield {**header, "choices": [], "usage": usage([finals[r.request_id] for r in requests])}
