"""Frozen configuration records. Each component takes only the config it needs.

Derived values are properties, never written back after construction.
"""
from __future__ import annotations

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
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 2.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory_gib}")


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
    """Everything needed to build an engine. ``model`` is a path, a GGUF file or None (embedded default)."""

    model: str | None = None
    dtype: str = "auto"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None
    tokenizer: str | None = None
