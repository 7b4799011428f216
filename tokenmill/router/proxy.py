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
from dataclasses import dataclass
from typing import Callable, NoReturn

import aiohttp
import httpx2 as httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from tokenmill.router.client_stream import ClientStream
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policies import request_tokens
from tokenmill.router.policy import Policy, RouteRequest
from tokenmill.router.resume import StreamState
from tokenmill.router.sse import SSEEvent, SSEReader
from tokenmill.router.upstream import (
    UPSTREAM_ERRORS,
    RetryElsewhere,
    UpstreamTimeout,
    close_upstream,
    wait_disconnect,
)
from tokenmill.router.workers import HEALTH_TIMEOUT_S, Lease, Worker, WorkerRegistry
from tokenmill.tracing import TRACE_SCOPE_KEY

logger = logging.getLogger(__name__)

WORKER_HEADER = "x-router-worker-id"  # which worker served the response (debugging, tests)
UNHEALTHY_STATUSES = (502, 503, 504)  # the worker (or its engine) is down, not the request at fault


def openai_error(message: str, status_code: int, type: str, param: str | None = None,
                 code: str | int | None = None) -> JSONResponse:
    """A JSONResponse with an OpenAI error body."""
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}}, status_code)


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


# ---- the proxy ------------------------------------------------------------------------------------


class Proxy:
    """Sends requests to workers chosen by ``policy`` and turns their answers into client responses."""

    def __init__(self, client: httpx.AsyncClient, registry: WorkerRegistry, policy: Policy, metrics: RouterMetrics,
                 api_key: str | None = None, session: aiohttp.ClientSession | None = None,
                 stream_stall_timeout: float | None = None) -> None:
        """``client``: control calls (``/detokenize``); ``session``: the data plane (``upstream_session``),
        which may be set later, once the event loop runs (the app's lifespan does). ``api_key``: the
        router's credential for the workers (``--worker-api-key``), sent as their Bearer token.
        ``stream_stall_timeout``: seconds a stream may go without an event after its first token before
        the worker is taken as failed and the stream resumed elsewhere (None: no bound)."""
        self.client, self.registry, self.policy, self.metrics = client, registry, policy, metrics
        self.api_key = api_key
        self.session = session
        self.stream_stall_timeout = stream_stall_timeout

    def upstream_headers(self, request: Request, route: RouteRequest) -> dict[str, str]:
        """Content type, the request id, and the router's own credential for the workers
        (``--worker-api-key``) when it has one (``Worker.headers`` removes it for an untrusted worker). The
        client's Authorization header is never sent on: a worker registered by mistake or by an attacker
        must not learn the clients' key. The W3C trace headers the app put in the scope (``TRACE_SCOPE_KEY``: its
        ``router_request`` span's, or the client's) go too, so the workers' spans join the trace."""
        headers = {"content-type": "application/json", "x-request-id": route.request_id}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        trace = request.scope.get(TRACE_SCOPE_KEY)
        if trace:
            headers.update(trace)
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
        disconnect = asyncio.ensure_future(wait_disconnect(request.receive))
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
        last: RetryElsewhere | None = None
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
            except RetryElsewhere as retry:
                arrival = None  # only the first attempt's dispatch is the router's overhead
                last = retry
                self.metrics.retries.labels(retry.reason).inc()
                logger.warning("request %s: %s; retrying on another worker", route.request_id, retry.detail)

    async def open(self, worker: Worker, path: str, content: bytes, headers: dict[str, str],
                   arrival: float | None = None) -> aiohttp.ClientResponse:
        """Send a request and return the response with its headers in (body unread); raises ``RetryElsewhere``
        on a connection failure or a 5xx, ``UpstreamTimeout`` when the worker sends no headers within the
        request timeout. ``arrival``: see ``forward``."""
        if arrival is not None:
            self.metrics.overhead.labels("dispatch").observe(time.perf_counter() - arrival)
        try:
            response = await self.session.post(worker.url + path, data=content, headers=worker.headers(headers))
        except aiohttp.ConnectionTimeoutError as exc:
            self._fail(worker, f"connect: {type(exc).__name__}", "connect_error")
        except asyncio.TimeoutError as exc:
            raise UpstreamTimeout() from exc
        except aiohttp.ClientError as exc:
            self._fail(worker, f"{type(exc).__name__}: {exc}", "connect_error")
        if response.status >= 500:
            try:
                body = await self.read_or_fail(worker, response)
            finally:
                close_upstream(response)
            failed = Response(body, response.status, {WORKER_HEADER: worker.worker_id},
                              media_type=response.headers.get("content-type"))
            if response.status in UNHEALTHY_STATUSES:
                self.registry.mark_unhealthy(worker, f"answered {response.status}")
            raise RetryElsewhere(f"http_{response.status}", f"worker {worker.worker_id} answered {response.status}",
                                 failed)
        return response

    async def first_token(self, worker: Worker, response: aiohttp.ClientResponse) -> tuple[SSEReader, list[SSEEvent]]:
        """Read a stream up to and including its first event that carries a token; raises ``RetryElsewhere`` if it
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
        """One try on ``worker``; raises ``RetryElsewhere`` if it failed before any token was sent to the client.
        ``reply`` given, a stream's head is sent when the worker answers 200 (unless an earlier attempt
        sent it) and its first token before it is returned."""
        response: aiohttp.ClientResponse | None = None
        handed_off = False
        watch = worker.watch()  # a hung worker (registry.mark_hung) interrupts the wait: retried elsewhere
        try:
            async with watch:
                try:
                    response = await self.open(worker, path, content, headers, arrival)
                except UpstreamTimeout:
                    return openai_error(f"worker {worker.worker_id} did not answer within the request timeout", 504,
                                        "timeout_error")
                reply_headers = {WORKER_HEADER: worker.worker_id}
                if not stream or response.status != 200:
                    body = await self.read_or_fail(worker, response)
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
        except TimeoutError:
            if not watch.expired:
                raise
            raise RetryElsewhere("worker_hung", f"worker {worker.worker_id} failed: {watch.reason}") from None
        finally:
            if not handed_off:
                lease.release()
                if response is not None:
                    close_upstream(response)

    async def read_or_fail(self, worker: Worker, response: aiohttp.ClientResponse) -> bytes:
        try:
            return await response.read()
        except UPSTREAM_ERRORS as exc:
            self._fail(worker, f"response broke: {type(exc).__name__}", "read_error")

    def _fail(self, worker: Worker, detail: str, reason: str) -> NoReturn:
        """Mark ``worker`` unhealthy and raise ``RetryElsewhere``."""
        self.registry.mark_unhealthy(worker, detail)
        raise RetryElsewhere(reason, f"worker {worker.worker_id} failed: {detail}")

    async def detokenize(self, worker: Worker, token_ids: list[int], headers: dict[str, str]) -> str:
        """A worker's ``/detokenize`` of ``token_ids`` (raises httpx errors)."""
        response = await self.client.post(f"{worker.url}/detokenize", json={"tokens": token_ids},
                                          headers=worker.headers(headers), timeout=HEALTH_TIMEOUT_S)
        response.raise_for_status()
        return response.json()["prompt"]
