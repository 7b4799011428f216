"""Engine set-up for hybrid (linear-attention) models: the state pool beside the KV pool, and the features
that do not handle linear-layer state yet turned off or refused (docs/hybrid_models.md)."""
from __future__ import annotations

import logging

from tokenmill.config import ConfigError

logger = logging.getLogger(__name__)


def attach_state_pool(engine) -> None:
    """Give ``engine`` (an LLMEngine whose runner and KV cache manager exist) one linear-state slot per
    ``max_num_seqs`` sequence; prefix caching is switched off with a logged reason.

    Raises:
        ConfigError: a setting whose feature does not carry linear-layer state yet (CUDA backend,
            `speculative_config`, `kv_transfer_config`, KV offload tiers, `deterministic`).
    """
    config = engine.config
    for name, on in (("speculative_config", config.speculative_config is not None),
                     ("kv_transfer_config", config.kv_transfer_config is not None),
                     ("kv_offload_memory", engine.kv_store is not None),
                     ("deterministic", config.deterministic)):  # the chunked rule's sums are not batch invariant
        if on:
            raise ConfigError(f"`{name}` does not support hybrid linear-attention models yet (docs/hybrid_models.md)")
    if engine.device.type != "cpu":
        raise ConfigError(f"hybrid linear-attention models run on the CPU backend for now, not {engine.device.type}")
    kv = engine.kv_cache_manager
    if kv.enable_caching:
        logger.warning("prefix caching is off for this hybrid model: its linear layers keep no state checkpoints "
                       "yet, so a cached prefix could not be resumed (docs/hybrid_models.md)")
        kv.enable_caching = False
    kv.state_slots = engine.runner.allocate_state_cache(engine.scheduler_config.max_num_seqs)
    logger.info("linear-attention state pool: %d slots x %d bytes/sequence", kv.state_slots.num_slots,
                engine.runner.state_cache.bytes_per_sequence)
