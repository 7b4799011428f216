"""The router's non-KV routing policies, session affinity, the bounded-load cap, and the factory.

``round_robin``, ``least_load`` (outstanding tokens), ``power_of_two`` and ``cache_aware`` (SGLang's
rule over an approximate prefix tree of request text). ``make_policy`` wraps every policy in
``SessionAffinity``, so requests of one session (``user`` or ``X-Session-Id``) stick to one worker
while ``bounded_load_ok`` allows it. ``kv_aware`` lives in ``kv_aware.py``, imported only when asked
for. Pure Python, no I/O, no asyncio (see policy.py): a ``select`` costs microseconds.
"""
from __future__ import annotations

import hashlib
import importlib
import random
from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.router.policy import Decision, Policy, RouteRequest, WorkerView
from tokenmill.router.prefix_tree import PrefixTree

POLICY_NAMES = ("round_robin", "least_load", "power_of_two", "cache_aware", "kv_aware")


@dataclass(frozen=True)
class PolicyConfig:
    """What the policies are built from (the router's flags of the same names).

    cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_size (characters per
    worker), eviction_interval (seconds): ``cache_aware``'s knobs, named and defaulted as SGLang's
    router. load_cap_epsilon: the ε of ``bounded_load_ok``. seed: ``power_of_two``'s random choices.
    kv_overlap_weight: ``kv_aware``'s weight of a block to prefill against a block of decode load.
    kv_events_endpoints: worker URL or id -> (KV events endpoint, replay endpoint or None), for
    workers whose ``/debug/status`` does not give an address the router can reach.
    kv_predicted_ttl: ``kv_aware``: seconds a dispatched prompt's blocks count as held by its worker
    before KV events confirm them (0: events only).
    kv_events_curve_secret_key_file, kv_events_curve_server_key_file: ``kv_aware``: the router's CURVE
    certificate (secret half) and the workers' public certificate, to subscribe to publishers that
    require CURVE (None: plain sockets; docs/kv_events.md).
    """

    name: str = "cache_aware"
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    max_tree_size: int = 2**24
    eviction_interval: float = 60.0
    load_cap_epsilon: float = 0.25
    seed: int | None = None
    kv_overlap_weight: float = 1.0
    kv_events_endpoints: dict[str, tuple[str, str | None]] | None = None
    kv_predicted_ttl: float = 10.0
    kv_events_curve_secret_key_file: str | None = None
    kv_events_curve_server_key_file: str | None = None

    def __post_init__(self) -> None:
        if self.name not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {', '.join(POLICY_NAMES)}, got {self.name!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        if self.max_tree_size < 1:
            raise ValueError(f"max_tree_size must be >= 1, got {self.max_tree_size}")
        if not self.eviction_interval > 0:
            raise ValueError(f"eviction_interval must be > 0, got {self.eviction_interval}")
        if self.load_cap_epsilon < 0:
            raise ValueError(f"load_cap_epsilon must be >= 0, got {self.load_cap_epsilon}")
        if not self.kv_overlap_weight >= 0:
            raise ValueError(f"kv_overlap_weight must be >= 0, got {self.kv_overlap_weight}")
        if not self.kv_predicted_ttl >= 0:
            raise ValueError(f"kv_predicted_ttl must be >= 0, got {self.kv_predicted_ttl}")
        if (self.kv_events_curve_secret_key_file is None) != (self.kv_events_curve_server_key_file is None):
            raise ValueError("kv_events_curve_secret_key_file and kv_events_curve_server_key_file go together")


def session_key(session_id: str) -> bytes:
    """The key a session is remembered under: a 16-byte BLAKE2b digest of its id, so a session map's size
    does not depend on how long clients make their ids."""
    return hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def request_tokens(request: RouteRequest) -> int:
    """A request's share of a worker's outstanding tokens: prompt + output budget."""
    return request.num_prompt_tokens + request.max_tokens


def bounded_load_ok(worker: WorkerView, workers: list[WorkerView], request_tokens: int, epsilon: float) -> bool:
    """The bounded-load cap (consistent hashing with bounded loads, Mirrokni et al.): may ``worker``
    take a request of ``request_tokens`` tokens?

    True when the worker's outstanding tokens do not exceed ``(1 + epsilon)`` times the mean
    outstanding tokens of ``workers`` counted with this request added, i.e.
    ``load(worker) <= (1 + eps) * (sum(load) + request_tokens) / len(workers)``. The worker's own load
    is taken before the request, so an idle fleet accepts anything and one worker alone is always ok.
    Shared by session affinity and ``kv_aware``.
    """
    assert workers, "bounded_load_ok needs the candidate workers"
    mean = (sum(w.outstanding_tokens for w in workers) + request_tokens) / len(workers)
    return worker.outstanding_tokens <= (1.0 + epsilon) * mean


class RoundRobin(Policy):
    """Each request to the next worker in registry order."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, request: RouteRequest, workers: list[WorkerView]) -> Decision:
        worker = workers[self._next % len(workers)]
        self._next += 1
        return Decision(worker.worker_id, "round_robin")


class LeastLoad(Policy):
    """The worker with the fewest outstanding tokens (prompt + max_tokens of unfinished requests);
    ties go to fewer running requests, then rotate, so an idle fleet is still spread."""

    name = "least_load"

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, workers: list[WorkerView]) -> WorkerView:
        best = min((w.outstanding_tokens, w.running_requests) for w in workers)
        tied = [w for w in workers if (w.outstanding_tokens, w.running_requests) == best]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def select(self, request: RouteRequest, workers: list[WorkerView]) -> Decision:
        return Decision(self.pick(workers).worker_id, "least_load")


class PowerOfTwo(Policy):
    """Two distinct random workers; the one with fewer outstanding tokens (the first on a tie)."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, request: RouteRequest, workers: list[WorkerView]) -> Decision:
        if len(workers) == 1:
            return Decision(workers[0].worker_id, "power_of_two")
        a, b = self._rng.sample(workers, 2)
        return Decision((b if b.outstanding_tokens < a.outstanding_tokens else a).worker_id, "power_of_two")


class CacheAware(Policy):
    """SGLang's cache-aware rule over an approximate prefix tree of the request text sent to each worker.

    1. Imbalanced (``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``,
       over running requests, SGLang's unit, so its defaults mean the same) → least outstanding tokens
       (reason ``imbalance``).
    2. Else the longest prefix match; if matched/len(text) ≥ ``cache_threshold`` → that worker
       (``cache_hit``), else the worker whose tree is smallest, i.e. with the most free cache
       (``cache_miss``). The text is then inserted into the chosen worker's tree.
    Works for any worker (text only). ``housekeeping`` evicts each tree down to ``max_tree_size``
    characters (LRU leaves); an insert that takes a tree past twice that evicts at once.
    """

    name = "cache_aware"

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.tree = PrefixTree()
        self._least_load = LeastLoad()

    def imbalanced(self, workers: list[WorkerView]) -> bool:
        loads = [w.running_requests for w in workers]
        high, low = max(loads), min(loads)
        return high - low > self.config.balance_abs_threshold and high > self.config.balance_rel_threshold * low

    def select(self, request: RouteRequest, workers: list[WorkerView]) -> Decision:
        if self.imbalanced(workers):
            worker = self._least_load.pick(workers)
            return Decision(worker.worker_id, "imbalance", self.expected_hit_tokens(request, worker.worker_id))
        matched = self.tree.match(request.text)
        order = {w.worker_id: i for i, w in enumerate(workers)}
        best = max(workers, key=lambda w: (matched.get(w.worker_id, 0), -w.outstanding_tokens, -order[w.worker_id]))
        best_chars = matched.get(best.worker_id, 0)
        if best_chars > 0 and best_chars / len(request.text) >= self.config.cache_threshold:
            return Decision(best.worker_id, "cache_hit", self._chars_to_tokens(request, best_chars))
        emptiest = min(workers, key=lambda w: (self.tree.size(w.worker_id), w.outstanding_tokens, order[w.worker_id]))
        return Decision(emptiest.worker_id, "cache_miss", self._chars_to_tokens(request, matched.get(emptiest.worker_id, 0)))

    def expected_hit_tokens(self, request: RouteRequest, worker_id: str) -> int:
        """Estimated prompt tokens ``worker_id`` holds for ``request`` (matched share of the prompt)."""
        return self._chars_to_tokens(request, self.tree.match(request.text).get(worker_id, 0))

    @staticmethod
    def _chars_to_tokens(request: RouteRequest, chars: int) -> int:
        return round(request.num_prompt_tokens * chars / len(request.text)) if request.text else 0

    def on_dispatched(self, request: RouteRequest, decision: Decision) -> None:
        self.tree.insert(request.text, decision.worker_id)
        if self.tree.size(decision.worker_id) > 2 * self.config.max_tree_size:
            self.tree.evict(decision.worker_id, self.config.max_tree_size)

    def on_worker_removed(self, worker_id: str) -> None:
        self.tree.remove_tenant(worker_id)

    def housekeeping(self) -> None:
        self.tree.evict_all(self.config.max_tree_size)


class SessionAffinity(Policy):
    """Wraps a policy: a request with a ``session_id`` goes to the worker that served its session last,
    unless that worker is gone or over the load cap (``bounded_load_ok``); otherwise the wrapped
    policy decides (reason ``load_cap`` when the cap overrode the session). Remembers at most
    ``max_sessions`` sessions (least recently used forgotten first), each under its ``session_key``."""

    def __init__(self, inner: Policy, epsilon: float, max_sessions: int = 65536) -> None:
        self.inner = inner
        self.name = inner.name
        self.epsilon = epsilon
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[bytes, str] = OrderedDict()  # session_key(session_id) -> worker_id

    def select(self, request: RouteRequest, workers: list[WorkerView]) -> Decision:
        worker_id = self.sessions.get(session_key(request.session_id)) if request.session_id is not None else None
        worker = next((w for w in workers if w.worker_id == worker_id), None)
        if worker is None:
            return self.inner.select(request, workers)
        if bounded_load_ok(worker, workers, request_tokens(request), self.epsilon):
            estimate = getattr(self.inner, "expected_hit_tokens", None)
            return Decision(worker.worker_id, "session", estimate(request, worker.worker_id) if estimate else 0)
        decision = self.inner.select(request, workers)
        return Decision(decision.worker_id, "load_cap", decision.expected_hit_tokens)

    def on_dispatched(self, request: RouteRequest, decision: Decision) -> None:
        if request.session_id is not None:
            key = session_key(request.session_id)
            self.sessions[key] = decision.worker_id
            self.sessions.move_to_end(key)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        self.inner.on_dispatched(request, decision)

    def on_finished(self, request: RouteRequest, worker_id: str) -> None:
        self.inner.on_finished(request, worker_id)

    def on_worker_added(self, worker: WorkerView) -> None:
        self.inner.on_worker_added(worker)

    def on_worker_removed(self, worker_id: str) -> None:
        self.inner.on_worker_removed(worker_id)  # sessions pointing at it fall through lazily

    def housekeeping(self) -> None:
        self.inner.housekeeping()

    def close(self) -> None:
        self.inner.close()


def make_policy(config: PolicyConfig) -> Policy:
    """The policy ``config.name`` names, wrapped in ``SessionAffinity``.

    ``kv_aware`` is imported from ``tokenmill.router.kv_aware`` only here; that module provides
    ``build_policy(config: PolicyConfig) -> Policy``.

    Raises:
        ValueError: ``kv_aware`` asked for but its module is not part of this build.
    """
    if config.name == "round_robin":
        inner: Policy = RoundRobin()
    elif config.name == "least_load":
        inner = LeastLoad()
    elif config.name == "power_of_two":
        inner = PowerOfTwo(config.seed)
    elif config.name == "cache_aware":
        inner = CacheAware(config)
    else:
        assert config.name == "kv_aware"
        try:
            kv_aware = importlib.import_module("tokenmill.router.kv_aware")
        except ModuleNotFoundError as exc:
            if exc.name != "tokenmill.router.kv_aware":
                raise
            raise ValueError("policy kv_aware is not available in this build (tokenmill/router/kv_aware.py is "
                             "missing); choose round_robin, least_load, power_of_two or cache_aware") from None
        inner = kv_aware.build_policy(config)
    return SessionAffinity(inner, config.load_cap_epsilon)
