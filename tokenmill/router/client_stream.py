"""The client's stream (``ClientStream``): the first worker's events copied as they come, then, if the worker
breaks after tokens went out, each unfinished choice resumed on other workers; the client's disconnect closes
the upstream response and releases its lease."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING

import aiohttp
import httpx2 as httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenmill.router.policies import request_tokens
from tokenmill.router.policy import RouteRequest
from tokenmill.router.resume import (
    REPLACEMENT_CHAR,
    RESUME_SEARCH,
    ChoiceState,
    StreamState,
)
from tokenmill.router.sse import SSEEvent, SSEReader, sse_error
from tokenmill.router.upstream import (
    UPSTREAM_ERRORS,
    RetryElsewhere,
    UpstreamTimeout,
    close_upstream,
    wait_disconnect,
)
from tokenmill.router.workers import Lease, Worker

if TYPE_CHECKING:
    from tokenmill.router.proxy import Proxy

logger = logging.getLogger(__name__)


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
            close_upstream(self.upstream)
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
        watch = asyncio.ensure_future(wait_disconnect(receive))
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
        watch = self.lease.worker.watch(self.proxy.stream_stall_timeout)  # a hung or stalled worker ends the copy
        try:
            async with watch:
                watch.touch()  # the first token is in: from here a stall counts
                while True:
                    event = await self.reader.next()
                    if event is None:
                        break
                    watch.touch()
                    await self._body(send, state.observe(event) if state else event.raw)
            if state is not None and not state.done:
                raise _Broken("stream ended without [DONE]")
        except (*UPSTREAM_ERRORS, _Broken) as exc:
            await self._on_upstream_broken(send, _Broken(watch.reason) if watch.expired else exc)
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
            watch = worker.watch(proxy.stream_stall_timeout)  # hung or stalled: resume on the next worker
            try:
                async with watch:
                    cut, skip = await self._cut(send, worker, choice, prompt)
                    body = state.resume_body(choice, prompt, cut)
                    headers = {**self.upstream_headers, "x-request-id": route.request_id}
                    proxy.metrics.resumptions.inc()
                    logger.warning("request %s: resuming choice %d on %s after %d tokens (cut at %d)",
                                   self.route.request_id, choice.index, worker.worker_id, len(choice.token_ids), cut)
                    self.upstream = await proxy.open(worker, "/v1/completions", json.dumps(body).encode(), headers)
                    if self.upstream.status != 200:
                        detail = (await proxy.read_or_fail(worker, self.upstream))[:500].decode(errors="replace")
                        await self._body(send, sse_error(f"resuming on {worker.worker_id} failed: "
                                                         f"{self.upstream.status} {detail}"))
                        return False
                    reader = SSEReader(self.upstream)
                    ended = False
                    while (event := await reader.next()) is not None:
                        watch.touch()
                        if event.done:
                            ended = True
                        elif event.obj is not None and event.obj.get("choices"):
                            data = state.translate(event.obj, choice, skip)
                            if data is not None:
                                await self._body(send, data)
                if not ended and not choice.finished:
                    raise _Broken("resumed stream ended without [DONE]")
            except (RetryElsewhere, UpstreamTimeout) as exc:
                proxy.metrics.retries.labels(getattr(exc, "reason", "timeout")).inc()
            except (*UPSTREAM_ERRORS, httpx.HTTPError, _Broken, ValueError, KeyError) as exc:
                why = watch.reason if watch.expired else f"{type(exc).__name__}: {exc}"
                proxy.registry.mark_unhealthy(worker, f"resumed stream broke: {why}")
            finally:
                self.abandon()
        return True

    async def _cut(self, send: Send, worker: Worker, choice: ChoiceState, prompt: list[int] | str
                   ) -> tuple[int, list[int]]:
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
