"""KV-cache sizing arithmetic shared by the model runner and `tokenmill plan`. Pure Python."""
from __future__ import annotations

from tokenmill.config import ConfigError

GIB = 1024**3


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                       num_planes: int = 2) -> int:
    """Bytes of K and V one token occupies across all layers: planes × layers × kv_heads × head_dim × bytes
    (planes 2, K and V; 1 for multi-head latent attention, whose kv_heads is 1 and head_dim the latent width:
    layers × (kv_lora_rank + qk_rope_head_dim) × bytes)."""
    return num_planes * num_layers * num_kv_heads * head_dim * dtype_bytes


def latent_kv_dim(config: object) -> int | None:
    """The per-token latent width ``kv_lora_rank + qk_rope_head_dim`` a multi-head latent attention model
    (DeepSeek-V2/V3: a config with ``kv_lora_rank``) caches per layer in one plane, or None for other models."""
    rank = getattr(config, "kv_lora_rank", None)
    if not rank:
        return None
    return int(rank) + int(getattr(config, "qk_rope_head_dim", 0) or 0)


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole KV blocks fit in ``budget_bytes``.

    Raises:
        ConfigError: not even one block fits (naming ``kv_cache_memory`` and ``block_size``).
    """
    bytes_per_block = block_size * bytes_per_token
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(
            f"`kv_cache_memory` of {budget_bytes / GIB:.3g} GiB holds no KV block of {bytes_per_block} bytes "
            f"(`block_size` {block_size} x {bytes_per_token} bytes per token): raise `kv_cache_memory` or "
            "lower `block_size`"
        )
    return int(num_blocks)
