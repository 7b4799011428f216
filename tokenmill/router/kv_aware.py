"""``kv_aware``: route to the worker whose KV cache already holds the request's prompt blocks, as
Dynamo's KV router scores workers, under a bounded-load cap (Mirrokni, Thorup, Zadimoghaddam,
"Consistent Hashing with Bounded Loads", SODA 2018).

Cost of worker w for a request of n prompt blocks (units: KV blocks of w's block size)::

    cost(w) = overlap_weight * (n - overlap(w))  +  outstanding_tokens(w) / block_size(w)
              \\-- blocks w would have to prefill --/   \\-- its decode load, in blocks --/

``overlap(w)`` is the number of leading prompt blocks w holds in any tier (the router's KVIndex, fed
by the workers' KV events). The cap: with loads L (outstanding tokens) and a request of r tokens,
only workers with ``L(w) <= (1 + eps) * (sum(L) + r) / G`` may take it; the least loaded worker
always may, so there is always a choice, and every worker's load stays below ``(1 + eps) * mean + r``
whatever the arrivals (the paper's ceil((1 + eps) m / n) for requests of size r). Ties (an idle
fleet) go to the rendezvous-hash winner of the prompt's first block, so a new prefix has one home
before any event arrives. Requests without token ids go to the least loaded worker under the same
cap. Pure Python; no I/O in ``select`` (the index has its own thread); never imports torch.

Predicted blocks: a worker's KV events arrive only once it has computed the prompt, so requests that
share a new prefix and arrive together would all look like misses and spread over the fleet. Each
dispatch therefore also records the request's prompt blocks as *predicted* on its worker for
``predicted_ttl`` seconds (the approximate, TTL-based indexing Dynamo's KV router uses when it has no
events); ``overlap(w)`` is the larger of the event-backed and the predicted overlap. A prediction that
turns out wrong (the worker evicted the blocks) can mislead routing for at most ``predicted_ttl``.
"""
from __future__ import annotations

import functools
import hashlib
import time
from collections import OrderedDict
from typing import Callable

from tokenmill.kv_cache.block_hash import ROOT_HASH, extend_block_hashes, hash_block_tokens
from tokenmill.kv_events.transport import ClientKeys
from tokenmill.router.kv_index import KVIndex
from tokenmill.router.policy import Decision, Policy, RouteRequest, WorkerView

DEFAULT_BLOCK_SIZE = 16  # assumed for workers whose block size is unknown (tokenmill's default)
MAX_PREDICTED_BLOCKS = 1 << 20  # per worker; the oldest predictions go first beyond it


def request_block_hashes(token_ids: tuple[int, ...] | list[int], block_size: int, extra_keys: tuple = ()) -> list[int]:
    """The chained hashes a tokenmill worker gives the prompt's blocks that can be prefix hits: the
    first ``(len - 1) // block_size`` full blocks (the last prompt token is always computed)."""
    num_blocks = max(0, len(token_ids) - 1) // block_size
    hashes: list[int] = []
    extend_block_hashes(hashes, list(token_ids[: num_blocks * block_size]), block_size, extra_keys)
    return hashes


def load_cap(workers: list[WorkerView], request_tokens: int, epsilon: float) -> float:
    """The bounded-load cap in outstanding tokens: ``(1 + eps) x`` the mean load with this request added."""
    return (1.0 + epsilon) * (sum(w.outstanding_tokens for w in workers) + request_tokens) / len(workers)


_MASK64 = 2**64 - 1


@functools.lru_cache(maxsize=4096)
def _worker_seed(worker_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(worker_id.encode(), digest_size=8).digest(), "little")


