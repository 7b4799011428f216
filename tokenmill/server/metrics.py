"""Prometheus metrics of the server, under the ``tokenmill:`` prefix, in their own CollectorRegistry.

Latency histograms and token/request counters are updated by the engine thread through
``RequestMetricsTracker``; gauges and the engine's own counters (preemptions, prefix-cache
queries/hits) are read at scrape time from the ``EngineStats`` snapshot the engine thread
publishes after every step.

With ``metrics_compat="vllm"`` the registry also exports the series inference gateways and vLLM dashboards
read, under vLLM's names and labels (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:lora_requests_info``, the TTFT / ITL / e2e histograms, ...): each is fed by the same measurement as
its ``tokenmill:`` twin (``_Fanout``, or the same EngineStats field), never counted twice.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.outputs import RequestOutput

if TYPE_CHECKING:
    from tokenmill.moe.load_stats import ExpertLoadSnapshot
    from tokenmill.server.async_engine import EngineRequest
    from tokenmill.tracing import RequestTrace, RequestTracer

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)

METRICS_COMPAT = ("vllm",)  # the ``metrics_compat`` values (None: tokenmill's names only)
# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read the same.
_VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                      20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                      40.0, 80.0)
_VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                         240.0, 480.0, 960.0, 1920.0, 7680.0)
_VLLM_LABELS = ["model_name", "engine"]  # vLLM v1's labels; ``engine`` is the engine index, "0" here


@dataclass(frozen=True)
class EngineStats:
    """The engine's gauges and cumulative counters after its latest step (replaced, never mutated)."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens found there (in any KV tier)
    kv_sessions: int = 0  # agent sessions keeping blocks between turns (--session-kv-ttl)
    kv_session_blocks: int = 0  # free blocks kept for them
    session_prefix_cache_queries: int = 0  # prompt tokens of session requests looked up
    session_prefix_cache_hits: int = 0  # ... and found
    kv_offload: dict[str, dict] = field(default_factory=dict)  # tier -> TierStats.as_dict()
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
    moe_expert_load: ExpertLoadSnapshot | None = None  # expert load (None: not a mixture-of-experts model)
    block_size: int | None = None  # tokens per KV block (vllm:cache_config_info)
    num_gpu_blocks: int | None = None  # blocks in the primary KV pool
    enable_prefix_caching: bool | None = None


