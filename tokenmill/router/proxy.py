"""Forwarding one request to a worker: pick, send, retry before the first token, resume after it.

Requests and streams travel over one shared ``aiohttp.ClientSession`` (the data plane: its C HTTP
parser costs about a third of httpx's per request, which is most of what the router adds to TTFT);
health checks and other control calls keep the ``httpx`` client. ``Proxy.forward`` runs attempts until one worker
gives a usable answer: the policy picks among the healthy workers not tried yet, a ``Lease`` holds the
request's tokens on the worker, and a connection error, a 5xx, or a stream that breaks before its first
token (a chat stream's role chunk is held back until then) sends the request to the next worker: the
client has received nothing yet (``tokenmill_router:retries_total``). Streams are copied event by event
(``ClientStream``), never buffered. A tokenmill worker is asked for ``return_token_ids``; if its stream
breaks after tokens were sent, each unfinished choice is resumed on another healthy tokenmill worker as
a ``/v1/completions`` request for prompt + tokens so far, translated back into the client's format
(``tokenmill_router:resumptions_total``; exact for greedy and seeded sampling, see docs/router.md).
A client that disconnects closes the upstream response, so the worker aborts the request.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, NoReturn

import aiohttp
import httpx2 as httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policies import request_tokens
from tokenmill.router.policy import Policy, RouteRequest
from tokenmill.router.workers import HEALTH_TIMEOUT_S, Lease, Worker, WorkerRegistry

logger = logging.getLogger(__name__)

WORKER_HEADER = "x-router-worker-id"  # which worker served the response (debugging, tests)
UNHEALTHY_STATUSES = (502, 503, 504)  # the worker (or its engine) is down, not the request at fault
TOKEN_ID_FIELDS = ("prompt_token_ids", "token_ids")  # what the router adds to tokenmill streams
# Sampling fields a resumed choice keeps (n, seed, max_tokens, min_tokens and echo are set per choice).
RESUME_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos", "include_stop_str_in_output",
                 "skip_special_tokens", "cache_salt", "response_format", "structured_outputs")
RESUME_SEARCH = 8  # cut points tried below the last token before falling back to regenerating all of it
REPLACEMENT_CHAR = "\ufffd"


def openai_error(message: str, status_code: int, type: str, param: str | None = None,
                 code: str | int | None = None) -> JSONResponse:
    """A JSONResponse with an OpenAI error body."""
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}}, status_code)


def sse_error(message: str) -> bytes:
    error = {"error": {"message": message, "type": "service_unavailable_error", "param": None, "code": 503}}
    return f"data: {json.dumps(error)}\n\n".encode()


class _Reply:
    """The client's connection while a streamed request is attempted: its ASGI ``send``, and whether
    the response start (status 200 and headers) already went out on it."""

    __slots__ = ("send", "head_sent")

    def __init__(self, send: Send) -> None:
        self.send, self.head_sent = send, False

    async def send_head(self, headers: dict[str, str]) -> None:
        self.head_sent = True
        await self.send({"type": "http.response.start", "status": 200,
                         "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]})


class _ErrorAfterHead:
    """The end of a stream whose head went out before every worker failed: the error response's
    OpenAI error body as one SSE event, as for a stream that breaks mid-way."""

    def __init__(self, response: Response) -> None:
        self.response = response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            error = json.loads(self.response.body).get("error")
        except (ValueError, AttributeError):
            error = None
        if not isinstance(error, dict):
            error = {"message": f"the request failed with status {self.response.status_code}",
                     "type": "service_unavailable_error", "param": None}
        if error.get("code") is None:  # the status the client would have got, as mid-stream errors carry it
            error = {**error, "code": self.response.status_code}
        await send({"type": "http.response.body", "body": f"data: {json.dumps({'error': error})}\n\n".encode(),
                    "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Retry(Exception):
    """This attempt failed before anything reached the client; try another worker."""

    def __init__(self, reason: str, detail: str, response: Response | None = None) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.response = reason, detail, response


# What a broken worker connection raises on the data plane (connect, send, or read).
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
# Idle upstream connections are dropped after this long, before a worker's own keep-alive timeout
# (uvicorn's default: 5 s) closes them under a request that was just sent on one.
UPSTREAM_KEEPALIVE_S = 4.0


@dataclass(frozen=True)
class PromptIds:
    """A completions prompt the router already tokenized (``kv_aware``), sent to the workers that share
    the router's tokenizer as token ids in place of the text, so the worker does not tokenize it again
    (the tokenize-once-at-the-front design of Dynamo's frontend). Only for a single text prompt without
    ``echo`` (whose reply quotes the text): the worker's reply is then the same either way.

    token_ids: the prompt as the worker would tokenize it; accepts(worker): whether that worker's
    tokenizer is the router's (a tokenmill worker serving the model the router tokenized with).
    """

    token_ids: tuple[int, ...]
    accepts: Callable[[Worker], bool]


def upstream_session(request_timeout: float, connect_timeout: float = 10.0) -> aiohttp.ClientSession:
    """The data-plane client: no connection limit, bytes passed through undecoded, ``request_timeout``
    (seconds) as the longest wait for a worker's headers or next chunk. Create it inside the event
    loop that uses it."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=request_timeout),
        auto_decompress=False, skip_auto_headers=("User-Agent",))


