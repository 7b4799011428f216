"""Load-balance simulator for the routing policies: no model, no network, deterministic per seed.

A batch of B requests arrives at G idle workers and stays in flight (nothing finishes: the worst
case for balance); each request is routed by a policy that sees the workers' outstanding tokens, and
every worker caches the prompts it is sent (an unbounded cache, reported to ``kv_aware``'s KVIndex as
KV events would be). The result is the max/mean load imbalance, the prefix-hit share and, for the
bounded-load policy, whether every assignment respected the cap.

Arrival patterns: ``uniform`` (equal sizes, many tenants: balls into bins), ``pareto`` (heavy-tailed
output budgets, Pareto alpha 1.5), ``hot_prefix`` (every request shares one system prompt: what a
cache-affinity rule piles onto one worker), ``rr_adversary`` (every G-th request is G times larger:
round robin sends all of them to one worker). Used by tests/test_router_sim.py and
benchmarks/router_sim.py. Never imports torch.
"""
from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from tokenmill.kv_events.events import BlockStored
from tokenmill.router.kv_aware import KVAwarePolicy, load_cap, request_block_hashes
from tokenmill.router.kv_index import KVIndex
from tokenmill.router.policies import CacheAware, LeastLoad, PolicyConfig, PowerOfTwo, RoundRobin
from tokenmill.router.policy import Decision, Policy, RouteRequest, WorkerView

BLOCK_SIZE = 16
PREFIX_TOKENS = 64  # a tenant's system prompt: 4 blocks
SUFFIX_TOKENS = 17  # the request's own question (so 5 blocks can hit at most; the last token is computed)
BASE_SIZE = 128  # prompt + output budget of an ordinary request, in tokens
PATTERNS = ("uniform", "pareto", "hot_prefix", "rr_adversary")
POLICIES = ("random", "round_robin", "least_load", "power_of_two", "cache_aware", "kv_aware", "kv_affinity",
            "kv_affinity_uncapped")
AFFINITY_WEIGHT = 100.0  # kv_affinity: a cached block outweighs 100 blocks of load (cache first, within the cap)


class RandomPolicy(Policy):
    """Uniformly random worker (the balls-into-bins baseline)."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def select(self, request: RouteRequest, workers: list[WorkerView]) -> Decision:
        return Decision(self._rng.choice(workers).worker_id, "random")


@dataclass(frozen=True)
class SimRequest:
    tenant: int
    prompt_token_ids: tuple[int, ...]
    size: int  # prompt + output budget, in tokens (the load a request adds to its worker)


@dataclass(frozen=True)
class SimResult:
    """One run: loads in tokens; ``imbalance`` = max / mean; ``cap_violations``: assignments made to a
    worker already above ``(1 + eps) x`` the mean (with that request); ``hit_share``: prompt blocks
    the chosen worker already held, over all prompt blocks that could hit."""

    policy: str
    pattern: str
    num_workers: int
    batch_size: int
    max_load: int
    mean_load: float
    max_request: int
    cap_violations: int
    hit_share: float

    @property
    def imbalance(self) -> float:
        return self.max_load / self.mean_load


@functools.lru_cache(maxsize=None)
def tenant_prefix(tenant: int) -> tuple[int, ...]:
    """A tenant's system prompt, PREFIX_TOKENS token ids."""
    rng = random.Random(tenant)
    return tuple(rng.randrange(100, 40000) for _ in range(PREFIX_TOKENS))


@functools.lru_cache(maxsize=256)
def arrivals(pattern: str, num_workers: int, batch_size: int, seed: int) -> tuple[SimRequest, ...]:
    """``batch_size`` requests of one pattern (see the module docstring)."""
    rng = random.Random(seed)
    out = []
    for i in range(batch_size):
        tenant = 0 if pattern == "hot_prefix" else rng.randrange(1000)
        prompt = tenant_prefix(tenant) + tuple(rng.randrange(100, 40000) for _ in range(SUFFIX_TOKENS))
        if pattern == "pareto":
            size = len(prompt) + int(32 * (1.0 - rng.random()) ** (-1 / 1.5))  # Pareto(xm=32, alpha=1.5) outputs
        elif pattern == "rr_adversary":
            size = BASE_SIZE * num_workers if i % num_workers == 0 else BASE_SIZE
        else:
            size = BASE_SIZE
        out.append(SimRequest(tenant, prompt, size))
    return tuple(out)


