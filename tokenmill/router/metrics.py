"""The router's Prometheus metrics (own registry, ``tokenmill_router:`` prefix).

Counters are updated as requests are routed; the per-worker gauges and the load imbalance are set
from the registry when ``/metrics`` is scraped, so they never drift from the workers' real state.
"""
from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.router.policy import Decision


# Seconds: fine steps below 5 ms, where the router's overhead should sit.
OVERHEAD_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025,
                    0.05, 0.1, 0.25, 1.0)


class RouterMetrics:
    """Every metric of the router; ``render(workers)`` is the text of ``/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        worker_labels = ["worker_id", "url"]

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(f"tokenmill_router:{name}", doc, labels, registry=self.registry)

        def gauge(name: str, doc: str, labels: list[str] | None = None) -> Gauge:
            return Gauge(f"tokenmill_router:{name}", doc, labels or [], registry=self.registry)

        self.requests = counter("requests", "Requests sent to each worker (every attempt, retries included).",
                                worker_labels)
        self.decisions = counter("routing_decisions", "Routing decisions by policy and reason.", ["policy", "reason"])
        self.estimated_hit_tokens = counter("estimated_prefix_hit_tokens",
                                            "Prompt tokens the policy expected the chosen worker to hold.", ["policy"])
        self.retries = counter("retries", "Requests retried on another worker before their first token, by cause.",
                               ["reason"])
        self.resumptions = counter("resumptions", "Stream choices resumed on another worker after their worker "
                                   "failed mid-stream (every attempt counted).", [])
        self.errors = counter("request_errors", "Requests the router answered with an error of its own, by cause.",
                              ["reason"])
        self.running = gauge("worker_running_requests", "Requests routed to the worker and not finished.",
                             worker_labels)
        self.outstanding = gauge("worker_outstanding_tokens",
                                 "Prompt + max_tokens of the requests routed to the worker and not finished.",
                                 worker_labels)
        self.healthy = gauge("worker_healthy", "1 when the worker passed its last health check.", worker_labels)
        self.max_load = gauge("max_outstanding_tokens", "Largest outstanding tokens over the healthy workers.")
        self.mean_load = gauge("mean_outstanding_tokens", "Mean outstanding tokens over the healthy workers.")
        self.imbalance = gauge("load_imbalance",
                               "Max over mean outstanding tokens of the healthy workers (1: balanced or idle).")
        # The router's own time per request, in seconds, by stage: "dispatch" runs from the handler getting
        # the request to the upstream send (JSON parse, tokenization for kv_aware, the policy's choice);
        # "first_token_relay" from the worker's first token event read to its bytes handed to the client
        # (streams). Their sum is what the router adds to TTFT besides one loopback hop.
        self.overhead = Histogram("tokenmill_router:request_overhead_seconds",
                                  "Router time per request by stage (dispatch: arrival to upstream send; "
                                  "first_token_relay: first token read from the worker to sent to the client).",
                                  ["stage"], registry=self.registry, buckets=OVERHEAD_BUCKETS)

    def count_decision(self, policy: str, decision: Decision) -> None:
        self.decisions.labels(policy, decision.reason).inc()
        if decision.expected_hit_tokens:
            self.estimated_hit_tokens.labels(policy).inc(decision.expected_hit_tokens)

    def render(self, workers: Iterable) -> bytes:
        """The exposition text, with the gauges set from ``workers`` (the registry's ``Worker``s)."""
        workers = list(workers)
        for gauge in (self.running, self.outstanding, self.healthy):
            gauge.clear()  # removed workers disappear
        for w in workers:
            self.running.labels(w.worker_id, w.url).set(w.running_requests)
            self.outstanding.labels(w.worker_id, w.url).set(w.outstanding_tokens)
            self.healthy.labels(w.worker_id, w.url).set(1 if w.state == "healthy" else 0)
        loads = [w.outstanding_tokens for w in workers if w.state == "healthy"]
        high = max(loads, default=0)
        mean = sum(loads) / len(loads) if loads else 0.0
        self.max_load.set(high)
        self.mean_load.set(mean)
        self.imbalance.set(high / mean if mean > 0 else 1.0)
        return generate_latest(self.registry)
