"""The worker registry: which workers exist, their health, their load, and what kind of server they are.

A worker is ``pending`` until its first health check, then ``healthy`` (``GET /health`` answered 200)
or ``unhealthy`` (anything else, or a failed request). The health loop re-checks every worker each
``--health-check-interval`` seconds, so an unhealthy one is re-admitted once it answers again. On each
admission ``GET /debug/status`` tells a tokenmill worker (it has ``kv_cache`` and ``config``) from a
foreign OpenAI server and gives its KV block size. Load (outstanding tokens, running requests) is the
router's own count of what it sent (``Lease``). No policy logic here; the policy only hears of changes.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx2 as httpx

from tokenmill.router.policy import Policy, RouteRequest, WorkerView

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0


class DuplicateWorker(ValueError):
    """The URL is already registered."""


def normalize_url(url: object) -> str:
    """``http(s)://host[:port][/path]`` without a trailing slash.

    Raises:
        ValueError: not a string, another scheme, no host, credentials, a query or fragment, or a bad port.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"url must be a non-empty string like http://host:port, got {url!r}")
    parts = urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"url has an invalid port: {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must be http://host[:port] or https://host[:port], got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"url must not have a query or fragment, got {url!r}")
    if "@" in parts.netloc:  # the router's own credential is --worker-api-key; a user@host also dodges patterns
        raise ValueError(f"url must not carry credentials (user@host), got {url!r}")
    del port
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def _pattern_regex(pattern: str) -> re.Pattern:
    """``pattern`` as a regex over a normalized URL: ``*`` is any run of characters within one label
    (no ``.``, ``:`` or ``/``, as in a TLS wildcard name), ``?`` one such character; the match may stop
    at the end of the URL or before a ``:`` or ``/`` (so ``http://10.0.0.5`` covers
    ``http://10.0.0.5:8000`` but not ``http://10.0.0.55`` or ``http://10.0.0.5.evil.example``)."""
    text = pattern.strip().lower().rstrip("/")
    body = "".join("[^./:]*" if c == "*" else "[^./:]" if c == "?" else re.escape(c) for c in text)
    return re.compile(f"{body}(?:[:/].*)?", re.DOTALL)


class WorkerURLPolicy:
    """Which URLs ``POST /workers`` may register (``--allowed-worker-urls``): each pattern is an
    fnmatch-style glob or a prefix (see ``_pattern_regex``), and the workers given on the command line
    are always allowed. No patterns: any URL.

    Raises:
        ValueError: an empty pattern, or one that is not an http(s) URL pattern.
    """

    def __init__(self, patterns: tuple[str, ...] | None, implicit_urls: tuple[str, ...] = ()) -> None:
        self.patterns = None if patterns is None else tuple(patterns)
        for pattern in self.patterns or ():
            if not pattern.strip().lower().startswith(("http://", "https://")):
                raise ValueError(f"--allowed-worker-urls: a pattern starts with http:// or https://, got {pattern!r}")
        self._regexes = [_pattern_regex(p) for p in self.patterns or ()]
        self.implicit = frozenset(normalize_url(u) for u in implicit_urls)  # the command line's workers

    def allows(self, url: str) -> bool:
        """Whether the normalized ``url`` may be registered."""
        if self.patterns is None or url in self.implicit:
            return True
        return any(r.fullmatch(url.lower()) for r in self._regexes)