def make_policy(name: str, seed: int, epsilon: float) -> tuple[Policy, KVIndex | None]:
    """A policy by name (and the KV index it reads, for the kv_aware variants)."""
    if name == "random":
        return RandomPolicy(seed), None
    if name == "round_robin":
        return RoundRobin(), None
    if name == "least_load":
        return LeastLoad(), None
    if name == "power_of_two":
        return PowerOfTwo(seed), None
    if name == "cache_aware":
        return CacheAware(PolicyConfig(name="cache_aware")), None
    index = KVIndex()
    if name == "kv_aware":
        return KVAwarePolicy(index, epsilon=epsilon), index
    if name == "kv_affinity":
        return KVAwarePolicy(index, overlap_weight=AFFINITY_WEIGHT, epsilon=epsilon), index
    if name == "kv_affinity_uncapped":
        return KVAwarePolicy(index, overlap_weight=AFFINITY_WEIGHT, epsilon=math.inf), index
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")


def simulate(policy_name: str, pattern: str, num_workers: int, batch_size: int, seed: int = 0,
             epsilon: float = 0.25) -> SimResult:
    """Route one batch and measure the loads (see SimResult)."""
    policy, index = make_policy(policy_name, seed, epsilon)
    ids = [f"w{i}" for i in range(num_workers)]
    loads = dict.fromkeys(ids, 0)
    running = dict.fromkeys(ids, 0)
    violations = hit_blocks = hittable_blocks = 0
    requests = arrivals(pattern, num_workers, batch_size, seed)
    views = [WorkerView(w, w, True, 0, 0, True, BLOCK_SIZE) for w in ids]
    position = {w: i for i, w in enumerate(ids)}
    for n, item in enumerate(requests):
        prompt_len = len(item.prompt_token_ids)
        request = RouteRequest(f"r{n}", f"tenant {item.tenant}: " + " ".join(map(str, item.prompt_token_ids)),
                               item.prompt_token_ids, prompt_len, item.size - prompt_len)
        decision = policy.select(request, views)
        chosen = decision.worker_id
        if loads[chosen] > load_cap(views, item.size, epsilon) * (1 + 1e-12):
            violations += 1
        hashes = request_block_hashes(item.prompt_token_ids, BLOCK_SIZE)
        hittable_blocks += len(hashes)
        if index is None:
            index = KVIndex()  # track what each worker caches for every policy, to compare hit shares
        hit_blocks += index.overlap(chosen, hashes)
        index.apply(chosen, [BlockStored(tuple(hashes), None, item.prompt_token_ids[: len(hashes) * BLOCK_SIZE],
                                         BLOCK_SIZE, "pool")])
        policy.on_dispatched(request, decision)
        loads[chosen] += item.size
        running[chosen] += 1
        views[position[chosen]] = WorkerView(chosen, chosen, True, loads[chosen], running[chosen], True, BLOCK_SIZE)
    total = sum(loads.values())
    return SimResult(policy_name, pattern, num_workers, batch_size, max(loads.values()), total / num_workers,
                     max(r.size for r in requests), violations, hit_blocks / hittable_blocks if hittable_blocks else 0.0)


def random_spread_prediction(num_workers: int, batch_size: int) -> float:
    """Max/mean of B equal requests sent at random to G workers, to first order in the balls-into-bins
    regime (B/G >> ln G): max ≈ mean + sqrt(2 mean ln G) with mean = B/G, i.e. ``1 + sqrt(2 G ln G / B)``:
    the excess grows like sqrt(B log G) in requests, like sqrt(G log G / B) relative to the mean."""
    return 1 + math.sqrt(2 * num_workers * math.log(num_workers) / batch_size)