def _rendezvous(key: int, worker_id: str) -> int:
    """Highest-random-weight hash of (key, worker) (SplitMix64's finaliser over key xor the worker's
    seed): the tie-break that gives each prefix a stable home whatever the order of the workers."""
    x = (key ^ _worker_seed(worker_id)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class KVAwarePolicy(Policy):
    """Least ``overlap_weight x prefill blocks + decode blocks`` among the workers under the load cap.

    Args:
        index: the global KV index (None: a new one, owned and closed by this policy).
        overlap_weight: weight of a block to prefill against a block of decode load (Dynamo's
            ``overlap_score_weight``); 0 ignores the cache (least load under the cap).
        epsilon: the cap's slack: no worker above ``(1 + epsilon) x`` the mean load takes a request.
        endpoints: worker_id or URL -> (endpoint, replay_endpoint), used instead of what the worker's view
            says (the router's ``--kv-events-endpoints``: for addresses the worker cannot know, e.g. NAT).
        predicted_ttl: seconds a dispatched request's prompt blocks count as held by its worker before
            its KV events confirm them (``--kv-predicted-ttl``); 0 trusts the events alone.
        clock: monotonic seconds (tests pass a fake one).
        owns_index: close ``index`` with the policy (default: only the index it made itself).

    Raises:
        ValueError: a negative ``overlap_weight``, ``epsilon`` or ``predicted_ttl``.
    """

    name = "kv_aware"

    def __init__(self, index: KVIndex | None = None, overlap_weight: float = 1.0, epsilon: float = 0.25,
                 endpoints: dict[str, tuple[str, str | None]] | None = None, predicted_ttl: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, owns_index: bool | None = None) -> None:
        if not predicted_ttl >= 0:
            raise ValueError(f"predicted_ttl must be >= 0, got {predicted_ttl}")
        if overlap_weight < 0:
            raise ValueError(f"overlap_weight must be >= 0, got {overlap_weight}")
        if epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon}")
        self._owns_index = index is None if owns_index is None else owns_index
        self.index = index if index is not None else KVIndex()
        self.overlap_weight = overlap_weight
        self.epsilon = epsilon
        self.endpoints = dict(endpoints or {})
        self.predicted_ttl = predicted_ttl
        self._clock = clock
        # worker_id -> (block size, {block hash: expiry}) in insertion order (= expiry order: one ttl).
        self._predicted: dict[str, tuple[int, OrderedDict[int, float]]] = {}
        self._last_hashes: tuple[int, dict[int, list[int]]] | None = None  # (id(request), size -> hashes)
        self._block_sizes: dict[str, int] = {}  # worker_id -> block size, as select() last saw it

    # ---- routing --------------------------------------------------------------------------------
    def select(self, request: RouteRequest, workers: list[WorkerView]) -> Decision:
        cap = load_cap(workers, request.num_prompt_tokens + request.max_tokens, self.epsilon)
        eligible = [w for w in workers if w.outstanding_tokens <= cap]
        assert eligible, "the least loaded worker is always under the cap"
        if request.prompt_token_ids is None:
            best = min(eligible, key=lambda w: (w.outstanding_tokens, w.running_requests, w.worker_id))
            return Decision(best.worker_id, "least_load")
        extra_keys = tuple(request.extra_keys or ())
        by_size: dict[int, tuple[list[int], dict[str, int]]] = {}  # block size -> (hashes, overlaps)
        scored = []
        for w in workers:
            size = self._block_sizes[w.worker_id] = w.block_size or DEFAULT_BLOCK_SIZE
            if size not in by_size:
                hashes = request_block_hashes(request.prompt_token_ids, size, extra_keys)
                ids = [v.worker_id for v in workers if (v.block_size or DEFAULT_BLOCK_SIZE) == size]
                by_size[size] = hashes, self.index.overlaps(hashes, ids) if hashes else {}
            hashes, overlaps = by_size[size]
            overlap = max(overlaps.get(w.worker_id, 0), self._predicted_overlap(w.worker_id, size, hashes))
            cost = self.overlap_weight * (len(hashes) - overlap) + w.outstanding_tokens / size
            scored.append((cost, w, overlap, size))
        eligible_ids = {id(w) for w in eligible}
        tie_key: list[int] = []  # computed on the first tie only

        def pick(items: list[tuple]) -> tuple:
            low = min(item[0] for item in items)
            tied = [item for item in items if item[0] == low]
            if len(tied) == 1:
                return tied[0]
            if not tie_key:
                tie_key.append(self._prefix_key(request, workers))
            return max(tied, key=lambda item: _rendezvous(tie_key[0], item[1].worker_id))

        self._last_hashes = (id(request), {size: hashes for size, (hashes, _) in by_size.items()})
        best_any = pick(scored)
        _, best, overlap, size = pick([item for item in scored if id(item[1]) in eligible_ids])
        if best is not best_any[1]:
            reason = "load_cap"
        else:
            reason = "kv_overlap" if overlap else "cache_miss"
        return Decision(best.worker_id, reason, expected_hit_tokens=overlap * size)

    # ---- predicted blocks -------------------------------------------------------------------------
    def _predicted_overlap(self, worker_id: str, block_size: int, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` predicted on ``worker_id`` and not expired."""
        entry = self._predicted.get(worker_id)
        if entry is None or entry[0] != block_size or not hashes:
            return 0
        now, table, n = self._clock(), entry[1], 0
        for h in hashes:
            expiry = table.get(h)
            if expiry is None or expiry <= now:
                break
            n += 1
        return n

    def on_dispatched(self, request: RouteRequest, decision: Decision) -> None:
        """Record the prompt blocks of ``request`` as predicted on ``decision.worker_id`` (see the module
        docstring); the hashes are the ones ``select`` computed for this request."""
        if self.predicted_ttl == 0 or request.prompt_token_ids is None:
            return
        last, self._last_hashes = self._last_hashes, None
        if last is None or last[0] != id(request):
            return  # not the request select() last scored (e.g. a session override): nothing to reuse
        size = self._block_sizes.get(decision.worker_id, DEFAULT_BLOCK_SIZE)
        hashes = last[1].get(size)
        if not hashes:
            return
        entry = self._predicted.get(decision.worker_id)
        if entry is None or entry[0] != size:  # first prediction for this worker, or its block size changed
            self._predicted[decision.worker_id] = (size, OrderedDict())
        table = self._predicted[decision.worker_id][1]
        now = self._clock()
        expiry = now + self.predicted_ttl
        for h in hashes:
            table[h] = expiry
            table.move_to_end(h)
        while table and (len(table) > MAX_PREDICTED_BLOCKS or next(iter(table.values())) <= now):
            table.popitem(last=False)

    def housekeeping(self) -> None:
        """Drop expired predictions."""
        now = self._clock()
        for _, table in self._predicted.values():
            while table and next(iter(table.values())) <= now:
                table.popitem(last=False)

    @staticmethod
    def _prefix_key(request: RouteRequest, workers: list[WorkerView]) -> int:
        """The rendezvous key: the hash of the prompt's first block (at the smallest block size)."""
        size = min((w.block_size or DEFAULT_BLOCK_SIZE) for w in workers)
        return hash_block_tokens(ROOT_HASH, list(request.prompt_token_ids[:size]), tuple(request.extra_keys or ()))

    # ---- workers --------------------------------------------------------------------------------
    def add_worker(self, worker_id: str, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Subscribe to a worker's KV events."""
        self.index.add_worker(worker_id, endpoint, replay_endpoint)

    def on_worker_added(self, worker: WorkerView) -> None:
        endpoint, replay = (self.endpoints.get(worker.worker_id) or self.endpoints.get(worker.url)
                            or (worker.kv_events_endpoint, worker.kv_events_replay_endpoint))
        if endpoint is not None:
            self.index.add_worker(worker.worker_id, endpoint, replay)

    def on_worker_removed(self, worker_id: str) -> None:
        self.index.remove_worker(worker_id)
        self._predicted.pop(worker_id, None)
        self._block_sizes.pop(worker_id, None)

    def close(self) -> None:
        if self._owns_index:
            self.index.close()


def build_policy(config) -> KVAwarePolicy:
    """The policy from the router's ``PolicyConfig`` (``kv_overlap_weight``, ``load_cap_epsilon``,
    ``kv_events_endpoints``, ``kv_predicted_ttl``, the ``kv_events_curve_*`` certificates).

    Raises:
        ValueError: a CURVE certificate that cannot be used (``transport.TransportKeyError``).
    """
    curve = None
    if config.kv_events_curve_secret_key_file is not None:
        curve = ClientKeys.from_files(config.kv_events_curve_secret_key_file, config.kv_events_curve_server_key_file,
                                      "--kv-events-curve-secret-key-file")
    return KVAwarePolicy(index=KVIndex(curve=curve), overlap_weight=config.kv_overlap_weight,
                         epsilon=config.load_cap_epsilon, endpoints=config.kv_events_endpoints,
                         predicted_ttl=config.kv_predicted_ttl, owns_index=True)