@dataclass(eq=False)
class Worker:
    """One worker and the router's live view of it (mutated on the event loop only)."""

    worker_id: str
    url: str
    state: str = "pending"  # pending | healthy | unhealthy
    outstanding_tokens: int = 0
    running_requests: int = 0
    is_tokenmill: bool = False
    block_size: int | None = None
    kv_events_endpoint: str | None = None  # where a tokenmill worker publishes KV events (kv_aware subscribes)
    kv_events_replay_endpoint: str | None = None
    model_path: str | None = None  # a tokenmill worker's tokenizer or model path (None: the embedded model)
    last_error: str | None = None
    trusted: bool = True  # gets the router's --worker-api-key (see WorkerRegistry.add)

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` to send this worker: without ``Authorization`` unless it is ``trusted``."""
        if self.trusted:
            return headers
        return {k: v for k, v in headers.items() if k.lower() != "authorization"}

    def view(self) -> WorkerView:
        return WorkerView(worker_id=self.worker_id, url=self.url, healthy=self.state == "healthy",
                          outstanding_tokens=self.outstanding_tokens, running_requests=self.running_requests,
                          is_tokenmill=self.is_tokenmill, block_size=self.block_size,
                          kv_events_endpoint=self.kv_events_endpoint,
                          kv_events_replay_endpoint=self.kv_events_replay_endpoint)

    def as_json(self) -> dict:
        return {"id": self.worker_id, "url": self.url, "state": self.state,
                "outstanding_tokens": self.outstanding_tokens, "running_requests": self.running_requests,
                "is_tokenmill": self.is_tokenmill, "block_size": self.block_size,
                "kv_events_endpoint": self.kv_events_endpoint, "last_error": self.last_error}


class Lease:
    """One request's claim on a worker: adds its tokens to the worker's load until ``release`` (idempotent),
    which also tells the policy the request finished."""

    def __init__(self, worker: Worker, request: RouteRequest, tokens: int, policy: Policy) -> None:
        self.worker, self.request, self.tokens, self.policy = worker, request, tokens, policy
        self.released = False
        worker.outstanding_tokens += tokens
        worker.running_requests += 1

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.worker.outstanding_tokens -= self.tokens
        self.worker.running_requests -= 1
        self.policy.on_finished(self.request, self.worker.worker_id)


class WorkerRegistry:
    """The workers by id (registration order), their health checks and tokenmill detection."""

    def __init__(self, client: httpx.AsyncClient, policy: Policy, api_key: str | None = None) -> None:
        """``api_key``: the router's credential for the workers (``--worker-api-key``), sent on control
        calls (``/debug/status``, ``/v1/models``) as ``auth``; never a client's key."""
        self.client = client
        self.policy = policy
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.workers: dict[str, Worker] = {}
        self._ids = itertools.count()

    def add(self, url: object, trusted: bool = True) -> Worker:
        """Register ``url`` as ``pending`` (not routable until a health check passes). ``trusted``: the
        worker gets the router's credential (``--worker-api-key``); False for a worker registered at run
        time by a party the router did not authenticate as its administrator (docs/router.md).

        Raises:
            ValueError: a malformed URL; DuplicateWorker: already registered.
        """
        url = normalize_url(url)
        for worker in self.workers.values():
            if worker.url == url:
                raise DuplicateWorker(f"worker {url} is already registered as {worker.worker_id}")
        worker = Worker(worker_id=f"worker-{next(self._ids)}", url=url, trusted=trusted)
        self.workers[worker.worker_id] = worker
        logger.info("worker %s added: %s", worker.worker_id, url)
        return worker

    def remove(self, worker_id: str) -> Worker:
        """Unregister a worker; requests in flight on it keep their ``Lease`` and finish.

        Raises:
            KeyError: unknown ``worker_id``.
        """
        worker = self.workers.pop(worker_id)
        self.policy.on_worker_removed(worker_id)
        logger.info("worker %s removed: %s", worker_id, worker.url)
        return worker

    def get(self, worker_id: str) -> Worker | None:
        return self.workers.get(worker_id)

    def routable(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.state == "healthy"]

    def mark_unhealthy(self, worker: Worker, why: str) -> None:
        """Take ``worker`` out of routing until a health check passes (the policy forgets it)."""
        worker.last_error = why
        if worker.state == "unhealthy":
            return
        was_routable = worker.state == "healthy"
        worker.state = "unhealthy"
        logger.warning("worker %s (%s) unhealthy: %s", worker.worker_id, worker.url, why)
        if was_routable and worker.worker_id in self.workers:
            self.policy.on_worker_removed(worker.worker_id)

    async def check(self, worker: Worker) -> None:
        """One health check: ``GET /health``; on (re)admission, detect tokenmill and its block size."""
        try:
            response = await self.client.get(f"{worker.url}/health", timeout=HEALTH_TIMEOUT_S)
            ok, why = response.status_code == 200, f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            ok, why = False, f"/health failed: {type(exc).__name__}: {exc}"
        if worker.worker_id not in self.workers:
            return  # removed while we waited
        if not ok:
            self.mark_unhealthy(worker, why)
            return
        if worker.state != "healthy":
            await self._detect(worker)
            if worker.worker_id not in self.workers:
                return
            worker.state, worker.last_error = "healthy", None
            logger.info("worker %s (%s) healthy (tokenmill: %s)", worker.worker_id, worker.url, worker.is_tokenmill)
            self.policy.on_worker_added(worker.view())

    async def _detect(self, worker: Worker) -> None:
        """tokenmill answers ``/debug/status`` with its engine config and KV pool (and where it publishes
        KV events, if it does); others do not."""
        worker.is_tokenmill, worker.block_size = False, None
        worker.kv_events_endpoint = worker.kv_events_replay_endpoint = None
        try:
            response = await self.client.get(f"{worker.url}/debug/status", headers=worker.headers(self.auth),
                                             timeout=HEALTH_TIMEOUT_S)
            status = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            status = None
        if isinstance(status, dict) and isinstance(status.get("kv_cache"), dict) and "config" in status:
            block_size = status["kv_cache"].get("block_size")
            worker.is_tokenmill = True
            worker.block_size = block_size if isinstance(block_size, int) else None
            config = status["config"] if isinstance(status["config"], dict) else {}
            model_path = config.get("tokenizer") or config.get("model")
            worker.model_path = model_path if isinstance(model_path, str) else None
            kv_events = status.get("kv_events")
            if isinstance(kv_events, dict) and kv_events.get("enabled"):
                from tokenmill.router.kv_index import kv_event_endpoints  # here only: it imports zmq

                endpoints = kv_event_endpoints(status, worker.url)
                worker.kv_events_endpoint, worker.kv_events_replay_endpoint = endpoints

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))

    async def health_loop(self, interval: float) -> None:
        """Check every worker each ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop health checking
                logger.exception("health check round failed")
