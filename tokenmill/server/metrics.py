"""Prometheus metrics of the server, under the ``tokenmill:`` prefix, in their own CollectorRegistry.

Latency histograms and token/request counters are updated by the engine thread through
``RequestMetricsTracker``; gauges and the engine's own counters (preemptions, prefix-cache
queries/hits) are read at scrape time from the ``EngineStats`` snapshot the engine thread
publishes after every step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.outputs import RequestOutput

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class EngineStats:
    """The engine's gauges and cumulative counters after its latest step (replaced, never mutated)."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens found there (in any KV tier)
    kv_offload: dict[str, dict[str, int]] = field(default_factory=dict)  # tier -> TierStats.as_dict()
    kv_offload_disk_dwpd: float | None = None  # drive writes per day of the disk tier
    structured_output_requests: dict[str, int] = field(default_factory=dict)  # constraint kind -> sequences
    structured_output_mask_seconds: float = 0.0  # time spent filling next-token bitmasks
    structured_output_mask_steps: int = 0  # steps that filled one
    max_lora: int | None = None  # adapter slots (None: LoRA off)
    running_lora_adapters: tuple[str, ...] = ()  # names of the adapters of running / waiting sequences
    waiting_lora_adapters: tuple[str, ...] = ()
    lora_counters: dict[str, int] = field(default_factory=dict)  # LoRAManager.stats()
    spec_decode: dict | None = None  # SpecDecodingStats.snapshot() (None: speculative decoding off)
    kv_transfer: dict | None = None  # KVConnector.status() (None: no --kv-transfer-config)


