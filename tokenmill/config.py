"""Frozen configuration records. Each component takes only the config it needs.

Derived values are properties, never written back after construction.
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.config_error import ConfigError, config_from_value
from tokenmill.security.addresses import is_loopback

if TYPE_CHECKING:
    from tokenmill.kv_transfer.config import KVTransferConfig
    from tokenmill.spec_decode.config import SpeculativeConfig

DEFAULT_KV_OFFLOAD_DISK_SIZE_GIB = 16.0


def check_int(name: str, value: object, minimum: int = 1, maximum: int | None = None, optional: bool = False) -> None:
    """Raise ConfigError unless ``value`` is an integer (not a bool) in [minimum, maximum] (or None if optional)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"`{name}` must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"`{name}` must be {bound}, got {value}")


def check_number(
    name: str, value: object, minimum: float, inclusive: bool, maximum: float | None = None, optional: bool = False
) -> None:
    """Raise ConfigError unless ``value`` is a finite real number (not a bool) above ``minimum`` (or
    equal to it when ``inclusive``) and at most ``maximum``, or None if optional."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"`{name}` must be a number, got {value!r}")
    if (not math.isfinite(value) or value < minimum or (value == minimum and not inclusive)
            or (maximum is not None and value > maximum)):
        if maximum is not None:
            raise ConfigError(f"`{name}` must be in {'[' if inclusive else '('}{minimum}, {maximum}], got {value}")
        raise ConfigError(f"`{name}` must be a finite number {'>=' if inclusive else '>'} {minimum}, got {value}")


def check_bool(name: str, value: object) -> None:
    """Raise ConfigError unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise ConfigError(f"`{name}` must be True or False, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV-cache settings.

    Args:
        block_size: tokens per KV block.
        num_kv_blocks: explicit pool size in blocks; overrides ``kv_cache_memory_gib``.
        kv_cache_memory_gib: memory budget for the KV pool in GiB (used when
            ``num_kv_blocks`` is None).
        enable_prefix_caching: index full blocks by chained hash and reuse them.
        kv_offload_memory_gib: host-RAM KV tier below the pool, in GiB (0: off).
        kv_offload_disk_path: directory of the disk KV tier (None: off); it survives restarts.
        kv_offload_disk_size_gib: most GiB the disk tier keeps (None: 16 GiB); needs
            ``kv_offload_disk_path``.
        kv_offload_disk_drive_size_gib: size of the drive under it, for the drive-writes-per-day
            estimate (None: the tier's size); needs ``kv_offload_disk_path``.
        kv_cache_dtype: ``auto`` (the model's dtype), ``int8`` or ``fp8_e4m3`` (``fp8``): K/V stored in one
            byte with a float16 scale per token and KV head (tokenmill/attention/kv_quant.py).
        state_checkpoint_interval: hybrid (linear-attention) models with prefix caching: keep the linear
            layers' state every this many blocks, so a prefix hit resumes from the latest one at or
            below the matched length (docs/hybrid_models.md).
        state_cache_memory_gib: hybrid models: memory budget in GiB for the linear-attention state pool
            (live state slots, at most ``max_num_seqs``, then prefix-cache state checkpoints); None:
            ``max_num_seqs`` of each (``kv_cache.state_slots.state_pool_sizes``).
        session_kv_ttl: seconds an agent session's cached blocks (requests with a ``session_id``) stay ahead of
            plain LRU eviction after its request ends (0: off; needs prefix caching).

    Raises:
        ConfigError: a setting out of range, or a disk-tier size without a disk-tier path.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 2.0
    enable_prefix_caching: bool = True
    kv_offload_memory_gib: float = 0.0
    kv_offload_disk_path: str | None = None
    kv_offload_disk_size_gib: float | None = None
    kv_offload_disk_drive_size_gib: float | None = None
    kv_cache_dtype: str = "auto"
    state_checkpoint_interval: int = 8
    state_cache_memory_gib: float | None = None
    session_kv_ttl: float = 0.0

    @property
    def disk_tier_size_gib(self) -> float:
        """GiB the disk tier keeps: ``kv_offload_disk_size_gib`` or the 16 GiB default."""
        if self.kv_offload_disk_size_gib is None:
            return DEFAULT_KV_OFFLOAD_DISK_SIZE_GIB
        return self.kv_offload_disk_size_gib

    @property
    def kv_offload_enabled(self) -> bool:
        """Whether any KV tier below the primary pool is configured."""
        return self.kv_offload_memory_gib > 0 or self.kv_offload_disk_path is not None

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "int8", "fp8_e4m3", "fp8"):
            raise ConfigError(f"`kv_cache_dtype` must be auto, int8, fp8_e4m3 or fp8, got {self.kv_cache_dtype!r}")
        check_int("block_size", self.block_size)
        check_int("state_checkpoint_interval", self.state_checkpoint_interval)
        check_int("num_kv_blocks", self.num_kv_blocks, optional=True)
        check_number("kv_cache_memory", self.kv_cache_memory_gib, 0, inclusive=False)
        check_number("state_cache_memory", self.state_cache_memory_gib, 0, inclusive=False, optional=True)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_number("kv_offload_memory", self.kv_offload_memory_gib, 0, inclusive=True)
        check_number("session_kv_ttl", self.session_kv_ttl, 0, inclusive=True)
        if self.session_kv_ttl and not self.enable_prefix_caching:
            raise ConfigError("`session_kv_ttl` keeps sessions' cached blocks and needs prefix caching, which "
                              "`!enable_prefix_caching` turns off")
        if self.kv_offload_disk_path is not None and not isinstance(self.kv_offload_disk_path, str):
            raise ConfigError(f"`kv_offload_disk_path` must be a path, got {self.kv_offload_disk_path!r}")
        if self.kv_offload_disk_path is not None and not self.kv_offload_disk_path:
            raise ConfigError("`kv_offload_disk_path` must not be empty")
        for name, value in (("kv_offload_disk_size", self.kv_offload_disk_size_gib),
                            ("kv_offload_disk_drive_size", self.kv_offload_disk_drive_size_gib)):
            if value is None:
                continue
            check_number(name, value, 0, inclusive=False)
            if self.kv_offload_disk_path is None:
                raise ConfigError(f"`{name}` sizes the disk KV tier, which is off: give `kv_offload_disk_path` too")
        if self.kv_offload_enabled and not self.enable_prefix_caching:
            raise ConfigError(
                "the KV offload tiers (`kv_offload_memory`, `kv_offload_disk_path`) are keyed by block hash and "
                "need prefix caching, which `!enable_prefix_caching` turns off"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    Args:
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one engine step (prefill chunks + decodes).
        max_model_len: longest prompt + output a request may have, in tokens (None: the
            model's ``max_position_embeddings``, resolved by the engine).
        enable_chunked_prefill: split long prompts across steps under the budget.
        max_loras: most distinct LoRA adapters in one step (None: LoRA off); the engine copies it
            from ``LoRAConfig``.
        policy: "fcfs" (first come, first served) or "priority" (``Request.priority``, lower first; ties by
            arrival; lower-priority running requests are preempted for higher ones: ``scheduler.Scheduler``).
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    max_loras: int | None = None
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs)
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"`scheduling_policy` must be 'fcfs' or 'priority', got {self.policy!r}")
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_int("max_model_len", self.max_model_len, optional=True)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        check_int("max_loras", self.max_loras, optional=True)
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ConfigError(
                "`max_num_batched_tokens` must be >= `max_model_len` when `!enable_chunked_prefill` turns "
                f"chunked prefill off ({self.max_num_batched_tokens} < {self.max_model_len})"
            )


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (``enable_lora``): PEFT adapters applied per request, many in one batch.

    Args:
        max_loras: adapter slots on the device: the most distinct adapters in one step.
        max_lora_rank: the largest adapter rank accepted; slot weights are padded to it.
        max_cpu_loras: adapters kept loaded in host memory (LRU); None: ``max_loras``.

    Raises:
        ConfigError: a value out of range, or ``max_cpu_loras`` below ``max_loras``.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        check_int("max_loras", self.max_loras)
        check_int("max_lora_rank", self.max_lora_rank, maximum=1024)
        check_int("max_cpu_loras", self.max_cpu_loras, optional=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"`max_cpu_loras` ({self.max_cpu_loras}) must be >= `max_loras` ({self.max_loras}): "
                              "host memory holds at least the adapters of one step")

    @property
    def host_capacity(self) -> int:
        """Adapters kept in host memory: ``max_cpu_loras`` or, unset, ``max_loras``."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Constrained decoding settings (vLLM's ``--structured-outputs-config``).

    Args:
        backend: ``auto`` (= ``guidance``), ``guidance`` (llguidance) or ``xgrammar``.

    Raises:
        ConfigError: an unknown backend.
    """

    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "guidance", "xgrammar"):
            raise ConfigError(f"`structured_outputs_config` backend must be 'auto', 'guidance' or 'xgrammar', "
                              f"got {self.backend!r}")

    @classmethod
    def from_value(cls, value: "StructuredOutputsConfig | dict | str | None") -> "StructuredOutputsConfig":
        """From a config, a dict, its JSON text (``'{"backend": "xgrammar"}'``) or None (defaults).

        Raises:
            ConfigError: not JSON, not an object, or an unknown key or backend.
        """
        return config_from_value(cls, value, "structured_outputs_config", '{"backend": "xgrammar"}')


KV_EVENTS_PUBLISHERS = ("zmq", "null")
KV_EVENTS_FORMATS = ("tokenmill", "vllm")  # the payload encoding (tokenmill.kv_events.events)


def _local_endpoint(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint is reachable from this host only: ``ipc://`` (a file; not ``ipc://@name``),
    or ``tcp://`` on a loopback address (``127.0.0.0/8``, ``[::1]``, ``localhost``); ``*``, interface names and other
    addresses are not."""
    if endpoint.startswith("ipc://"):
        return not endpoint.startswith("ipc://@")  # Linux's abstract namespace has no file permissions
    return is_loopback(endpoint[len("tcp://"):].rpartition(":")[0])


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events (vLLM's ``--kv-events-config``, same field names): the engine reports every
    block that enters or leaves a KV tier, so a router can keep a global index (docs/kv_events.md).

    Args:
        enable_kv_cache_events: publish events at all (off: no collector, zero cost).
        publisher: ``zmq`` (ZeroMQ PUB socket) or ``null`` (collect and drop; for tests).
        endpoint: where the PUB socket binds (``tcp://127.0.0.1:5557``; ``tcp://127.0.0.1:*`` picks a free
            port, reported in ``/debug/status``; ``ipc:///run/dir/kv-events`` makes a 0600 socket file).
            Events carry every prompt's token ids: an address beyond loopback needs CURVE keys (below)
            or ``allow_insecure_bind``.
        replay_endpoint: where a ROUTER socket binds to serve the recent batches to a subscriber
            that missed some (None: no replay); the same rules as ``endpoint``.
        curve_secret_key_file: the publisher's CURVE certificate (secret half, written by
            ``zmq.auth.create_certificates``; mode 0600): both sockets then encrypt and admit only the
            clients in ``curve_client_keys_dir``.
        curve_client_keys_dir: a directory of the subscribers' public certificates (``*.key``); needed
            with ``curve_secret_key_file``.
        allow_insecure_bind: bind a ``tcp://`` address beyond loopback without CURVE (anyone who can
            reach the port reads the prompts' token ids); off by default.
        buffer_steps: batches (engine steps with events) kept for replay.
        hwm: ZeroMQ high-water mark of the PUB socket, in messages (per subscriber).
        max_queue_size: batches waiting between the engine thread and the publisher thread; a
            batch that finds the queue full is dropped (counted), never waited for.
        topic: the first frame of every published message (subscribers filter on it).
        format: the payload encoding: ``tokenmill`` (msgpack maps with the publisher ``instance`` and the
            tiers' names) or ``vllm`` (vLLM's ``KVEventBatch``: msgspec array-like structs, read by
            decoders written for vLLM; docs/kv_events.md).

    Raises:
        ConfigError: an unknown publisher, a malformed endpoint or a count out of range.
    """

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    curve_secret_key_file: str | None = None
    curve_client_keys_dir: str | None = None
    allow_insecure_bind: bool = False
    format: str = "tokenmill"

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError(f"`kv_events_config` enable_kv_cache_events must be true or false, "
                              f"got {self.enable_kv_cache_events!r}")
        if self.publisher not in KV_EVENTS_PUBLISHERS:
            raise ConfigError(f"`kv_events_config` publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name, value in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not re.fullmatch(r"(tcp|ipc)://\S+", value):
                raise ConfigError(f"`kv_events_config` {name} must be a ZeroMQ endpoint such as 'tcp://127.0.0.1:5557' or "
                                  f"'ipc:///tmp/kv-events', got {value!r}")
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":*"):
            raise ConfigError("`kv_events_config` replay_endpoint must differ from endpoint")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigError(f"`kv_events_config` {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.topic, str):
            raise ConfigError(f"`kv_events_config` topic must be a string, got {self.topic!r}")
        if self.format not in KV_EVENTS_FORMATS:
            raise ConfigError(f"`kv_events_config` format must be 'tokenmill' or 'vllm', got {self.format!r}")
        if not isinstance(self.allow_insecure_bind, bool):
            raise ConfigError(f"`kv_events_config` allow_insecure_bind must be true or false, "
                              f"got {self.allow_insecure_bind!r}")
        keys = (self.curve_secret_key_file, self.curve_client_keys_dir)
        if any(k is not None and not isinstance(k, str) for k in keys) or (keys[0] is None) != (keys[1] is None):
            raise ConfigError("`kv_events_config` curve_secret_key_file and curve_client_keys_dir go together "
                              f"(paths), got {keys[0]!r} and {keys[1]!r}")
        for name, value in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if value is not None and keys[0] is None and not self.allow_insecure_bind and not _local_endpoint(value):
                raise ConfigError(f"`kv_events_config` {name} {value!r} listens beyond loopback without CURVE keys: "
                                  "anyone who can reach it reads every prompt's token ids. Bind tcp://127.0.0.1:PORT "
                                  "or an ipc:// path, or set curve_secret_key_file and curve_client_keys_dir "
                                  "(docs/kv_events.md), or set allow_insecure_bind: true")

    @classmethod
    def from_value(cls, value: "KVEventsConfig | dict | str | None") -> "KVEventsConfig":
        """From a config, a dict, its JSON text (``'{"enable_kv_cache_events": true}'``) or None (off).

        Raises:
            ConfigError: not JSON, not an object, an unknown key or a bad value.
        """
        return config_from_value(cls, value, "kv_events_config", '{"enable_kv_cache_events": true}')


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine. ``model`` is a path, a GGUF file or None (embedded default).

    ``deterministic``: batch-invariant mode — a request's tokens and log-probabilities are
    bit-identical whatever else runs with it (docs/deterministic.md).
    ``device``: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
    ``gpu_memory_utilization``: on CUDA, the fraction of device memory for weights, activations
    and the KV pool, which gets what a profiling forward leaves (CPU: ``cache.kv_cache_memory_gib``).
    ``enforce_eager``: on CUDA, run decode steps eagerly instead of replaying CUDA graphs.
    ``cpu_kernels``: on CPU, run the compiled C kernels where they beat torch on this machine
    (tokenmill.runner.cpu_kernels); False puts every layer on torch's ops (deterministic mode
    needs them, so the two together are refused).
    ``lora``: multi-LoRA settings (None: LoRA off, ``enable_lora=False``).
    ``kv_events_config``: KV cache events for a KV-aware router (off by default; docs/kv_events.md).
    ``speculative_config``: speculative decoding (None: off; docs/spec_decode.md).
    ``kv_transfer_config``: prefill/decode disaggregation (None: off; docs/pd_disaggregation.md).
    ``quantization``: "gguf", "int8", "none", or None for the model's default (docs/quantization.md).
    """

    model: str | None = None
    dtype: str = "auto"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None
    tokenizer: str | None = None
    deterministic: bool = False
    device: str = "auto"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    cpu_kernels: bool = True
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora: LoRAConfig | None = None
    kv_events_config: KVEventsConfig = field(default_factory=KVEventsConfig)
    speculative_config: SpeculativeConfig | None = None
    kv_transfer_config: KVTransferConfig | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization not in (None, "gguf", "int8", "none"):
            raise ConfigError(f"`quantization` must be 'gguf', 'int8' or 'none', got {self.quantization!r}")
        if self.lora is not None and not isinstance(self.lora, LoRAConfig):
            raise ConfigError(f"`enable_lora` settings must be a LoRAConfig, got {self.lora!r}")
        check_bool("deterministic", self.deterministic)
        check_bool("enforce_eager", self.enforce_eager)
        check_bool("cpu_kernels", self.cpu_kernels)
        if self.deterministic and not self.cpu_kernels:
            raise ConfigError("`deterministic` runs on the batch-invariant C kernels, which `!cpu_kernels` turns off: "
                              "drop one of the two")
        check_int("seed", self.seed, minimum=0, maximum=2**63 - 1)
        check_int("num_threads", self.num_threads, optional=True)
        if not isinstance(self.device, str):
            raise ConfigError(f"`device` must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.device not in ("auto", "cpu", "cuda") and not (
            self.device.startswith("cuda:") and self.device[5:].isdigit()
        ):
            raise ConfigError(f"`device` must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        check_number("gpu_memory_utilization", self.gpu_memory_utilization, 0, inclusive=False, maximum=1)
