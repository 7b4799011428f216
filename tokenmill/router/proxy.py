"""Forwarding one request to a worker: pick, send, retry before the first byte, stream through.

One shared ``httpx.AsyncClient`` for every worker. ``Proxy.forward`` runs attempts until one worker
gives a usable answer: the policy picks among the healthy workers not tried yet, a ``Lease`` holds the
request's tokens on the worker, and a connection error, a 5xx, or a failure before the first byte of a
stream sends the request to the next worker (nothing has reached the client yet; counted in
``tokenmill_router:retries_total``). Streams pass through chunk by chunk (``UpstreamStream``): no
buffering, no parsing. A client that disconnects closes the upstream response, so the worker aborts
the request. A stream that breaks after its first byte ends with an SSE error event: resuming it on
another worker is the failover slice's job (``UpstreamStream._on_upstream_broken``).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, NoReturn

import anyio
import httpx2 as httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policies import request_tokens
from tokenmill.router.policy import Policy, RouteRequest
from tokenmill.router.workers import Lease, Worker, WorkerRegistry

logger = logging.getLogger(__name__)

WORKER_HEADER = "x-router-worker-id"  # which worker served the response (debugging, tests)
UNHEALTHY_STATUSES = (502, 503, 504)  # the worker (or its engine) is down, not the request at fault


def openai_error(message: str, status_code: int, type: str, param: str | None = None,
                 code: str | int | None = None) -> JSONResponse:
    """A JSONResponse with an OpenAI error body."""
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}}, status_code)


class _Retry(Exception):
    """This attempt failed before anything reached the client; try another worker."""

    def __init__(self, reason: str, detail: str, response: Response | None = None) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.response = reason, detail, response


async def _close_shielded(response: httpx.Response) -> None:
    """Close an upstream response even while our task is being cancelled (the worker then aborts)."""
    with anyio.CancelScope(shield=True):
        await response.aclose()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Proxy:
    """Sends requests to workers chosen by ``policy`` and turns their answers into client responses."""

    def __init__(self, client: httpx.AsyncClient, registry: WorkerRegistry, policy: Policy, metrics: RouterMetrics,
                 api_key: str | None = None) -> None:
        self.client, self.registry, self.policy, self.metrics = client, registry, policy, metrics
        self.api_key = api_key

    def upstream_headers(self, request: Request, route: RouteRequest) -> dict[str, str]:
        """Content type, the request id, and authorization: the router's key when it has one, else the
        client's header as given."""
        headers = {"content-type": "application/json", "x-request-id": route.request_id}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        elif "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        return headers

    async def forward(self, path: str, content: bytes, route: RouteRequest, stream: bool, request: Request) -> Response:
        """The response to send for one request (``stream``: an ``UpstreamStream`` once the first chunk is
        in). Gives up with 499 if the client disconnects first, which cancels the upstream request."""
        headers = self.upstream_headers(request, route)
        attempts = asyncio.ensure_future(self._attempts(path, content, route, stream, headers))
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
            if isinstance(response, UpstreamStream):  # finished just as we cancelled
                await response.abandon()
            logger.info("client disconnected before the first byte of %s", route.request_id)
            self.metrics.errors.labels("client_disconnected").inc()
            return Response(status_code=499)
        return attempts.result()

    async def _attempts(self, path: str, content: bytes, route: RouteRequest, stream: bool,
                        headers: dict[str, str]) -> Response:
        tried: set[str] = set()
        last: _Retry | None = None
        while True:
            candidates = [w for w in self.registry.routable() if w.worker_id not in tried]
            if not candidates:
                if last is not None and last.response is not None:
                    return last.response  # every worker answered 5xx: pass the last one on
                self.metrics.errors.labels("no_worker").inc()
                why = f"; last failure: {last.detail}" if last is not None else ""
                return openai_error(f"no healthy worker can take the request{why}", 503, "service_unavailable_error")
            decision = self.policy.select(route, [w.view() for w in candidates])
            worker = next((w for w in candidates if w.worker_id == decision.worker_id), None)
            assert worker is not None, f"policy {self.policy.name} chose {decision.worker_id}, not a candidate"
            tried.add(worker.worker_id)
            self.metrics.count_decision(self.policy.name, decision)
            self.metrics.requests.labels(worker.worker_id, worker.url).inc()
            lease = Lease(worker, route, request_tokens(route), self.policy)
            self.policy.on_dispatched(route, decision)
            try:
                return await self._attempt(worker, lease, path, content, stream, headers)
            except _Retry as retry:
                last = retry
                self.metrics.retries.labels(retry.reason).inc()
                logger.warning("request %s: %s; retrying on another worker", route.request_id, retry.detail)

    async def _attempt(self, worker: Worker, lease: Lease, path: str, content: bytes, stream: bool,
                       headers: dict[str, str]) -> Response:
        """One try on ``worker``; raises ``_Retry`` if it failed before anything was sent to the client."""
        response: httpx.Response | None = None
        handed_off = False
        try:
            upstream = self.client.build_request("POST", worker.url + path, content=content, headers=headers)
            try:
                response = await self.client.send(upstream, stream=True)
            except httpx.TimeoutException as exc:
                if isinstance(exc, httpx.ConnectTimeout) or isinstance(exc, httpx.PoolTimeout):
                    self._fail(worker, f"connect: {type(exc).__name__}", "connect_error")
                return openai_error(f"worker {worker.worker_id} did not answer within the request timeout", 504,
                                    "timeout_error")
            except httpx.TransportError as exc:
                self._fail(worker, f"{type(exc).__name__}: {exc}", "connect_error")
            reply_headers = {WORKER_HEADER: worker.worker_id}
            if response.status_code >= 500:
                body = await self._read_or_fail(worker, response)
                failed = Response(body, response.status_code, reply_headers,
                                  media_type=response.headers.get("content-type"))
                if response.status_code in UNHEALTHY_STATUSES:
                    self.registry.mark_unhealthy(worker, f"answered {response.status_code}")
                raise _Retry(f"http_{response.status_code}",
                             f"worker {worker.worker_id} answered {response.status_code}", failed)
            if not stream or response.status_code != 200:
                body = await self._read_or_fail(worker, response)
                return Response(body, response.status_code, reply_headers,
                                media_type=response.headers.get("content-type"))
            chunks = response.aiter_raw()
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = b""
            except httpx.TransportError as exc:
                self._fail(worker, f"stream broke before its first byte: {type(exc).__name__}", "stream_error")
            for name in ("content-type", "content-encoding", "cache-control"):
                if name in response.headers:
                    reply_headers[name] = response.headers[name]
            handed_off = True
            return UpstreamStream(response, chunks, first, lease, reply_headers, self)
        finally:
            if not handed_off:
                lease.release()
                if response is not None:
                    await _close_shielded(response)

    async def _read_or_fail(self, worker: Worker, response: httpx.Response) -> bytes:
        try:
            return await response.aread()
        except httpx.TransportError as exc:
            self._fail(worker, f"response broke: {type(exc).__name__}", "read_error")

    def _fail(self, worker: Worker, detail: str, reason: str) -> NoReturn:
        """Mark ``worker`` unhealthy and raise ``_Retry``."""
        self.registry.mark_unhealthy(worker, detail)
        raise _Retry(reason, f"worker {worker.worker_id} failed: {detail}")


