"""The routing-policy contract: what a policy sees of a request and of the workers, and what it returns.

Pure Python, no I/O, no asyncio: the front end calls ``select`` on the event loop for every request, so
a policy must answer in microseconds (no network, no sleeping) and keep its own state small.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


class NoWorkerAvailable(RuntimeError):
    """No healthy worker can take the request (the front end answers 503)."""


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows about one incoming request.

    request_id: the router's id for it (also sent to the worker).
    text: the prompt text (completions) or the messages' contents joined in order (chat): what
        ``cache_aware``'s approximate prefix tree matches on (characters, as SGLang's router).
    prompt_token_ids: the prompt as the workers will tokenize it (chat template applied), when the
        router could tokenize it; None otherwise (policies that need tokens then fall back).
    num_prompt_tokens: prompt length in tokens (exact when ``prompt_token_ids`` is set, else an estimate).
    max_tokens: the request's output budget (its share of a worker's outstanding tokens).
    session_id: the ``user`` field or the ``X-Session-Id`` header; requests of one session stick to
        one worker (unless that worker's load is over the cap).
    extra_keys: prefix-cache extra keys the worker will use for this request (cache_salt, adapter
        digest), so a policy that hashes blocks hashes them the same way; None if unknown.
    """

    request_id: str
    text: str
    prompt_token_ids: tuple[int, ...] | None
    num_prompt_tokens: int
    max_tokens: int
    session_id: str | None = None
    extra_keys: tuple | None = None


@dataclass(frozen=True)
class WorkerView:
    """A worker as policies see it (a snapshot taken when ``select`` is called).

    worker_id: stable id in the registry; url: its base URL.
    healthy: passed its last health check (unhealthy workers are never passed to ``select``, kept
        here for completeness).
    outstanding_tokens: prompt + max_tokens of the requests routed to it and not finished yet (the
        load measure of ``least_load``, the cap and ``kv_aware``; tokens, not requests).
    running_requests: requests routed to it and not finished yet.
    is_tokenmill: a tokenmill worker (publishes KV events, accepts tokenmill's extra fields); foreign
        OpenAI servers get only the policies that need nothing from them.
    block_size: the worker's KV block size, when known (tokenmill workers).
    kv_events_endpoint, kv_events_replay_endpoint: where the worker publishes its KV events and serves
        replays, as addresses the router can connect to (``tokenmill.router.kv_index.kv_event_endpoints``
        reads them from the worker's ``/debug/status``); None when it publishes none.
    """

    worker_id: str
    url: str
    healthy: bool
    outstanding_tokens: int
    running_requests: int
    is_tokenmill: bool = False
    block_size: int | None = None
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why: ``reason`` is a short label counted by the router's metrics
    (e.g. "round_robin", "least_load", "cache_hit", "cache_miss", "imbalance", "kv_overlap",
    "load_cap", "session"). ``expected_hit_tokens`` is the policy's estimate of prompt tokens the
    worker already holds (0 when it has no idea)."""

    worker_id: str
    reason: str
    expected_hit_tokens: int = 0


class Policy(ABC):
    """A routing policy. The front end calls ``select`` for each request with the healthy workers
    (never empty: it raises NoWorkerAvailable itself), then ``on_dispatched`` once the request is
    sent, and ``on_finished`` when it ends (success, error or abort); ``on_worker_removed`` when a
    worker leaves the registry or fails its health checks, ``on_worker_added`` when one becomes routable;
    ``housekeeping`` periodically and ``close`` at shutdown. Every hook but ``select`` defaults to nothing."""

    name: str = ""

    @abstractmethod
    def select(self, request: RouteRequest, workers: list[WorkerView]) -> Decision:
        """Pick one of ``workers`` (non-empty, all healthy) for ``request``."""

    def on_dispatched(self, request: RouteRequest, decision: Decision) -> None:
        """The request was sent to ``decision.worker_id`` (update prefix trees, session maps...)."""

    def on_finished(self, request: RouteRequest, worker_id: str) -> None:
        """The request ended on ``worker_id``."""

    def on_worker_removed(self, worker_id: str) -> None:
        """Forget everything about ``worker_id``."""

    def on_worker_added(self, worker: WorkerView) -> None:
        """``worker`` became routable: it joined the registry healthy, or passed its health checks again
        after ``on_worker_removed`` (its cache may have been lost in between)."""

    def housekeeping(self) -> None:
        """Periodic maintenance (tree eviction...), called on the event loop every
        ``--eviction-interval`` seconds; must stay as cheap as ``select``'s budget allows."""

    def close(self) -> None:
        """Release what the policy holds (threads, sockets) when the router shuts down."""