class _EngineStatsCollector(Collector):
    """Turns the latest EngineStats into gauges and counters at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        labels = ["model_name"]
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", stats.num_requests_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_requests_waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", stats.kv_cache_usage),
        ):
            gauge = GaugeMetricFamily(f"tokenmill:{name}", doc, labels=labels)
            gauge.add_metric([self._model_name], value)
            yield gauge
        for name, doc, value in (
            ("num_preemptions", "Preemptions of running requests.", stats.num_preemptions_total),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", stats.prefix_cache_hits),
        ):
            counter = CounterMetricFamily(f"tokenmill:{name}", doc, labels=labels)
            counter.add_metric([self._model_name], value)
            yield counter
        yield from self._kv_offload(stats)
        yield from self._structured_output(stats)
        yield from self._lora(stats)
        yield from self._spec_decode(stats)
        yield from self._kv_transfer(stats)

    def _spec_decode(self, stats: EngineStats) -> Iterator[Metric]:
        """Speculative decoding's counters (vLLM's names), the per-position one labelled ``position``."""
        if stats.spec_decode is None:
            return
        for name, doc, key in (
            ("spec_decode_num_drafts", "Request steps that verified draft tokens.", "num_drafts"),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", "num_draft_tokens"),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"),
        ):
            counter = CounterMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
            counter.add_metric([self._model_name], stats.spec_decode[key])
            yield counter
        per_pos = CounterMetricFamily("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft (0 = first).",
                                      labels=["model_name", "position"])
        for position, count in enumerate(stats.spec_decode["num_accepted_tokens_per_pos"]):
            per_pos.add_metric([self._model_name, str(position)], count)
        yield per_pos

    def _kv_transfer(self, stats: EngineStats) -> Iterator[Metric]:
        """Prefill/decode disaggregation: what came from a producer (``remote_tokens`` makes a silent
        local prefill visible), what fell back to local compute and why, and the producer's leases."""
        info = stats.kv_transfer
        if info is None:
            return
        labels = ["model_name"]
        for name, doc, key in (
            ("kv_transfer_remote_prefill_requests", "Requests whose prompt K/V came from a producer.",
             "remote_prefill_requests"),
            ("kv_transfer_remote_tokens", "Prompt tokens loaded from a producer instead of computed.", "remote_tokens"),
            ("kv_transfer_received_bytes", "KV bytes pulled from producers.", "bytes_received"),
            ("kv_transfer_leases", "Finished prompts whose blocks were leased to a consumer.", "leases_total"),
            ("kv_transfer_leases_expired", "Leases freed unclaimed after lease_ttl_s.", "leases_expired_total"),
            ("kv_transfer_sent_bytes", "KV bytes sent to consumers.", "bytes_sent_total"),
            ("kv_transfer_leases_refused", "Finished prompts not leased: over max_leases or max_lease_blocks.",
             "leases_refused_total"),
            ("kv_transfer_connections_refused", "Producer connections refused: outside allowed_consumers, or signed pulls over max_connections.",
             "connections_refused_total"),
            ("kv_transfer_auth_failures", "Producer connections that never presented a pull signed with the "
             "cluster secret.", "auth_failures_total"),
        ):
            if key in info:
                counter = CounterMetricFamily(f"tokenmill:{name}", doc, labels=labels)
                counter.add_metric([self._model_name], info[key])
                yield counter
        fallbacks = CounterMetricFamily("tokenmill:kv_transfer_local_fallbacks",
                                        "Requests that asked for remote K/V but computed their prompt here, by reason "
                                        "(connect, timeout, refused, mismatch, corrupt, protocol, params, auth, "
                                        "not_allowed, too_large).",
                                        labels=["model_name", "reason"])
        for reason, count in sorted(info["local_fallbacks"].items()):
            fallbacks.add_metric([self._model_name, reason], count)
        yield fallbacks
        if "leases" in info:
            gauge = GaugeMetricFamily("tokenmill:kv_transfer_leases_held", "Leases waiting for their consumer.",
                                      labels=labels)
            gauge.add_metric([self._model_name], info["leases"])
            yield gauge

    def _lora(self, stats: EngineStats) -> Iterator[Metric]:
        """vLLM's ``lora_requests_info`` (adapters in use as labels, the scrape time as value) and the
        adapter load / eviction counters (label ``tier``: "host" memory, device "slot")."""
        if stats.max_lora is None:
            return
        info = GaugeMetricFamily(
            "tokenmill:lora_requests_info", "LoRA adapters of running and waiting requests (comma-separated "
            "labels) and the slot count; the value is the time of the scrape.",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters),
                         str(stats.max_lora)], time.time())
        yield info
        counters = stats.lora_counters
        for name, doc, values in (
            ("lora_adapter_loads", "LoRA adapters loaded: read from disk into host memory (tier=host) or copied "
             "into a device slot (tier=slot).", (("host", "disk_loads"), ("slot", "slot_loads"))),
            ("lora_adapter_evictions", "LoRA adapters evicted from host memory (tier=host) or replaced in a "
             "device slot (tier=slot).", (("host", "host_evictions"), ("slot", "slot_evictions"))),
        ):
            counter = CounterMetricFamily(f"tokenmill:{name}", doc, labels=["model_name", "tier"])
            for tier, key in values:
                counter.add_metric([self._model_name, tier], counters.get(key, 0))
            yield counter

    def _structured_output(self, stats: EngineStats) -> Iterator[Metric]:
        """Constrained sequences by constraint kind, and the bitmask-filling time."""
        requests = CounterMetricFamily(
            "tokenmill:structured_output_requests", "Constrained sequences started, by constraint kind "
            "(json, regex, choice, grammar, json_object, tool_calls).", labels=["model_name", "kind"])
        for kind, count in sorted(stats.structured_output_requests.items()):
            requests.add_metric([self._model_name, kind], count)
        yield requests
        for name, doc, value in (
            ("structured_output_mask_seconds", "Seconds spent filling next-token bitmasks of constrained requests "
             "(on a worker thread, overlapping the forward pass).", stats.structured_output_mask_seconds),
            ("structured_output_mask_steps", "Engine steps that filled a bitmask.", stats.structured_output_mask_steps),
        ):
            counter = CounterMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
            counter.add_metric([self._model_name], value)
            yield counter

    def _kv_offload(self, stats: EngineStats) -> Iterator[Metric]:
        """Per-tier counters of the lower KV tiers (label ``tier``: "ram", "disk") and the disk DWPD."""
        if not stats.kv_offload:
            return
        labels = ["model_name", "tier"]
        for name, key, doc in (
            ("kv_offload_bytes_written", "bytes_written", "Bytes written to a lower KV tier."),
            ("kv_offload_bytes_read", "bytes_read", "Bytes read back from a lower KV tier."),
            ("kv_offload_hits", "hits", "KV blocks a lower tier served back to the primary pool (blocks, not tokens)."),
        ):
            counter = CounterMetricFamily(f"tokenmill:{name}", doc, labels=labels)
            for tier, tier_stats in sorted(stats.kv_offload.items()):
                counter.add_metric([self._model_name, tier], tier_stats[key])
            yield counter
        usage = GaugeMetricFamily("tokenmill:kv_offload_usage_perc",
                                  "Fraction of a lower KV tier's capacity holding blocks (0-1).", labels=labels)
        for tier, tier_stats in sorted(stats.kv_offload.items()):
            capacity = tier_stats["capacity_blocks"]
            usage.add_metric([self._model_name, tier], tier_stats["blocks_stored"] / capacity if capacity else 0.0)
        yield usage
        if stats.kv_offload_disk_dwpd is not None:
            gauge = GaugeMetricFamily(
                "tokenmill:kv_offload_disk_dwpd",
                "Drive writes per day of the disk KV tier: bytes/day / drive size, the rate averaged since start "
                "(over at least one hour).",
                labels=["model_name"],
            )
            gauge.add_metric([self._model_name], stats.kv_offload_disk_dwpd)
            yield gauge