class _EngineStatsCollector(Collector):
    """Turns the latest EngineStats into gauges and counters at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats], compat: str | None = None) -> None:
        self._model_name = model_name
        self._stats = stats
        self._compat = compat

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if self._compat == "vllm":
            yield from self._vllm(stats)
        labels = ["model_name"]
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", stats.num_requests_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_requests_waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", stats.kv_cache_usage),
            ("kv_sessions", "Agent sessions keeping KV blocks between turns (--session-kv-ttl).", stats.kv_sessions),
            ("kv_session_blocks", "Free KV blocks kept for agent sessions between turns.", stats.kv_session_blocks),
        ):
            gauge = GaugeMetricFamily(f"tokenmill:{name}", doc, labels=labels)
            gauge.add_metric([self._model_name], value)
            yield gauge
        for name, doc, value in (
            ("num_preemptions", "Preemptions of running requests.", stats.num_preemptions_total),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", stats.prefix_cache_hits),
            ("session_prefix_cache_queries", "Prompt tokens of agent-session requests looked up in the prefix cache.",
             stats.session_prefix_cache_queries),
            ("session_prefix_cache_hits", "Prompt tokens of agent-session requests served from the prefix cache.",
             stats.session_prefix_cache_hits),
        ):
            counter = CounterMetricFamily(f"tokenmill:{name}", doc, labels=labels)
            counter.add_metric([self._model_name], value)
            yield counter
        yield from self._kv_offload(stats)
        yield from self._structured_output(stats)
        yield from self._lora(stats)
        yield from self._spec_decode(stats)
        yield from self._kv_transfer(stats)
        yield from self._moe(stats)

    def _vllm(self, stats: EngineStats) -> Iterator[Metric]:
        """The engine's gauges and counters under vLLM's names and labels (``metrics_compat="vllm"``).
        ``vllm:gpu_cache_usage_perc`` is vLLM's older name of ``kv_cache_usage_perc``, still read by older
        Gateway API Inference Extension releases; prefix-cache hits count every KV tier, as tokenmill's."""
        values = [self._model_name, "0"]
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch (vLLM's name).", stats.num_requests_running),
            ("num_requests_waiting", "Requests waiting to be scheduled (vLLM's name).", stats.num_requests_waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 0-1 (vLLM's name).", stats.kv_cache_usage),
            ("gpu_cache_usage_perc", "Fraction of KV-cache blocks in use, 0-1 (vLLM's older name of "
             "vllm:kv_cache_usage_perc).", stats.kv_cache_usage),
        ):
            gauge = GaugeMetricFamily(f"vllm:{name}", doc, labels=_VLLM_LABELS)
            gauge.add_metric(values, value)
            yield gauge
        for name, doc, value in (
            ("num_preemptions", "Preemptions of running requests (vLLM's name).", stats.num_preemptions_total),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM's name).",
             stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache, any tier (vLLM's name).", stats.prefix_cache_hits),
        ):
            counter = CounterMetricFamily(f"vllm:{name}", doc, labels=_VLLM_LABELS)
            counter.add_metric(values, value)
            yield counter
        if stats.block_size is not None:
            info = GaugeMetricFamily("vllm:cache_config_info", "The KV pool's block size and block count as labels; the value is 1.",
                                     labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"])
            info.add_metric([str(stats.block_size), str(stats.num_gpu_blocks), str(stats.enable_prefix_caching),
                             "0"], 1.0)
            yield info
        if stats.max_lora is not None:  # vLLM's labels, without model_name; the value is the time of the scrape
            lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters of running and waiting requests and the slot count as labels; the value is the scrape time.",
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            lora.add_metric([str(stats.max_lora), ",".join(stats.waiting_lora_adapters),
                             ",".join(stats.running_lora_adapters)], time.time())
            yield lora

    def _moe(self, stats: EngineStats) -> Iterator[Metric]:
        """Expert load of a mixture-of-experts model: a histogram of the tokens each expert of each MoE layer got
        per step (one observation per step, layer and expert), and each expert's routed tokens (all layers)."""
        load = stats.moe_expert_load
        if load is None:
            return
        histogram = HistogramMetricFamily(
            "tokenmill:moe_expert_tokens", "Tokens routed to one expert of one MoE layer in one engine step "
            "(one observation per step, MoE layer and expert; a wide spread is routing skew).", labels=["model_name"])
        histogram.add_metric([self._model_name], [(str(le) if le != float("inf") else "+Inf", n)
                                                  for le, n in load.buckets], sum_value=load.sum)
        yield histogram
        counter = CounterMetricFamily("tokenmill:moe_expert_routed_tokens",
                                      "Tokens routed to each expert, summed over the MoE layers.",
                                      labels=["model_name", "expert"])
        for expert, n in enumerate(load.tokens_per_expert):
            counter.add_metric([self._model_name, str(expert)], n)
        yield counter

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
        enabled = GaugeMetricFamily("tokenmill:kv_offload_enabled",
                                    "1 while a lower KV tier takes new blocks, 0 once a fault switched it off.",
                                    labels=labels)
        errors = CounterMetricFamily(
            "tokenmill:kv_offload_errors",
            "Faults a lower KV tier survived, by kind: enospc (no room to write), readonly (a write refused), corrupt "
            "(a record failing its checks, recomputed instead), io (other I/O errors), alloc (RAM slab not allocated).",
            labels=["model_name", "tier", "kind"])
        for tier, tier_stats in sorted(stats.kv_offload.items()):
            enabled.add_metric([self._model_name, tier], tier_stats.get("enabled", 1))
            for kind, count in sorted(tier_stats.get("errors", {}).items()):
                errors.add_metric([self._model_name, tier, kind], count)
        yield enabled
        yield errors
        if stats.kv_offload_disk_dwpd is not None:
            gauge = GaugeMetricFamily(
                "tokenmill:kv_offload_disk_dwpd",
                "Drive writes per day of the disk KV tier: bytes/day / drive size, the rate averaged since start "
                "(over at least one hour).",
                labels=["model_name"],
            )
            gauge.add_metric([self._model_name], stats.kv_offload_disk_dwpd)
            yield gauge


class _Fanout:
    """One measurement recorded into each of ``targets`` (a tokenmill series and its vLLM-named twin)."""

    __slots__ = ("targets",)

    def __init__(self, *targets) -> None:
        self.targets = targets

    def observe(self, value: float) -> None:
        for target in self.targets:
            target.observe(value)

    def inc(self, amount: float = 1) -> None:
        for target in self.targets:
            target.inc(amount)


class ServerMetrics:
    """The registry and every metric the server exports.

    Args:
        model_name: value of the ``model_name`` label (the served model name).
        stats: returns the engine's latest EngineStats (read at scrape time).
        compat: ``"vllm"``: also export the series gateways read under vLLM's names and labels
            (``vllm:*``, ``engine="0"``); None: ``tokenmill:*`` only.

    Raises:
        ValueError: an unknown ``compat``, naming ``metrics_compat``.
    """

    def __init__(self, model_name: str, stats: Callable[[], EngineStats], compat: str | None = None) -> None:
        if compat is not None and compat not in METRICS_COMPAT:
            raise ValueError(f"`metrics_compat` must be one of {', '.join(METRICS_COMPAT)} or None, got {compat!r}")
        self.registry = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]
        vllm = compat == "vllm"

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *twins: tuple[str, str, tuple[float, ...]]):
            own = Histogram(f"tokenmill:{name}", doc, label, buckets=buckets, registry=self.registry).labels(model_name)
            if not vllm:
                return own
            return _Fanout(own, *(Histogram(f"vllm:{n}", d, _VLLM_LABELS, buckets=b, registry=self.registry)
                                  .labels(model_name, "0") for n, d, b in twins))

        def counter(name: str, doc: str, twin_doc: str):
            own = Counter(f"tokenmill:{name}", doc, label, registry=self.registry).labels(model_name)
            if not vllm:
                return own
            return _Fanout(own, Counter(f"vllm:{name}", twin_doc, _VLLM_LABELS, registry=self.registry)
                           .labels(model_name, "0"))

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first output token.", _LATENCY_BUCKETS,
            ("time_to_first_token_seconds", "Arrival to first output token, seconds (vLLM's name and buckets).", _VLLM_TTFT_BUCKETS))
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between output steps of a request.", _ITL_BUCKETS,
            ("inter_token_latency_seconds", "Time between output steps of a request, seconds (vLLM's name and buckets).", _VLLM_TPOT_BUCKETS),
            ("time_per_output_token_seconds", "The observations of vllm:inter_token_latency_seconds under vLLM's "
             "older name.", _VLLM_TPOT_BUCKETS))
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS,
            ("e2e_request_latency_seconds", "Arrival to finish, seconds (vLLM's name and buckets).", _VLLM_REQUEST_BUCKETS))
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY_BUCKETS,
            ("request_queue_time_seconds", "Arrival to first scheduling, seconds (vLLM's name and buckets).",
             _VLLM_REQUEST_BUCKETS))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.", "Prompt tokens prefilled (vLLM's name).")
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.",
                                         "Output tokens generated (vLLM's name).")
        self._request_success = Counter("tokenmill:request_success",
                                        "Finished sequences by finish reason (stop, length, abort).",
                                        ["model_name", "finished_reason"], registry=self.registry)
        self._vllm_request_success = None if not vllm else Counter(
            "vllm:request_success", "Finished sequences by finish reason (vLLM's name).", [*_VLLM_LABELS, "finished_reason"],
            registry=self.registry)
        self.registry.register(_EngineStatsCollector(model_name, stats, compat))

    def count_finished(self, finish_reason: str) -> None:
        """Count one finished sequence under its finish reason."""
        self._request_success.labels(self.model_name, finish_reason).inc()
        if self._vllm_request_success is not None:
            self._vllm_request_success.labels(self.model_name, "0", finish_reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of the registry."""
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, float | dict[str, float]]:
        """The registry's samples as JSON (for ``/debug/status``): sample name without ``tokenmill:`` -> value,
        or -> {label values joined by "," -> value} when the sample has labels besides ``model_name``.
        Histograms give only their ``_sum`` and ``_count``; ``_created`` samples, ``*_info`` families
        and the ``vllm:*`` twins (``metrics_compat``) are left out."""
        out: dict[str, float | dict[str, float]] = {}
        for family in self.registry.collect():
            if family.name.endswith("_info") or not family.name.startswith("tokenmill:"):
                continue  # info families, and the vllm:* twins of metrics_compat
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
    trace: RequestTrace | None = None  # its llm_request span's facts (--otlp-traces-endpoint)


class RequestMetricsTracker:
    """Per-request latency bookkeeping. Engine thread only (it reads the scheduler between steps).

    Queue time (arrival to first scheduling) comes from the engine's RequestOutput.metrics; TTFT
    and inter-token latency are measured when outputs carrying new tokens leave the engine. With
    ``log_requests``, each finished request gets one INFO line: id, model (``base_model_name``), LoRA
    adapter name (``-`` for none), token counts, finish reasons, TTFT and end-to-end latency. With a
    ``tracer`` (``--otlp-traces-endpoint``), each request's ``llm_request`` span is built from the same
    measurements when it finishes or is aborted (``tokenmill.tracing.RequestTracer``).
    """

    def __init__(self, metrics: ServerMetrics, log_requests: bool = False, base_model_name: str = "",
                 tracer: RequestTracer | None = None) -> None:
        self.metrics = metrics
        self.log_requests = log_requests
        self.base_model_name = base_model_name
        self.tracer = tracer
        self._tracked: dict[str, _Tracked] = {}

    def on_added(self, engine, request_id: str, arrival_time: float, request: EngineRequest | None = None) -> None:
        """Start tracking a request the engine just accepted (``request``: what the server queued, for its trace)."""
        first_child = engine.output_processor.child_ids(request_id)[0]
        tracked = self._tracked[request_id] = _Tracked(first_child, arrival_time)
        if self.tracer is not None and request is not None:
            lora = request.lora_request
            tracked.trace = self.tracer.begin(request_id, request.trace_headers,
                                              lora.lora_name if lora is not None else self.base_model_name,
                                              lora.lora_name if lora is not None else None, request.params)

    def on_finished(self, request_id: str) -> None:
        """Forget a request."""
        self._tracked.pop(request_id, None)

    def on_aborted(self, engine, request_id: str) -> None:
        """Count an aborted request's sequences (call before the engine drops it): those still
        running under ``finished_reason="abort"``, those already done under their own reason."""
        for finish_reason in engine.output_processor.finish_reasons(request_id):
            self.metrics.count_finished(finish_reason or "abort")
        tracked = self._tracked.get(request_id)
        if tracked is not None and tracked.trace is not None:
            self._end_aborted_trace(engine, request_id, tracked)
        self.on_finished(request_id)

    def _end_aborted_trace(self, engine, request_id: str, tracked: _Tracked) -> None:
        """End an aborted request's span (status error) with what the engine has of it so far."""
        parent = engine.output_processor.parents.get(request_id)
        sequences = list(parent.sequences.values()) if parent is not None else []
        self.tracer.end(tracked.trace, arrival_time=tracked.arrival_time,
                        first_scheduled_time=parent.first_scheduled_time if parent is not None else None,
                        first_token_time=tracked.first_token_time, last_token_time=tracked.last_token_time,
                        end_time=time.monotonic(),
                        num_prompt_tokens=len(parent.prompt_token_ids) if parent is not None else 0,
                        num_output_tokens=sum(s.num_tokens_emitted for s in sequences),
                        num_cached_tokens=parent.num_cached_tokens if parent is not None else 0,
                        finish_reasons=[s.finish_reason or "abort" for s in sequences],
                        error="aborted before it finished: the client disconnected or the server ended it")

    def on_step(self, engine, step_start: float, outputs: list[RequestOutput]) -> None:
        """Observe one engine step that started at ``step_start`` and produced ``outputs``."""
        now = time.monotonic()
        m = self.metrics
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            if tracked.trace is not None:
                self.tracer.step(tracked.trace, now - step_start)
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
                if tracked.trace is not None:
                    self.tracer.end(tracked.trace, arrival_time=tracked.arrival_time,
                                    first_scheduled_time=output.metrics.get("first_scheduled_time"),
                                    first_token_time=tracked.first_token_time, last_token_time=tracked.last_token_time,
                                    end_time=now, num_prompt_tokens=len(output.prompt_token_ids),
                                    num_output_tokens=sum(len(c.token_ids) for c in output.outputs),
                                    num_cached_tokens=output.num_cached_tokens,
                                    finish_reasons=[c.finish_reason or "abort" for c in output.outputs])
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
