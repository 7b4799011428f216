"""The routing simulator (tokenmill/router/simulate.py): the bounded-load policies (kv_aware, and the
cache-first kv_affinity under the same cap) keep every worker under (1 + eps) x the mean plus one
request for every fleet size G = 2..64 and batch B = 8..512, under uniform, heavy-tailed (Pareto),
hot-prefix and round-robin-adversarial arrivals, while random assignment's max/mean grows as
sqrt(G log G / B) predicts and the uncapped or load-blind rules fall to the patterns aimed at them.
No model, no network."""
from __future__ import annotations

import math
import statistics

import pytest

from tokenmill.router.simulate import BASE_SIZE, PATTERNS, random_spread_prediction, simulate

WORKERS = (2, 4, 8, 16, 32, 64)
BATCHES = (8, 32, 128, 512)
EPSILON = 0.25


@pytest.mark.parametrize("pattern", PATTERNS)
def test_bounded_load_policies_stay_under_the_cap_for_every_fleet_and_batch(pattern):
    for num_workers in WORKERS:
        for batch in BATCHES:
            for policy in ("kv_aware", "kv_affinity") if pattern == "hot_prefix" else ("kv_aware",):
                r = simulate(policy, pattern, num_workers, batch, seed=num_workers * 1000 + batch, epsilon=EPSILON)
                where = f"{policy} {pattern} G={num_workers} B={batch}"
                assert r.cap_violations == 0, where  # no worker above the cap ever took a request
                # Hence at the end: max <= (1 + eps) x mean + one request (the paper's ceiling, by tokens).
                assert r.max_load <= (1 + EPSILON) * r.mean_load + r.max_request, where
                if pattern in ("uniform", "hot_prefix"):  # equal requests: ceil-like bound in requests
                    assert r.max_load // BASE_SIZE <= math.floor((1 + EPSILON) * batch / num_workers) + 1, where
                if batch >= 8 * num_workers / EPSILON and pattern != "pareto":  # many requests per worker
                    assert r.imbalance <= 1 + 2 * EPSILON, where


def test_random_assignment_spread_grows_with_the_fleet_like_sqrt_g_log_g_over_b():
    for batch in (128, 512):
        spread = {g: statistics.mean(simulate("random", "uniform", g, batch, seed=s).imbalance for s in range(4))
                  for g in WORKERS}
        assert all(spread[a] < spread[b] for a, b in zip(WORKERS, WORKERS[1:])), spread
        for g in WORKERS[2:]:
            predicted = random_spread_prediction(g, batch) - 1  # max - mean ≈ sqrt(2 mean ln G)
            assert 0.5 <= (spread[g] - 1) / predicted <= 1.5, (batch, g, spread[g], predicted)
            bounded = simulate("kv_aware", "uniform", g, batch, seed=1, epsilon=EPSILON).imbalance
            assert bounded <= min(1 + EPSILON + g / batch, spread[g])
    assert spread[64] > 1 + 2 * EPSILON  # at B = 512 random is far past the cap the bounded policy keeps


def test_without_the_cap_cache_affinity_piles_a_hot_prefix_onto_a_few_workers():
    uncapped = simulate("kv_affinity_uncapped", "hot_prefix", 16, 256, epsilon=EPSILON)
    capped = simulate("kv_affinity", "hot_prefix", 16, 256, epsilon=EPSILON)
    cache_aware = simulate("cache_aware", "hot_prefix", 16, 256)
    assert uncapped.imbalance > 3 and uncapped.cap_violations > 0 and cache_aware.imbalance > 2
    assert capped.imbalance <= 1 + EPSILON + 16 / 256 and capped.cap_violations == 0
    # The cap keeps most of the cache benefit: the prefix is computed on few workers, not on all.
    assert capped.hit_share >= simulate("least_load", "hot_prefix", 16, 256).hit_share


def test_round_robin_falls_to_the_periodic_adversary_and_the_cap_does_not():
    rr = simulate("round_robin", "rr_adversary", 8, 512)
    bounded = simulate("kv_aware", "rr_adversary", 8, 512, epsilon=EPSILON)
    assert rr.imbalance > 4 and bounded.imbalance <= 1 + EPSILON
