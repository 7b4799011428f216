"""The benchmark's HTTP side: one streamed request to an OpenAI-compatible server, timed chunk by chunk.

Requests go out through one ``aiohttp`` session per client (no retries) with ``stream=True`` and
``stream_options.include_usage``, and the server-sent events are parsed by hand into plain dicts.
The client usually shares the CPU with the server under test, so every microsecond it spends per
streamed chunk is taken from the thing being measured. The official ``openai`` client (httpx plus
pydantic objects per chunk) cost several times more: on a local SSE server, about 120 us of client
CPU per chunk arriving one at a time (70 us in bursts) against about 45 us (6 us) here.

Any exception (connection refused, a timeout, an HTTP error status, a broken stream, an ``error``
event in the stream) becomes a failed ``RequestResult`` with the error text; nothing here raises.
Token counts are left to the caller when the server sends no ``usage``.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from tokenmill.bench.metrics import RequestResult

Endpoint = Literal["completions", "chat"]


@dataclass(frozen=True)
class ClientConfig:
    """Where and how requests are sent.

    Args:
        base_url: server root, with or without the ``/v1`` suffix.
        model: served model name (None: let the server pick; see ``discover_model``).
        endpoint: ``completions`` (/v1/completions, text prompt) or ``chat`` (/v1/chat/completions).
        temperature: sampling temperature sent with every request (0: greedy).
        top_p, top_k, min_p: sent with every request when set (vLLM's ``bench serve`` flags; top_k and
            min_p as extra fields); None: the server's default.
        ignore_eos: ask the server to generate exactly max_tokens (vLLM/tokenmill extra field).
        send_token_ids: completions only: send each prompt as its token ids (the workload's own
            tokenization) instead of its text, so servers with different tokenizer code get the same tokens.
        api_key: bearer key (default: $OPENAI_API_KEY, else a dummy).
        timeout_s: per-request timeout.
    """

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: Endpoint = "completions"
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    send_token_ids: bool = False
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def api_base(self) -> str:
        """``base_url`` ending in ``/v1``."""
        url = self.base_url.rstrip("/")
        return url if url.endswith("/v1") else f"{url}/v1"


@dataclass
class Reply:
    """One request's measurement plus what is needed to count tokens afterwards.

    ``usage_prompt_tokens``/``usage_completion_tokens`` are the server's counts (None when it sent
    no usage); ``text`` is the generated text (the assistant turn appended in multi-turn runs).
    """

    result: RequestResult
    text: str = ""
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    finish_reason: str | None = None
    chunks: int = 0


class BenchClient:
    """The HTTP side of one benchmark target, shared by all its concurrent ``send_request`` calls.

    Holds the bearer key and, once first used, an ``aiohttp.ClientSession``: a session belongs to the
    event loop it was made in, so it is made lazily inside the running loop (and made again if a later
    ``asyncio.run`` uses the client). No connection limit: how many requests are in flight is the load
    generator's decision. Each request opens its own connection (``force_close``), as a client with a
    session per request does: a kept-alive connection that the server has closed meanwhile
    (llama-server's HTTP library closes one after 5 requests or 5 idle seconds) failed the next request
    sent on it with "Server disconnected" (19 of 200 ShareGPT requests). Proxy variables are ignored (a
    proxy in the path would be measured too).
    Close it with ``await client.close()`` or use it as ``async with make_client(config) as client``.
    """

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        api_key = config.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def session(self) -> aiohttp.ClientSession:
        """The open session of the running event loop, made on first use.

        Raises:
            RuntimeError: called outside a running event loop.
        """
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True), headers=self.headers, trust_env=False,
                timeout=aiohttp.ClientTimeout(total=self.config.timeout_s))
            self._loop = loop
        return self._session

    async def close(self) -> None:
        """Close the session and its connections (nothing to do when none was made or it is closed)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> BenchClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def make_client(config: ClientConfig) -> BenchClient:
    """A ``BenchClient`` for ``config``'s server (no retries: a failure is a measurement). Cheap; opens nothing
    until its first request, so it may be made outside an event loop but must be used inside one."""
    return BenchClient(config)


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message": ...}}``, or vLLM's older top-level
    ``message``), else the body's text (at most 500 characters)."""
    text = body.decode("utf-8", "replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str) and error:
            return error
        if parsed.get("message"):
            return str(parsed["message"])
    return text[:500]


async def _http_error(response: aiohttp.ClientResponse) -> str:
    """``HTTP <status> <reason>: <server's message>`` for a non-2xx response (reads its body)."""
    return f"HTTP {response.status} {response.reason}: {_error_message(await response.read())}"


async def discover_model(client: BenchClient) -> str:
    """The first model id of ``GET /v1/models``.

    Raises:
        aiohttp.ClientError, TimeoutError: the server is unreachable or too slow (``timeout_s``).
        RuntimeError: a non-2xx status (the message names it and carries the server's error text).
        ValueError: the server lists no models.
    """
    async with client.session().get(f"{client.config.api_base}/models", allow_redirects=False) as response:
        if response.status // 100 != 2:
            raise RuntimeError(await _http_error(response))
        page = json.loads(await response.read())
    models = [m["id"] for m in page.get("data") or []]
    if not models:
        raise ValueError("model: the server lists no models; pass --model")
    return models[0]


def request_body(config: ClientConfig, prompt: str | list[int] | list[dict[str, str]], max_tokens: int) -> dict:
    """The JSON body of one streamed request: ``messages`` (chat) or ``prompt`` (completions, text or token ids),
    ``max_tokens``, ``temperature``, ``stream`` with usage, ``top_p`` when set, and the vLLM extra fields
    ``ignore_eos``/``top_k``/``min_p`` when set."""
    body: dict[str, Any] = {"model": config.model, "messages" if config.endpoint == "chat" else "prompt": prompt,
                            "max_tokens": max_tokens, "temperature": config.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if config.top_p is not None:
        body["top_p"] = config.top_p
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.top_k is not None:
        body["top_k"] = config.top_k
    if config.min_p is not None:
        body["min_p"] = config.min_p
    return body


async def _sse_data(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of a server-sent-event stream as they arrive, whitespace stripped; blank lines,
    comments and other fields are skipped. A last line without its newline still counts."""
    pending = b""
    async for received in content.iter_any():
        lines = (pending + received if pending else received).split(b"\n")
        pending = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if pending.startswith(b"data:"):
        yield pending[5:].strip()


async def send_request(
    client: BenchClient,
    config: ClientConfig,
    prompt: str | list[int] | list[dict[str, str]],
    max_tokens: int,
    run_start: float,
) -> Reply:
    """Send one streamed request to ``config``'s endpoint and time it; never raises (but lets cancellation through).

    ``prompt`` is the text or token ids (completions) or the message list (chat). TTFT is taken at the first
    chunk with content (or, when nothing decodes to text, at the chunk carrying the finish reason), each later
    content chunk adds one ITL gap, and E2EL ends when the stream closes (after ``[DONE]``); all in seconds.
    ``run_start`` is the ``time.perf_counter()`` the run's ``start_time`` values are relative to. A failure
    (connection error, ``timeout_s`` exceeded for the whole request, non-2xx status with the server's message,
    an ``error`` event in the stream, a malformed chunk, finish reason ``abort``) is a ``Reply`` whose
    ``result.success`` is False and whose ``result.error`` says why.
    """
    url = f"{config.api_base}/chat/completions" if config.endpoint == "chat" else f"{config.api_base}/completions"
    chat = config.endpoint == "chat"
    body = request_body(config, prompt, max_tokens)
    start = time.perf_counter()
    result = RequestResult(success=False, start_time=start - run_start)
    reply = Reply(result)
    parts: list[str] = []
    last = start
    finish_time: float | None = None
    try:
        async with client.session().post(url, json=body, allow_redirects=False,
                                         timeout=aiohttp.ClientTimeout(total=config.timeout_s)) as response:
            if response.status // 100 != 2:
                result.error = await _http_error(response)
            else:
                done = False
                async for data in _sse_data(response.content):
                    if done:  # read on to the stream's end, so the connection can be reused
                        continue
                    if data == b"[DONE]":
                        done = True
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    reply.chunks += 1
                    error = chunk.get("error")
                    if error:  # a server that fails mid-stream sends an error event
                        message = error.get("message") if isinstance(error, dict) else None
                        result.error = f"stream error: {message or error}"
                        break
                    usage = chunk.get("usage")
                    if usage:
                        reply.usage_prompt_tokens = usage.get("prompt_tokens")
                        reply.usage_completion_tokens = usage.get("completion_tokens")
                    choices = chunk.get("choices")
                    if not choices:  # the usage-only chunk
                        continue
                    choice = choices[0]
                    finish = choice.get("finish_reason")
                    if finish is not None and reply.finish_reason is None:
                        reply.finish_reason, finish_time = finish, now
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if not text:
                        continue
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                    parts.append(text)
                if not result.error:
                    result.e2el = time.perf_counter() - start
                    if result.ttft is None and finish_time is not None:
                        result.ttft = finish_time - start  # tokens decoding to no text (e.g. EOS first) arrived
                    if reply.finish_reason == "abort":
                        result.error = "the server aborted the request"
                    else:
                        result.success = True
    except TimeoutError:  # aiohttp's timeouts carry no text
        result.error = f"TimeoutError: no complete reply within timeout_s={config.timeout_s:g} s"
    except Exception as exc:  # every failure is a measurement, never a crash
        result.error = f"{type(exc).__name__}: {exc}"
    reply.text = "".join(parts)
    return reply
