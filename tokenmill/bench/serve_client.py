"""The benchmark's HTTP side: one streamed request to an OpenAI-compatible server, timed chunk by chunk.

Uses the official ``openai.AsyncOpenAI`` client (no retries) with ``stream=True`` and
``stream_options.include_usage``. Any exception (connection refused, an HTTP error status, a
broken stream) becomes a failed ``RequestResult`` with the error text; nothing here raises.
Token counts are left to the caller when the server sends no ``usage``.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Literal

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


def make_client(config: ClientConfig) -> Any:
    """An ``openai.AsyncOpenAI`` for ``config`` (no retries: a failure is a measurement)."""
    import openai

    api_key = config.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    return openai.AsyncOpenAI(base_url=config.api_base, api_key=api_key, max_retries=0, timeout=config.timeout_s)


async def discover_model(client: Any) -> str:
    """The first model id of ``GET /v1/models``. Raises whatever the client raises when the server is unreachable."""
    page = await client.models.list()
    models = [m.id for m in page.data]
    if not models:
        raise ValueError("model: the server lists no models; pass --model")
    return models[0]


def _chunk_text(chunk: Any, endpoint: Endpoint) -> tuple[str, str | None]:
    """(new content text, finish_reason) of one streamed chunk (usage-only chunks have no choices)."""
    if not chunk.choices:
        return "", None
    choice = chunk.choices[0]
    if endpoint == "chat":
        return choice.delta.content or "", choice.finish_reason
    return choice.text or "", choice.finish_reason


async def send_request(
    client: Any,
    config: ClientConfig,
    prompt: str | list[int] | list[dict[str, str]],
    max_tokens: int,
    run_start: float,
) -> Reply:
    """Send one streamed request and time it.

    ``prompt`` is the text or token ids (completions) or the message list (chat). TTFT is taken at the first
    chunk with content (or, when nothing decodes to text, at the chunk carrying the finish
    reason), each later content chunk adds one ITL gap, and E2EL ends when the stream closes. ``run_start`` is the ``time.perf_counter()`` the run's ``start_time`` values are relative to.
    """
    extra = {"ignore_eos": True} if config.ignore_eos else {}
    extra.update({k: v for k, v in (("top_k", config.top_k), ("min_p", config.min_p)) if v is not None})
    common = dict(model=config.model, max_tokens=max_tokens, temperature=config.temperature, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra or None)
    if config.top_p is not None:
        common["top_p"] = config.top_p
    start = time.perf_counter()
    reply = Reply(RequestResult(success=False, start_time=start - run_start))
    parts: list[str] = []
    last = start
    finish_time: float | None = None
    try:
        if config.endpoint == "chat":
            stream = await client.chat.completions.create(messages=prompt, **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            now = time.perf_counter()
            reply.chunks += 1
            if getattr(chunk, "usage", None) is not None:
                reply.usage_prompt_tokens = chunk.usage.prompt_tokens
                reply.usage_completion_tokens = chunk.usage.completion_tokens
            text, finish = _chunk_text(chunk, config.endpoint)
            if finish is not None and reply.finish_reason is None:
                reply.finish_reason, finish_time = finish, now
            if not text:
                continue
            if reply.result.ttft is None:
                reply.result.ttft = now - start
            else:
                reply.result.itls.append(now - last)
            last = now
            parts.append(text)
        reply.result.e2el = time.perf_counter() - start
        if reply.result.ttft is None and finish_time is not None:
            reply.result.ttft = finish_time - start  # tokens that decode to no text (e.g. EOS first) still arrived
        if reply.finish_reason == "abort":
            reply.result.error = "the server aborted the request"
        else:
            reply.result.success = True
    except Exception as exc:  # every failure is a measurement, never a crash
        reply.result.error = f"{type(exc).__name__}: {exc}"
    reply.text = "".join(parts)
    return reply
