"""The worker registry: which workers exist, their health, their load, and what kind of server they are.

A worker is ``pending`` until its first health check, then ``healthy`` (``GET /health`` answered 200
within ``--health-check-timeout-secs``) or ``unhealthy`` (anything else, or a failed request). The health
loop checks every worker each ``--health-check-interval-secs`` seconds, each on its own (a hung worker
holds up only its own checks), so an unhealthy one is re-admitted once it answers again. A worker whose
check times out while none of its streams sent anything for as long is *hung* (a stopped process still
accepts connections): every exchange with it in flight (``Watch``) is interrupted, so its requests are
retried or resumed elsewhere. On each
admission ``GET /debug/status`` tells a tokenmill worker (it has ``kv_cache`` and ``config``) from a
foreign OpenAI server and gives its KV block size. Load (outstanding tokens, running requests) is the
router's own count of what it sent (``Lease``). A worker that answers ``/health`` but ``GET /ready`` with
503 (a tokenmill server draining on SIGTERM), or one drained with ``POST /workers/{id}/drain``, is
``draining``: it gets no new request while those in flight finish. No policy logic here; the policy only
hears of changes.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx2 as httpx

from tokenmill.router.policy import Policy, RouteRequest, WorkerView

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0  # control calls (/debug/status, /v1/models, /detokenize)
HEALTH_CHECK_TIMEOUT_S = 3.0  # default --health-check-timeout-secs
HEALTH_CHECK_INTERVAL_S = 1.0  # default --health-check-interval-secs


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
    state: str = "pending"  # pending | healthy | draining | unhealthy
    outstanding_tokens: int = 0
    running_requests: int = 0
    is_tokenmill: bool = False
    block_size: int | None = None
    kv_events_endpoint: str | None = None  # where a tokenmill worker publishes KV events (kv_aware subscribes)
    kv_events_replay_endpoint: str | None = None
    model_path: str | None = None  # a tokenmill worker's tokenizer or model path (None: the embedded model)
    last_error: str | None = None
    trusted: bool = True  # gets the router's --worker-api-key (see WorkerRegistry.add)
    drain_requested: bool = False  # POST /workers/{id}/drain: kept out of routing until undrained
    last_data_at: float = float("-inf")  # event-loop time of the last stream event read from it
    watches: set[Watch] = field(default_factory=set, repr=False)  # its exchanges in flight

    def watch(self, stall_s: float | None = None) -> Watch:
        """A ``Watch`` over one exchange with this worker (see there)."""
        return Watch(self, stall_s)

    def interrupt(self, reason: str) -> int:
        """Expire every ``Watch`` in flight on this worker (it is hung); returns how many."""
        watches = list(self.watches)
        for watch in watches:
            watch.expire(reason)
        return len(watches)

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
                "kv_events_endpoint": self.kv_events_endpoint, "last_error": self.last_error,
                "drain_requested": self.drain_requested}


class Watch:
    """An async context over one exchange with a worker (send, headers, body or stream): the block is
    cancelled and ``async with`` raises ``TimeoutError`` (``expired`` true, ``reason`` says why) when the
    worker is found hung (``Worker.interrupt``) or, with ``stall_s``, when no ``touch`` came for
    ``stall_s`` seconds after the first one (a stream's inter-event stall; the wait for the first event
    is not bounded, since a request may queue on a busy worker). ``touch`` costs one clock read.
    """

    __slots__ = ("worker", "stall_s", "reason", "last", "_loop", "_timeout", "_handle")

    def __init__(self, worker: Worker, stall_s: float | None = None) -> None:
        self.worker, self.stall_s = worker, stall_s
        self.reason: str | None = None
        self.last = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timeout: asyncio.Timeout | None = None
        self._handle: asyncio.TimerHandle | None = None

    @property
    def expired(self) -> bool:
        return self._timeout is not None and self._timeout.expired()

    async def __aenter__(self) -> Watch:
        self._loop = asyncio.get_running_loop()
        self._timeout = asyncio.timeout(None)
        await self._timeout.__aenter__()
        self.worker.watches.add(self)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool | None:
        self.worker.watches.discard(self)
        if self._handle is not None:
            self._handle.cancel()
        return await self._timeout.__aexit__(exc_type, exc, tb)

    def touch(self) -> None:
        """An event arrived: the worker is alive; the stall clock starts again."""
        self.last = self.worker.last_data_at = self._loop.time()
        if self._handle is None and self.stall_s is not None:
            self._handle = self._loop.call_at(self.last + self.stall_s, self._check_stall)

    def _check_stall(self) -> None:
        if self._loop.time() - self.last >= self.stall_s:
            self._handle = None
            self.expire(f"no stream event for {self.stall_s:g} s")
        else:
            self._handle = self._loop.call_at(self.last + self.stall_s, self._check_stall)

    def expire(self, reason: str) -> None:
        """Cancel the block now (idempotent; the first reason stays)."""
        if self.reason is None and self._timeout is not None and not self._timeout.expired():
            self.reason = reason
            self._timeout.reschedule(self._loop.time())


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

    def __init__(self, client: httpx.AsyncClient, policy: Policy, api_key: str | None = None,
                 health_check_timeout: float = HEALTH_CHECK_TIMEOUT_S) -> None:
        """``api_key``: the router's credential for the workers (``--worker-api-key``), sent on control
        calls (``/debug/status``, ``/v1/models``) as ``auth``; never a client's key.
        ``health_check_timeout``: seconds a ``GET /health`` may take (``--health-check-timeout-secs``)."""
        self.client = client
        self.policy = policy
        self.health_check_timeout = health_check_timeout
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

    def mark_draining(self, worker: Worker, why: str) -> None:
        """Take ``worker`` out of routing while it drains (its requests in flight go on; the policy forgets it)."""
        if worker.state == "draining":
            return
        was_routable = worker.state == "healthy"
        worker.state = "draining"
        logger.info("worker %s (%s) draining: %s", worker.worker_id, worker.url, why)
        if was_routable and worker.worker_id in self.workers:
            self.policy.on_worker_removed(worker.worker_id)

    def drain(self, worker_id: str) -> Worker:
        """``POST /workers/{id}/drain``: send the worker no new request until ``undrain``; its requests in
        flight finish (streams included).

        Raises:
            KeyError: unknown ``worker_id``.
        """
        worker = self.workers[worker_id]
        worker.drain_requested = True
        if worker.state != "unhealthy":  # an unhealthy one turns draining once it answers again
            self.mark_draining(worker, "drained by the administrator")
        return worker

    async def undrain(self, worker_id: str) -> Worker:
        """``POST /workers/{id}/undrain``: route to the worker again once a health check (run now) passes.

        Raises:
            KeyError: unknown ``worker_id``.
        """
        worker = self.workers[worker_id]
        worker.drain_requested = False
        await self.check(worker)
        return worker

    async def _ready(self, worker: Worker) -> bool:
        """False when the worker answers ``GET /ready`` with 503 (a tokenmill server draining on SIGTERM); a
        server without ``/ready`` (404) or a failed request counts as ready (its ``/health`` decides)."""
        try:
            response = await self.client.get(f"{worker.url}/ready", timeout=self.health_check_timeout)
        except httpx.HTTPError:
            return True
        return response.status_code != 503

    def mark_hung(self, worker: Worker, why: str) -> None:
        """``mark_unhealthy``, and interrupt every exchange in flight on ``worker`` (``Watch``): requests
        not yet answered are retried on other workers, streams resumed."""
        self.mark_unhealthy(worker, why)
        interrupted = worker.interrupt(why)
        if interrupted:
            logger.warning("worker %s (%s) hung: moving its %d request(s) in flight elsewhere", worker.worker_id,
                           worker.url, interrupted)

    async def check(self, worker: Worker) -> None:
        """One health check: ``GET /health``; on (re)admission, detect tokenmill and its block size. A check
        that times out while no stream of the worker sent anything for as long marks it hung (``mark_hung``);
        one that times out while its streams flow changes nothing (a busy worker, not a hung one)."""
        hung = False
        try:
            response = await self.client.get(f"{worker.url}/health", timeout=self.health_check_timeout)
            ok, why = response.status_code == 200, f"/health answered {response.status_code}"
        except httpx.TimeoutException as exc:
            if asyncio.get_running_loop().time() - worker.last_data_at < self.health_check_timeout:
                return  # slow to answer, but its streams flow: alive, and left as it is
            ok, hung = False, True
            why = f"/health did not answer within {self.health_check_timeout:g} s ({type(exc).__name__})"
        except httpx.HTTPError as exc:
            ok, why = False, f"/health failed: {type(exc).__name__}: {exc}"
        if worker.worker_id not in self.workers:
            return  # removed while we waited
        if hung:
            self.mark_hung(worker, why)
            return
        if not ok:
            self.mark_unhealthy(worker, why)
            return
        ready = worker.drain_requested or await self._ready(worker)
        if worker.worker_id not in self.workers:
            return
        if worker.drain_requested or not ready:
            self.mark_draining(worker, "drained by the administrator" if worker.drain_requested
                               else "/ready answered 503 (the worker is shutting down)")
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
        KV events, if it does); others do not. A worker that does not answer keeps what was known of it
        (a busy tokenmill worker re-admitted is still one, so its streams stay resumable)."""
        try:
            response = await self.client.get(f"{worker.url}/debug/status", headers=worker.headers(self.auth),
                                             timeout=HEALTH_TIMEOUT_S)
            status = response.json() if response.status_code == 200 else None
        except httpx.TransportError:
            return
        except (httpx.HTTPError, ValueError):
            status = None
        worker.is_tokenmill, worker.block_size = False, None
        worker.kv_events_endpoint = worker.kv_events_replay_endpoint = None
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

    async def _check_logged(self, worker: Worker) -> None:
        try:
            await self.check(worker)
        except Exception:  # a bug here must not stop health checking
            logger.exception("health check of %s failed", worker.worker_id)

    async def health_loop(self, interval: float) -> None:
        """Check every worker each ``interval`` seconds until cancelled. Checks run side by side: one that
        waits for a hung worker delays no other worker's, and a worker is not checked again while its last
        check runs (so a hung worker is found within ``interval`` + the health-check timeout)."""
        running: dict[str, asyncio.Task] = {}
        try:
            while True:
                await asyncio.sleep(interval)
                for worker in list(self.workers.values()):
                    if worker.worker_id not in running:
                        task = asyncio.ensure_future(self._check_logged(worker))
                        running[worker.worker_id] = task
                        task.add_done_callback(lambda _, key=worker.worker_id: running.pop(key, None))
        finally:
            for task in list(running.values()):
                task.cancel()
