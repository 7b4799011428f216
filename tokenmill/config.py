"""Frozen configuration records. Each component takes only the config it needs.

Derived values are properties, never written back after construction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


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
        kv_offload_disk_size_gib: most GiB the disk tier keeps.
        kv_offload_disk_drive_size_gib: size of the drive under it, for the drive-writes-per-day
            estimate (None: ``kv_offload_disk_size_gib``).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 2.0
    enable_prefix_caching: bool = True
    kv_offload_memory_gib: float = 0.0
    kv_offload_disk_path: str | None = None
    kv_offload_disk_size_gib: float = 16.0
    kv_offload_disk_drive_size_gib: float | None = None

    @property
    def kv_offload_enabled(self) -> bool:
        """Whether any KV tier below the primary pool is configured."""
        return self.kv_offload_memory_gib > 0 or self.kv_offload_disk_path is not None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory_gib}")
        if not 0 <= self.kv_offload_memory_gib < math.inf:
            raise ValueError(f"kv_offload_memory must be a finite number >= 0 GiB, got {self.kv_offload_memory_gib}")
        if self.kv_offload_disk_path is not None and not self.kv_offload_disk_path:
            raise ValueError("kv_offload_disk_path must not be empty")
        if not 0 < self.kv_offload_disk_size_gib < math.inf:
            raise ValueError(
                f"kv_offload_disk_size must be a finite number > 0 GiB, got {self.kv_offload_disk_size_gib}"
            )
        if self.kv_offload_disk_drive_size_gib is not None and not 0 < self.kv_offload_disk_drive_size_gib < math.inf:
            raise ValueError(
                f"kv_offload_disk_drive_size must be a finite number > 0 GiB, got {self.kv_offload_disk_drive_size_gib}"
            )
        if self.kv_offload_enabled and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offload_memory / kv_offload_disk_path need enable_prefix_caching (tiers are keyed by block hash)"
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
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when chunked prefill is off "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine. ``model`` is a path, a GGUF file or None (embedded default).

    ``deterministic``: batch-invariant mode — a request's tokens and log-probabilities are
    bit-identical whatever else runs with it (docs/deterministic.md).
    ``device``: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
    ``gpu_memory_utilization``: on CUDA, the fraction of device memory for weights, activations
    and the KV pool, which gets what a profiling forward leaves (CPU: ``cache.kv_cache_memory_gib``).
    ``enforce_eager``: on CUDA, run decode steps eagerly instead of replaying CUDA graphs.
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

    def __post_init__(self) -> None:
        for name in ("deterministic", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.device not in ("auto", "cpu", "cuda") and not (
            self.device.startswith("cuda:") and self.device[5:].isdigit()
        ):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
