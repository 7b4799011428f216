"""Prefill/decode disaggregation in the router (``tokenmill router --pd-disaggregation --prefill URL...
--decode URL...``), as vLLM's disaggregated proxy and SGLang's PD router do it.

Each request first goes to a prefill worker as a copy with ``max_tokens`` 1, not streamed, and
``kv_transfer_params: {"do_remote_decode": true}``: the worker computes the prompt, leases its KV
blocks and answers where they are (its response's ``kv_transfer_params``). The original request then
goes to a decode worker with those parameters (``do_remote_prefill``); the decode worker pulls the
blocks, computes only the last prompt token and decodes, and its answer (streamed or not) is the
client's, through the ordinary ``Proxy`` (retries, resumption, disconnect handling).

Multi-round conversations (AMPD): a request with a session (``user`` or ``X-Session-Id``) whose
decode worker already holds the history skips the prefill worker when its new tokens are few
(``--pd-local-prefill-threshold``): that worker extends its own prefix cache. New tokens are
estimated as this prompt's tokens minus the previous round's prompt tokens (the previous answer
counts as new: a conservative estimate). A failed prefill step is not an error: the decode worker
computes the prompt itself, counted in ``tokenmill_router:pd_requests_total{path="prefill_failed"}``.

Workers take ``kv_transfer_params`` only when signed with the cluster secret (``tokenmill.security.sign_params``,
``--kv-transfer-secret-file``): the router signs the ``do_remote_decode`` it sends a prefill worker and the
parameters it hands the decode worker, each with a fresh ``nonce`` (a worker refuses a replay). Parameters a
client put in its own body never reach a worker from here: they are replaced or dropped.

A lease nobody will pull is released at once rather than after the producer's ``lease_ttl_s``: when the
decode step does not answer 2xx (a request the decode worker refuses, since the prefill copy left out the
fields it checks; no decode worker; an error) or the client leaves first, the router POSTs the prefill
worker's ``/kv_transfer/release`` a lease id signed with the cluster secret (purpose ``kv_lease_release``).
Otherwise invalid requests could each pin a lease's blocks for the TTL and turn PD off for everyone.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections import OrderedDict

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.kv_transfer.params_auth import RELEASE_PATH, RELEASE_PURPOSE
from tokenmill.router.policies import request_tokens, session_key
from tokenmill.router.policy import Policy, RouteRequest
from tokenmill.router.proxy import Proxy
from tokenmill.router.upstream import UPSTREAM_ERRORS
from tokenmill.router.workers import Lease, Worker, WorkerRegistry
from tokenmill.security import sign_params

logger = logging.getLogger(__name__)

MAX_SESSIONS = 65536
RELEASE_TIMEOUT = aiohttp.ClientTimeout(total=5.0)  # a lease release; past it the lease expires on its own
STRIP_FOR_PREFILL = ("stream", "stream_options", "n", "logprobs", "top_logprobs", "echo", "max_completion_tokens",
                     "response_format", "structured_outputs", "tools", "tool_choice", "min_tokens")


class PDRouter:
    """Two steps per request: prefill worker (lease the KV), then decode worker (pull it and decode).

    Args:
        prefill: registry of the prefill workers; prefill_policy picks among them.
        decode: the ``Proxy`` over the decode workers (its policy, retries and streaming).
        metrics: the router's metrics (``pd_*`` counters are added to its registry).
        local_prefill_threshold: a session's round with at most this many new prompt tokens runs its
            prefill on the decode worker that holds the session (0: never).
        api_key: sent to the workers.
        secret: the cluster secret the workers check ``kv_transfer_params`` with.
    """

    def __init__(self, prefill: WorkerRegistry, prefill_policy: Policy, decode: Proxy,
                 metrics, local_prefill_threshold: int = 0, api_key: str | None = None, *, secret: bytes) -> None:
        from prometheus_client import Counter

        self.prefill, self.prefill_policy, self.decode = prefill, prefill_policy, decode
        self._secret = secret
        self.local_prefill_threshold = local_prefill_threshold
        self.api_key = api_key
        self._background: set[asyncio.Task] = set()  # releases sent after a failed request (held till done)
        self.sessions: OrderedDict[bytes, int] = OrderedDict()  # session_key -> previous round's prompt tokens
        self.pd_requests = Counter("tokenmill_router:pd_requests", "Requests by how their prompt was prefilled: "
                                   "remote (a prefill worker), local (the decode worker, by threshold), "
                                   "local_n (the decode worker: n > 1, whose sequences share one prompt), "
                                   "prefill_failed (the decode worker, after a failed prefill step).",
                                   ["path"], registry=metrics.registry)
        self.metrics = metrics

    def _local_round(self, route: RouteRequest) -> bool:
        if route.session_id is None or self.local_prefill_threshold <= 0:
            return False
        session = session_key(route.session_id)
        previous = self.sessions.get(session)
        self.sessions[session] = route.num_prompt_tokens
        self.sessions.move_to_end(session)
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)
        return previous is not None and route.num_prompt_tokens - previous <= self.local_prefill_threshold

    async def forward(self, path: str, body: dict, route: RouteRequest, stream: bool, request: Request,
                      send=None) -> Response:
        """Prefill step (unless the round stays local), then the decode request through the decode proxy."""
        prefilled = None
        n = body.get("n", 1)
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            # a transfer fills one sequence; the decode worker computes the shared prompt once for all n
            self.pd_requests.labels("local_n").inc()
        elif self._local_round(route):
            self.pd_requests.labels("local").inc()
        else:
            prefilled = await self._prefill(path, body, route, request)
            self.pd_requests.labels("remote" if prefilled is not None else "prefill_failed").inc()
        decode_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}  # never a client's
        if prefilled is None:
            return await self.decode.forward(path, json.dumps(decode_body).encode(), route, stream, request,
                                             decode_body, send=send)
        params, prefill_worker = prefilled
        decode_body["kv_transfer_params"] = self._sign(params)
        release = self._release(prefill_worker, params.get("remote_lease_id"), route)
        try:
            response = await self.decode.forward(path, json.dumps(decode_body).encode(), route, stream, request,
                                                 decode_body, send=send)
        except BaseException:  # cancelled or failed: release without holding up the error
            task = asyncio.ensure_future(release)
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            raise
        status = getattr(response, "status_code", None)  # None: a stream whose head went out, then failed
        if status is not None and 200 <= status < 300:
            release.close()  # the decode worker pulled the lease (or tried: it is freed either way)
        else:
            await release
        return response

    async def _release(self, worker: Worker, lease_id: object, route: RouteRequest) -> None:
        """Ask ``worker`` to free lease ``lease_id`` now (signed with the cluster secret); a failure is only
        logged (the lease then expires after the producer's ``lease_ttl_s``)."""
        if not isinstance(lease_id, str):
            return
        body = sign_params(self._secret, {"lease_id": lease_id, "nonce": secrets.token_hex(16)}, RELEASE_PURPOSE)
        headers = worker.headers({"content-type": "application/json", "x-request-id": route.request_id,
                                  **({"authorization": f"Bearer {self.api_key}"} if self.api_key else {})})
        try:
            async with self.decode.session.post(worker.url + RELEASE_PATH, data=json.dumps(body).encode(),
                                                headers=headers, timeout=RELEASE_TIMEOUT) as response:
                status, content = response.status, await response.read()
        except UPSTREAM_ERRORS as exc:
            logger.warning("request %s: releasing its lease on %s failed: %s: %s", route.request_id, worker.url,
                           type(exc).__name__, exc)
            return
        if status != 200:
            logger.warning("request %s: %s refused to release its lease (%d): %s", route.request_id, worker.url,
                           status, content[:200])
        else:
            logger.info("request %s: its KV lease on %s released early (%s)", route.request_id, worker.url,
                        content[:100])

    async def _prefill(self, path: str, body: dict, route: RouteRequest,
                       request: Request) -> tuple[dict, Worker] | None:
        """The prefill worker's ``kv_transfer_params`` for the decode worker and that prefill worker, or
        None when no prefill worker could do it (the decode worker then computes the prompt)."""
        prefill_body = {k: v for k, v in body.items() if k not in STRIP_FOR_PREFILL}
        prefill_body.update(max_tokens=1, stream=False, kv_transfer_params=self._sign({"do_remote_decode": True}))
        headers = self.decode.upstream_headers(request, route)
        tried: set[str] = set()
        while True:
            candidates = [w for w in self.prefill.routable() if w.worker_id not in tried]
            if not candidates:
                logger.warning("request %s: no prefill worker could take it; the decode worker prefills",
                               route.request_id)
                return None
            decision = self.prefill_policy.select(route, [w.view() for w in candidates])
            worker = next(w for w in candidates if w.worker_id == decision.worker_id)
            tried.add(worker.worker_id)
            self.metrics.count_decision(f"prefill_{self.prefill_policy.name}", decision)
            self.metrics.requests.labels(worker.worker_id, worker.url).inc()
            self.prefill_policy.on_dispatched(route, decision)
            lease = Lease(worker, route, request_tokens(route), self.prefill_policy)
            try:
                async with worker.watch():  # a hung prefill worker (mark_hung) is given up on: the next one
                    async with self.decode.session.post(worker.url + path, data=json.dumps(prefill_body).encode(),
                                                        headers=worker.headers(headers)) as response:
                        status, content = response.status, await response.read()
            except UPSTREAM_ERRORS as exc:
                self.prefill.mark_unhealthy(worker, f"prefill request failed: {type(exc).__name__}: {exc}")
                self.metrics.retries.labels("prefill_connect").inc()
                continue
            finally:
                lease.release()
            if status != 200:
                if status == 403 and b"kv_transfer_params" in content:
                    logger.error("prefill worker %s refused the router's signed kv_transfer_params: do the router "
                                 "(--kv-transfer-secret-file) and the workers (kv_connector_extra_config.secret_file) "
                                 "hold the same cluster secret, and do their clocks agree?", worker.url)
                    continue
                if status >= 500:
                    self.metrics.retries.labels("prefill_5xx").inc()
                    continue
                logger.info("request %s: prefill worker answered %d; the decode worker will answer the client",
                            route.request_id, status)
                return None  # the request itself is at fault: the decode worker gives the client its error
            try:
                params = json.loads(content).get("kv_transfer_params")
            except (ValueError, AttributeError):
                params = None
            if not isinstance(params, dict) or not params.get("do_remote_prefill"):
                logger.warning("prefill worker %s returned no kv_transfer_params (is it started with "
                               "--kv-transfer-config kv_producer?)", worker.url)
                return None
            return {k: v for k, v in params.items() if k not in ("auth", "nonce")}, worker

    def _sign(self, params: dict) -> dict:
        """``params`` with a fresh nonce, signed with the cluster secret (a worker takes each signature once)."""
        return sign_params(self._secret, {**params, "nonce": secrets.token_hex(16)})