class UpstreamStream(Response):
    """A worker's streamed response passed to the client chunk by chunk.

    Runs the copy beside a watcher of the client's ``http.disconnect``; whichever way it ends (done,
    client gone, worker broken), the upstream response is closed and the lease released exactly once.
    """

    def __init__(self, upstream: httpx.Response, chunks: AsyncIterator[bytes], first: bytes, lease: Lease,
                 headers: dict[str, str], proxy: Proxy) -> None:
        self.upstream, self.chunks, self.first, self.lease, self.proxy = upstream, chunks, first, lease, proxy
        self.status_code = upstream.status_code
        self.background = None
        self.init_headers(headers)
        self.finished = False  # the last byte was handed to the server (its disconnect event then means nothing)
        self.client_gone = False

    async def abandon(self) -> None:
        """Never sent (the client left first): close the upstream and release."""
        try:
            await _close_shielded(self.upstream)
        finally:
            self.lease.release()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def watch() -> None:
                    await _wait_disconnect(receive)
                    self.client_gone = not self.finished
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                await self._copy(send)
                group.cancel_scope.cancel()
        finally:
            await self.abandon()
            if self.client_gone:
                logger.info("client disconnected mid-stream; closed the stream of %s on %s",
                            self.lease.request.request_id, self.lease.worker.worker_id)
                self.proxy.metrics.errors.labels("client_disconnected").inc()

    async def _copy(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if self.first:
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as exc:
            await self._on_upstream_broken(send, exc)
        self.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _on_upstream_broken(self, send: Send, exc: Exception) -> None:
        """The worker failed after the client got bytes: mark it unhealthy and end the stream with an
        SSE error event. (Failover slice: resume here on another worker with prompt + tokens so far.)"""
        worker = self.lease.worker
        self.proxy.registry.mark_unhealthy(worker, f"stream broke: {type(exc).__name__}")
        self.proxy.metrics.errors.labels("stream_broken").inc()
        error = {"error": {"message": f"worker {worker.worker_id} failed mid-stream ({type(exc).__name__})",
                           "type": "service_unavailable_error", "param": None, "code": 503}}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(error)}\n\n".encode(),
                    "more_body": True})