def _close(response: aiohttp.ClientResponse) -> None:
    """Done with an upstream response: its connection goes back to the pool when the body was read to
    the end, else it is closed (the worker sees the disconnect and aborts the request)."""
    if response.content.at_eof():
        response.release()
    else:
        response.close()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# ---- server-sent events ---------------------------------------------------------------------------
@dataclass
class SSEEvent:
    """One event of a stream: its bytes as received, and its ``data`` parsed (``obj``) when JSON."""

    raw: bytes
    done: bool = False  # data: [DONE]
    obj: dict | None = None

    def carries_token(self) -> bool:
        """Whether the client learns of generated output from it: text, token ids, a finish reason, an
        error, usage or the end. A chat stream's role chunk (empty content, no token ids) does not."""
        if self.done or self.obj is None:
            return self.done
        if "error" in self.obj or self.obj.get("usage"):
            return True
        for choice in _choices(self.obj):
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            if (choice.get("text") or choice.get("token_ids") or choice.get("finish_reason") is not None
                    or delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")):
                return True
        return False


class SSEReader:
    """Splits a worker's raw bytes into events (blank-line separated); ``next`` is None at the end."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.content = response.content
        self.buffer = b""
        self.ended = False

    async def next(self) -> SSEEvent | None:
        """The next event, None at the end of the stream; raises ``UPSTREAM_ERRORS`` if it broke."""
        while b"\n\n" not in self.buffer:
            if self.ended:
                return None
            chunk = await self.content.readany()
            if not chunk:
                self.ended = True
                return None  # a trailing partial event is the mark of a broken stream: dropped
            self.buffer = (self.buffer + chunk).replace(b"\r\n", b"\n")
        raw, self.buffer = self.buffer.split(b"\n\n", 1)
        data = [line[5:].lstrip() for line in raw.split(b"\n") if line.startswith(b"data:")]
        event = SSEEvent(raw + b"\n\n")
        if data:
            text = b"\n".join(data)
            if text.strip() == b"[DONE]":
                event.done = True
            else:
                try:
                    obj = json.loads(text)
                except ValueError:
                    obj = None
                event.obj = obj if isinstance(obj, dict) else None
        return event


def _choices(obj: dict) -> list[dict]:
    """The well-formed choices of a chunk (a foreign worker's odd ones are passed on, not read)."""
    choices = obj.get("choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def _empty(choice: dict) -> bool:
    """A stream choice that tells the client nothing (no text, delta, logprobs or finish reason)."""
    return (not choice.get("text") and not choice.get("delta") and choice.get("logprobs") is None
            and choice.get("finish_reason") is None)


def encode_event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


# ---- what a stream has delivered so far -----------------------------------------------------------
@dataclass
class ChoiceState:
    """One choice of a stream: its prompt and generated token ids, the text the client got, its end."""

    index: int
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finished: bool = False


class StreamState:
    """What the client was sent of one streamed request (kind ``completions`` or ``chat``)."""

    def __init__(self, kind: str, body: dict) -> None:
        self.kind, self.body = kind, body
        self.n = body.get("n") or 1
        self.wants_token_ids = body.get("return_token_ids") is True
        options = body.get("stream_options")  # the worker checks its type; the router only reads it
        self.wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self.deterministic = body.get("temperature") == 0 or body.get("seed") is not None
        self.choices: dict[int, ChoiceState] = {}
        self.header: dict = {}  # id, object, created, model of the client's stream
        self.chat_prompt_token_ids: list[int] | None = None
        self.done = False  # [DONE] sent
        self.usage_sent = False
        self.has_token_ids = False  # the worker answered with token ids (a tokenmill worker)

    def choice(self, index: int) -> ChoiceState:
        if index not in self.choices:
            self.choices[index] = ChoiceState(index)
        return self.choices[index]

    def observe(self, event: SSEEvent) -> bytes:
        """Record an event of the original worker; returns the bytes to send the client (token-id
        fields the client did not ask for are removed)."""
        if event.done:
            self.done = True
            return event.raw
        obj = event.obj
        if obj is None:
            return event.raw
        if not self.header and "id" in obj:
            self.header = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        if obj.get("usage"):
            self.usage_sent = True
        changed = False
        if "prompt_token_ids" in obj:  # chat: the prompt rides on the first chunk
            self.chat_prompt_token_ids = obj["prompt_token_ids"]
            self.has_token_ids = True
            if not self.wants_token_ids:
                obj = {k: v for k, v in obj.items() if k != "prompt_token_ids"}
                changed = True
        choices = _choices(obj)
        for i, choice in enumerate(choices):
            state = self.choice(choice.get("index", 0))
            if "prompt_token_ids" in choice:
                state.prompt_token_ids = choice["prompt_token_ids"]
            if "token_ids" in choice:
                state.token_ids.extend(choice["token_ids"] or ())
                self.has_token_ids = True
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            text = choice.get("text") if self.kind == "completions" else delta.get("content")
            if isinstance(text, str) and text:
                state.text.append(text)
            if choice.get("finish_reason") is not None:
                state.finished = True
            if not self.wants_token_ids and any(k in choice for k in TOKEN_ID_FIELDS):
                stripped = {k: v for k, v in choice.items() if k not in TOKEN_ID_FIELDS}
                choices[i] = None if _empty(stripped) else stripped  # it only carried token ids
                changed = True
        if not changed:
            return event.raw
        choices = [c for c in choices if c is not None]
        if not choices and obj.get("choices") and not obj.get("usage"):
            return b""
        return encode_event({**obj, "choices": choices})

    def prompt_of(self, state: ChoiceState) -> list[int] | str | None:
        """The prompt to resume ``state`` from: token ids when known, else the original prompt."""
        if self.kind == "chat":
            return self.chat_prompt_token_ids
        if state.prompt_token_ids is not None:
            return state.prompt_token_ids
        p = state.index // self.n
        for other in self.choices.values():
            if other.index // self.n == p and other.prompt_token_ids is not None:
                return other.prompt_token_ids
        prompt = self.body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return prompt[p] if p < len(prompt) else None
        return prompt

    def resume_body(self, state: ChoiceState, prompt: list[int] | str, cut: int) -> dict:
        """The ``/v1/completions`` body that continues ``state`` after its first ``cut`` tokens."""
        body = {k: self.body[k] for k in RESUME_FIELDS if k in self.body}
        budget = self.body.get("max_completion_tokens") if self.kind == "chat" else None
        if budget is None:
            budget = self.body.get("max_tokens", 16 if self.kind == "completions" else None)
        seed = self.body.get("seed")
        ids = prompt if isinstance(prompt, str) else list(prompt) + state.token_ids[:cut]
        body.update(prompt=ids, n=1, stream=True, return_token_ids=True, echo=False,
                    max_tokens=None if budget is None else max(budget - cut, 0),
                    min_tokens=max((self.body.get("min_tokens") or 0) - cut, 0))
        if seed is not None:
            body["seed"] = seed + state.index % self.n  # the engine's seed for choice j of a prompt
        if self.kind == "completions" and self.body.get("logprobs") is not None:
            body["logprobs"] = self.body["logprobs"]
        return body

    def translate(self, obj: dict, state: ChoiceState, skip: list[int]) -> bytes | None:
        """A chunk of a resume request as a chunk of the client's stream, or None if it carries nothing
        new. ``skip``: [characters, token ids] regenerated before the cut that the client already has."""
        out = []
        for choice in obj.get("choices") or ():
            text = choice.get("text") or ""
            if skip[0]:
                cut, skip[0] = min(skip[0], len(text)), skip[0] - min(skip[0], len(text))
                text = text[cut:]
            token_ids = list(choice.get("token_ids") or ())
            if skip[1]:
                cut, skip[1] = min(skip[1], len(token_ids)), skip[1] - min(skip[1], len(token_ids))
                token_ids = token_ids[cut:]
            finish = choice.get("finish_reason")
            state.token_ids.extend(token_ids)
            if text:
                state.text.append(text)
            if finish is not None:
                state.finished = True
            if not text and not finish and not (token_ids and self.wants_token_ids):
                continue
            if self.kind == "chat":
                new = {"index": state.index, "delta": {"content": text} if text else {}, "logprobs": None,
                       "finish_reason": finish, "stop_reason": choice.get("stop_reason")}
            else:
                new = {"index": state.index, "text": text, "logprobs": choice.get("logprobs"),
                       "finish_reason": finish, "stop_reason": choice.get("stop_reason")}
            if self.wants_token_ids and "token_ids" in choice:
                new["token_ids"] = token_ids
            out.append(new)
        if not out:
            return None
        kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return b"".join(encode_event({"object": kind, **self.header, "choices": [c]}) for c in out)

    def usage(self) -> bytes:
        """The usage chunk of a resumed stream (the original worker's was lost with it)."""
        if self.kind == "chat":
            prompt_tokens = len(self.chat_prompt_token_ids or ())
        else:
            prompts = {c.index // self.n: len(c.prompt_token_ids or ()) for c in self.choices.values()}
            prompt_tokens = sum(prompts.values())
        completion_tokens = sum(len(c.token_ids) for c in self.choices.values())
        return encode_event({**self.header, "choices": [], "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}})


# ---- the proxy ------------------------------------------------------------------------------------
class Proxy:
    """Sends requests to workers chosen by ``policy`` and turns their answers into client responses."""

    def __init__(self, client: httpx.AsyncClient, registry: WorkerRegistry, policy: Policy, metrics: RouterMetrics,
                 api_key: str | None = None, session: aiohttp.ClientSession | None = None) -> None:
        """``client``: control calls (``/detokenize``); ``session``: the data plane (``upstream_session``),
        which may be set later, once the event loop runs (the app's lifespan does). ``api_key``: the
        router's credential for the workers (``--worker-api-key``), sent as their Bearer token."""
        self.client, self.registry, self.policy, self.metrics = client, registry, policy, metrics
        self.api_key = api_key
        self.session = session

    def upstream_headers(self, request: Request, route: RouteRequest) -> dict[str, str]:
        """Content type, the request id, and the router's own credential for the workers
        (``--worker-api-key``) when it has one (``Worker.headers`` removes it for an untrusted worker). The
        client's Authorization header is never sent on: a worker registered by mistake or by an attacker
        must not learn the clients' key."""
        headers = {"content-type": "application/json", "x-request-id": route.request_id}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        return headers

    async def forward(self, path: str, content: bytes, route: RouteRequest, stream: bool, request: Request,
                      body: dict | None = None, arrival: float | None = None, send: Send | None = None,
                      prompt_ids: PromptIds | None = None) -> Response:
        """The response to send for one request (``stream``: a ``ClientStream`` once the first token is
        in). ``body``: the parsed request, which streams need to be resumable. ``arrival``: the
        ``time.perf_counter()`` at which the handler got the request; the time from it to the first
        upstream send is observed as the ``dispatch`` stage of ``request_overhead_seconds``. ``send``: the
        ASGI send of the client's connection. Given, a stream's head (200 and headers) goes out as soon as
        a worker answers 200, so writing it overlaps the worker's prefill instead of delaying the first
        token, and the first token goes out the moment it is read; a worker that then fails before its
        first token is still retried on another, and if none is left the client gets the error as an SSE
        event. Gives up with 499 if the client disconnects first, which cancels the upstream request.
        ``prompt_ids`` (with ``body``): the prompt's token ids for the workers that accept them."""
        headers = self.upstream_headers(request, route)
        state = None
        if stream and body is not None:
            state = StreamState("chat" if path.endswith("/chat/completions") else "completions", body)
        reply = _Reply(send) if send is not None and stream else None
        attempts = asyncio.ensure_future(self._attempts(path, content, route, state, stream, headers, arrival, reply,
                                                        body if prompt_ids is not None else None, prompt_ids))
        disconnect = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait({attempts, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
        if not attempts.done():
            attempts.cancel()
            try:
                response = await attempts
            except asyncio.CancelledError:
                response = None
            if isinstance(response, ClientStream):  # finished just as we cancelled
                response.abandon()
            logger.info("client disconnected before the first token of %s", route.request_id)
            self.metrics.errors.labels("client_disconnected").inc()
            return Response(status_code=499)
        response = attempts.result()
        if reply is not None and reply.head_sent and not isinstance(response, ClientStream):
            return _ErrorAfterHead(response)
        return response

    def pick(self, route: RouteRequest, tried: set[str], tokenmill_only: bool = False) -> Worker | None:
        """The policy's choice among the healthy workers not in ``tried`` (counted), or None."""
        candidates = [w for w in self.registry.routable()
                      if w.worker_id not in tried and (w.is_tokenmill or not tokenmill_only)]
        if not candidates:
            return None
        decision = self.policy.select(route, [w.view() for w in candidates])
        worker = next((w for w in candidates if w.worker_id == decision.worker_id), None)
        assert worker is not None, f"policy {self.policy.name} chose {decision.worker_id}, not a candidate"
        tried.add(worker.worker_id)
        self.metrics.count_decision(self.policy.name, decision)
        self.metrics.requests.labels(worker.worker_id, worker.url).inc()
        self.policy.on_dispatched(route, decision)
        return worker

    async def _attempts(self, path: str, content: bytes, route: RouteRequest, state: StreamState | None,
                        stream: bool, headers: dict[str, str], arrival: float | None = None,
                        reply: _Reply | None = None, body: dict | None = None,
                        prompt_ids: PromptIds | None = None) -> Response:
        tried: set[str] = set()
        last: _Retry | None = None
        while True:
            worker = self.pick(route, tried)
            if worker is None:
                if last is not None and last.response is not None:
                    return last.response  # every worker answered 5xx: pass the last one on
                self.metrics.errors.labels("no_worker").inc()
                why = f"; last failure: {last.detail}" if last is not None else ""
                return openai_error(f"no healthy worker can take the request{why}", 503, "service_unavailable_error")
            lease = Lease(worker, route, request_tokens(route), self.policy)
            payload, upstream = content, None
            if prompt_ids is not None and body is not None and prompt_ids.accepts(worker):
                upstream = {**body, "prompt": list(prompt_ids.token_ids)}
            if state is not None and worker.is_tokenmill and not state.wants_token_ids:
                upstream = {**(upstream or state.body), "return_token_ids": True}
            if upstream is not None:
                payload = json.dumps(upstream).encode()
            try:
                return await self._attempt(worker, lease, path, payload, stream, headers, route, state, arrival, reply)
            except _Retry as retry:
                arrival = None  # only the first attempt's dispatch is the router's overhead
                last = retry
                self.metrics.retries.labels(retry.reason).inc()
                logger.warning("request %s: %s; retrying on another worker", route.request_id, retry.detail)

    async def open(self, worker: Worker, path: str, content: bytes, headers: dict[str, str],
                   arrival: float | None = None) -> aiohttp.ClientResponse:
        """Send a request and return the response with its headers in (body unread); raises ``_Retry``
        on a connection failure or a 5xx, ``_Timeout`` when the worker sends no headers within the
        request timeout. ``arrival``: see ``forward``."""
        if arrival is not None:
            self.metrics.overhead.labels("dispatch").observe(time.perf_counter() - arrival)
        try:
            response = await self.session.post(worker.url + path, data=content, headers=worker.headers(headers))
        except aiohttp.ConnectionTimeoutError as exc:
            self._fail(worker, f"connect: {type(exc).__name__}", "connect_error")
        except asyncio.TimeoutError as exc:
            raise _Timeout() from exc
        except aiohttp.ClientError as exc:
            self._fail(worker, f"{type(exc).__name__}: {exc}", "connect_error")
        if response.status >= 500:
            try:
                body = await self._read_or_fail(worker, response)
            finally:
                _close(response)
            failed = Response(body, response.status, {WORKER_HEADER: worker.worker_id},
                              media_type=response.headers.get("content-type"))
            if response.status in UNHEALTHY_STATUSES:
                self.registry.mark_unhealthy(worker, f"answered {response.status}")
            raise _Retry(f"http_{response.status}", f"worker {worker.worker_id} answered {response.status}", failed)
        return response

    async def first_token(self, worker: Worker, response: aiohttp.ClientResponse) -> tuple[SSEReader, list[SSEEvent]]:
        """Read a stream up to and including its first event that carries a token; raises ``_Retry`` if it
        breaks or ends before."""
        reader = SSEReader(response)
        held: list[SSEEvent] = []
        while True:
            try:
                event = await reader.next()
            except UPSTREAM_ERRORS as exc:
                self._fail(worker, f"stream broke before its first token: {type(exc).__name__}", "stream_error")
            if event is None:
                self._fail(worker, "stream ended before its first token", "stream_error")
            held.append(event)
            if event.carries_token():
                return reader, held

    async def _attempt(self, worker: Worker, lease: Lease, path: str, content: bytes, stream: bool,
                       headers: dict[str, str], route: RouteRequest, state: StreamState | None,
                       arrival: float | None = None, reply: _Reply | None = None) -> Response:
        """One try on ``worker``; raises ``_Retry`` if it failed before any token was sent to the client.
        ``reply`` given, a stream's head is sent when the worker answers 200 (unless an earlier attempt
        sent it) and its first token before it is returned."""
        response: aiohttp.ClientResponse | None = None
        handed_off = False
        try:
            try:
                response = await self.open(worker, path, content, headers, arrival)
            except _Timeout:
                return openai_error(f"worker {worker.worker_id} did not answer within the request timeout", 504,
                                    "timeout_error")
            reply_headers = {WORKER_HEADER: worker.worker_id}
            if not stream or response.status != 200:
                body = await self._read_or_fail(worker, response)
                return Response(body, response.status, reply_headers,
                                media_type=response.headers.get("content-type"))
            for name in ("content-type", "content-encoding", "cache-control"):
                if name in response.headers:
                    reply_headers[name] = response.headers[name]
            if reply is not None and not reply.head_sent:
                await reply.send_head(reply_headers)
            reader, held = await self.first_token(worker, response)
            first_token_at = time.perf_counter()
            client_stream = ClientStream(response, reader, held, lease, reply_headers, self, route, headers, state,
                                         first_token_at)
            client_stream.head_sent = reply is not None
            handed_off = True
            if reply is not None:
                try:
                    await client_stream.start(reply.send)
                except BaseException:
                    client_stream.abandon()
                    raise
            return client_stream
        finally:
            if not handed_off:
                lease.release()
                if response is not None:
                    _close(response)

    async def _read_or_fail(self, worker: Worker, response: aiohttp.ClientResponse) -> bytes:
        try:
            return await response.read()
        except UPSTREAM_ERRORS as exc:
            self._fail(worker, f"response broke: {type(exc).__name__}", "read_error")

    def _fail(self, worker: Worker, detail: str, reason: str) -> NoReturn:
        """Mark ``worker`` unhealthy and raise ``_Retry``."""
        self.registry.mark_unhealthy(worker, detail)
        raise _Retry(reason, f"worker {worker.worker_id} failed: {detail}")

    async def detokenize(self, worker: Worker, token_ids: list[int], headers: dict[str, str]) -> str:
        """A worker's ``/detokenize`` of ``token_ids`` (raises httpx errors)."""
        response = await self.client.post(f"{worker.url}/detokenize", json={"tokens": token_ids},
                                          headers=worker.headers(headers), timeout=HEALTH_TIMEOUT_S)
        response.raise_for_status()
        return response.json()["prompt"]


class _Timeout(Exception):
    """The worker took longer than the request timeout to answer."""


class _Broken(Exception):
    """The upstream stream broke (or ended early) after the client got tokens."""


class ClientStream(Response):
    """The client's stream: the first worker's events, then, if it breaks, each unfinished choice resumed
    on other workers.

    Runs the copy beside a watcher of the client's ``http.disconnect``; whichever way it ends (done,
    client gone, no worker left), the current upstream response is closed and its lease released.
    """

    def __init__(self, upstream: aiohttp.ClientResponse, reader: SSEReader, held: list[SSEEvent], lease: Lease,
                 headers: dict[str, str], proxy: Proxy, route: RouteRequest, upstream_headers: dict[str, str],
                 state: StreamState | None, first_token_at: float | None = None) -> None:
        self.upstream, self.reader, self.held, self.lease, self.proxy = upstream, reader, held, lease, proxy
        self.first_token_at = first_token_at  # perf_counter() when the first token event was read
        self.route, self.upstream_headers, self.state = route, upstream_headers, state
        self.status_code = upstream.status
        self.background = None
        self.init_headers(headers)
        self.head_sent = False  # the response start (status, headers) was sent
        self.started = False  # the response start and the first token were sent
        self.finished = False  # the last byte was handed to the server (its disconnect event then means nothing)
        self.client_gone = False

    def abandon(self) -> None:
        """Close the current upstream and release its lease (idempotent)."""
        try:
            _close(self.upstream)
        finally:
            self.lease.release()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.started:
            try:  # the first token goes out at once, before the copy and its disconnect watcher start
                await self.start(send)
            except BaseException:
                self.abandon()
                raise
        copy = asyncio.ensure_future(self._copy(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait((copy, watch), return_when=asyncio.FIRST_COMPLETED)
            if not copy.done():  # the client went away first
                self.client_gone = not self.finished
                copy.cancel()
                await asyncio.gather(copy, return_exceptions=True)
            else:
                copy.result()  # raises what the copy raised
        finally:
            copy.cancel()
            watch.cancel()
            self.abandon()
            if self.client_gone:
                logger.info("client disconnected mid-stream; closed the stream of %s on %s",
                            self.route.request_id, self.lease.worker.worker_id)
                self.proxy.metrics.errors.labels("client_disconnected").inc()

    async def _body(self, send: Send, data: bytes) -> None:
        if not data:
            return
        await send({"type": "http.response.body", "body": data, "more_body": True})

    async def start(self, send: Send) -> None:
        """Send the response start (unless sent) and the events read up to the first token."""
        self.started = True
        if not self.head_sent:
            self.head_sent = True
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        state = self.state
        for event in self.held:
            await self._body(send, state.observe(event) if state else event.raw)
        self.held = []
        if self.first_token_at is not None:
            relay = time.perf_counter() - self.first_token_at
            self.proxy.metrics.overhead.labels("first_token_relay").observe(relay)

    async def _copy(self, send: Send) -> None:
        state = self.state
        try:
            while True:
                event = await self.reader.next()
                if event is None:
                    break
                await self._body(send, state.observe(event) if state else event.raw)
            if state is not None and not state.done:
                raise _Broken("stream ended without [DONE]")
        except (*UPSTREAM_ERRORS, _Broken) as exc:
            await self._on_upstream_broken(send, exc)
        self.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _on_upstream_broken(self, send: Send, exc: Exception) -> None:
        """The worker failed after the client got tokens: mark it unhealthy, then resume every unfinished
        choice elsewhere (tokenmill workers) or end the stream with an SSE error event."""
        worker, state = self.lease.worker, self.state
        self.proxy.registry.mark_unhealthy(worker, f"stream broke: {type(exc).__name__}: {exc}")
        self.abandon()
        if state is None or not state.has_token_ids:
            self.proxy.metrics.errors.labels("stream_broken").inc()
            await self._body(send, sse_error(f"worker {worker.worker_id} failed mid-stream ({type(exc).__name__}); "
                                             "only tokenmill workers' streams can be resumed"))
            return
        for choice in sorted(state.choices.values(), key=lambda c: c.index):
            if not choice.finished and not await self._resume_choice(send, choice):
                return
        if state.wants_usage and not state.usage_sent:
            await self._body(send, state.usage())
        await self._body(send, b"data: [DONE]\n\n")
        state.done = True

    async def _resume_choice(self, send: Send, choice: ChoiceState) -> bool:
        """Continue ``choice`` on healthy tokenmill workers until it finishes; False (after an SSE error
        event) when none is left."""
        state, proxy = self.state, self.proxy
        tried: set[str] = set()
        while not choice.finished:
            prompt = state.prompt_of(choice)
            route = RouteRequest(request_id=f"{self.route.request_id}-resume{choice.index}-{len(tried)}",
                                 text=self.route.text,
                                 prompt_token_ids=tuple(prompt) if isinstance(prompt, list) else None,
                                 num_prompt_tokens=len(prompt) if isinstance(prompt, list) else len(prompt or "") // 4,
                                 max_tokens=max(self.route.max_tokens - len(choice.token_ids), 0))
            worker = proxy.pick(route, tried, tokenmill_only=True) if prompt is not None else None
            if worker is None:
                proxy.metrics.errors.labels("no_worker").inc()
                await self._body(send, sse_error("the worker streaming this response failed and no healthy "
                                                 "tokenmill worker is left to resume it"))
                return False
            self.lease = Lease(worker, route, request_tokens(route), proxy.policy)
            try:
                cut, skip = await self._cut(send, worker, choice, prompt)
                body = state.resume_body(choice, prompt, cut)
                headers = {**self.upstream_headers, "x-request-id": route.request_id}
                proxy.metrics.resumptions.inc()
                logger.warning("request %s: resuming choice %d on %s after %d tokens (cut at %d)",
                               self.route.request_id, choice.index, worker.worker_id, len(choice.token_ids), cut)
                self.upstream = await proxy.open(worker, "/v1/completions", json.dumps(body).encode(), headers)
                if self.upstream.status != 200:
                    detail = (await proxy._read_or_fail(worker, self.upstream))[:500].decode(errors="replace")
                    await self._body(send, sse_error(f"resuming on {worker.worker_id} failed: "
                                                     f"{self.upstream.status} {detail}"))
                    return False
                reader = SSEReader(self.upstream)
                ended = False
                while (event := await reader.next()) is not None:
                    if event.done:
                        ended = True
                    elif event.obj is not None and event.obj.get("choices"):
                        data = state.translate(event.obj, choice, skip)
                        if data is not None:
                            await self._body(send, data)
                if not ended and not choice.finished:
                    raise _Broken("resumed stream ended without [DONE]")
            except (_Retry, _Timeout) as exc:
                proxy.metrics.retries.labels(getattr(exc, "reason", "timeout")).inc()
            except (*UPSTREAM_ERRORS, httpx.HTTPError, _Broken, ValueError, KeyError) as exc:
                proxy.registry.mark_unhealthy(worker, f"resumed stream broke: {type(exc).__name__}: {exc}")
            finally:
                self.abandon()
        return True

    async def _cut(self, send: Send, worker: Worker, choice: ChoiceState, prompt: list[int] | str) -> tuple[int, list[int]]:
        """Where to resume ``choice``: (tokens kept in the prompt, [characters, token ids] of regenerated
        output the client already has). Deterministic requests go back to a token whose text is a clean
        prefix of what was sent, so text held back by the detokenizer (an unfinished UTF-8 character, a
        possible stop string) and a final stop token are regenerated; otherwise the cut is at the last
        token and held-back text is sent at once."""
        state, tokens = self.state, choice.token_ids
        sent = "".join(choice.text)
        if isinstance(prompt, str) or not tokens or state.body.get("echo"):
            return len(tokens), [0, 0]
        if not state.deterministic:
            text = await self.proxy.detokenize(worker, tokens, self.upstream_headers)
            if text.startswith(sent) and not text.endswith(REPLACEMENT_CHAR):
                held = text[len(sent):]
                if held:
                    choice.text.append(held)
                    chunk = state.translate({"choices": [{"text": held}]}, ChoiceState(choice.index), [0, 0])
                    if chunk is not None:
                        await self._body(send, chunk)
            return len(tokens), [0, 0]
        for cut in [*range(len(tokens) - 1, max(len(tokens) - 1 - RESUME_SEARCH, 0), -1), 0]:
            text = await self.proxy.detokenize(worker, tokens[:cut], self.upstream_headers) if cut else ""
            if sent.startswith(text) and not text.endswith(REPLACEMENT_CHAR):
                return cut, [len(sent) - len(text), len(tokens) - cut]
        raise AssertionError("cut 0 always matches")