class ServerMetrics:
    """The registry and every metric the server exports.

    Args:
        model_name: value of the ``model_name`` label (the served model name).
        stats: returns the engine's latest EngineStats (read at scrape time).
    """

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(f"tokenmill:{name}", doc, label, buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(f"tokenmill:{name}", doc, label, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first output token.",
                                             _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between output steps of a request.",
                                             _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling.",
                                            _LATENCY_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.")
        self._request_success = Counter("tokenmill:request_success",
                                        "Finished sequences by finish reason (stop, length, abort).",
                                        ["model_name", "finished_reason"], registry=self.registry)
        self.registry.register(_EngineStatsCollector(model_name, stats))

    def count_finished(self, finish_reason: str) -> None:
        """Count one finished sequence under its finish reason."""
        self._request_success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of the registry."""
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, float | dict[str, float]]:
        """The registry's samples as JSON (for ``/debug/status``): sample name without ``tokenmill:`` -> value,
        or -> {label values joined by "," -> value} when the sample has labels besides ``model_name``.
        Histograms give only their ``_sum`` and ``_count``; ``_created`` samples and ``*_info`` families
        are left out."""
        out: dict[str, float | dict[str, float]] = {}
        for family in self.registry.collect():
            if family.name.endswith("_info"):
                continue
            for sample in family.samples:
                if sample.name.endswith(("_bucket", "_created")):
                    continue
                name = sample.name.removeprefix("tokenmill:")
                labels = [v for k, v in sample.labels.items() if k != "model_name"]
                if labels:
                    out.setdefault(name, {})[",".join(labels)] = sample.value
                else:
                    out[name] = sample.value
        return out


@dataclass
class _Tracked:
    first_child_id: str
    arrival_time: float
    prompt_counted: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None


class RequestMetricsTracker:
    """Per-request latency bookkeeping. Engine thread only (it reads the scheduler between steps).

    Queue time (arrival to first scheduling) comes from the engine's RequestOutput.metrics; TTFT
    and inter-token latency are measured when outputs carrying new tokens leave the engine. With
    ``log_requests``, each finished request gets one INFO line: id, model (``base_model_name``), LoRA
    adapter name (``-`` for none), token counts, finish reasons, TTFT and end-to-end latency.
    """

    def __init__(self, metrics: ServerMetrics, log_requests: bool = False, base_model_name: str = "") -> None:
        self.metrics = metrics
        self.log_requests = log_requests
        self.base_model_name = base_model_name
        self._tracked: dict[str, _Tracked] = {}

    def on_added(self, engine, request_id: str, arrival_time: float) -> None:
        """Start tracking a request the engine just accepted."""
        first_child = engine.output_processor.child_ids(request_id)[0]
        self._tracked[request_id] = _Tracked(first_child, arrival_time)

    def on_finished(self, request_id: str) -> None:
        """Forget a request."""
        self._tracked.pop(request_id, None)

    def on_aborted(self, engine, request_id: str) -> None:
        """Count an aborted request's sequences (call before the engine drops it): those still
        running under ``finished_reason="abort"``, those already done under their own reason."""
        for finish_reason in engine.output_processor.finish_reasons(request_id):
            self.metrics.count_finished(finish_reason or "abort")
        self.on_finished(request_id)

    def on_step(self, engine, step_start: float, outputs: list[RequestOutput]) -> None:
        """Observe one engine step that started at ``step_start`` and produced ``outputs``."""
        now = time.monotonic()
        m = self.metrics
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            if not tracked.prompt_counted:
                m.prompt_tokens.inc(len(output.prompt_token_ids))
                m.request_queue_time.observe(
                    max(0.0, output.metrics["first_scheduled_time"] - output.metrics["arrival_time"])
                )
                tracked.prompt_counted = True
            num_new = sum(len(c.delta_token_ids) for c in output.outputs)
            if num_new:
                m.generation_tokens.inc(num_new)
                if tracked.last_token_time is None:
                    m.time_to_first_token.observe(now - tracked.arrival_time)
                    tracked.first_token_time = now
                else:
                    m.inter_token_latency.observe(now - tracked.last_token_time)
                tracked.last_token_time = now
            if output.finished:
                m.e2e_request_latency.observe(now - tracked.arrival_time)
                for completion in output.outputs:
                    m.count_finished(completion.finish_reason or "abort")
                if self.log_requests:
                    self._log_finished(output, tracked, now)
                self.on_finished(output.request_id)

    def _log_finished(self, output: RequestOutput, tracked: _Tracked, now: float) -> None:
        lora = output.lora_request
        ttft = "-" if tracked.first_token_time is None else f"{tracked.first_token_time - tracked.arrival_time:.3f}s"
        logger.info(
            "request %s finished: model=%s lora=%s prompt_tokens=%d cached_tokens=%d output_tokens=%d "
            "finish_reason=%s ttft=%s e2e=%.3fs", output.request_id,
            self.base_model_name, "-" if lora is None else lora.lora_name,
            len(output.prompt_token_ids), output.num_cached_tokens, sum(len(c.token_ids) for c in output.outputs),
            ",".join(c.finish_reason or "abort" for c in output.outputs), ttft, now - tracked.arrival_time)
