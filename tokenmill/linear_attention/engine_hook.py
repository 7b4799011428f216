"""Engine set-up for hybrid (linear-attention) models: the state pool beside the KV pool, the prefix cache's state
checkpoints, deterministic mode's batch-invariant linear layers, and the features that do not handle linear-layer
state yet refused (docs/hybrid_models.md)."""
from __future__ import annotations

import logging

from tokenmill.config import ConfigError
from tokenmill.kv_cache.state_slots import GIB, StateCheckpoints, state_bytes_per_sequence, state_pool_sizes

logger = logging.getLogger(__name__)


def build_state_pool(engine):
    """Allocate the linear-state pool of ``engine`` (an LLMEngine whose runner exists, before its KV tiers and KV
    cache manager), sized by ``state_pool_sizes``: without ``state_cache_memory`` one slot per ``max_num_seqs`` sequence
    and, with prefix caching, ``max_num_seqs`` state checkpoints; with it, as many sequences' state as the budget
    holds (live slots first, at most ``max_num_seqs``, then checkpoints). Checkpoints are taken every
    ``state_checkpoint_interval`` blocks (dropped with their KV block, or, with KV offload tiers, kept while the
    block lives on below the pool until the LRU reuses them; all dropped by a prefix-cache reset).

    Returns the ``StateSlotAllocator`` the KV cache manager is built with (its checkpoints listen to the block
    pool). On CUDA the linear layers run fla-core's kernels when it is installed, else the torch reference (logged).

    Raises:
        ConfigError: a setting whose feature does not carry linear-layer state yet (`speculative_config`,
            `kv_transfer_config`, a device other than CPU or CUDA); a `state_cache_memory` that holds no sequence's
            state.
    """
    config = engine.config
    for name, on, why in (
            ("speculative_config", config.speculative_config is not None, "a rejected draft would have to roll "
             "the recurrent state back"),
            ("kv_transfer_config", config.kv_transfer_config is not None, "transferred blocks carry no linear-layer "
             "state checkpoints")):
        if on:
            raise ConfigError(f"`{name}` does not support hybrid linear-attention models yet: {why} "
                              "(docs/hybrid_models.md)")
    if engine.device.type not in ("cpu", "cuda"):
        raise ConfigError(f"hybrid linear-attention models run on the CPU and CUDA backends, not {engine.device.type}")
    if engine.device.type == "cuda":
        log_cuda_kernels()
    model = engine.runner.model
    caching = config.cache.enable_prefix_caching
    per_seq = state_bytes_per_sequence(*model.linear_state_shapes(), engine.loaded.dtype.itemsize)
    budget = config.cache.state_cache_memory_gib
    num_seqs, num_checkpoints = state_pool_sizes(None if budget is None else int(budget * GIB), per_seq,
                                                 engine.scheduler_config.max_num_seqs, caching)
    if caching and not num_checkpoints:
        logger.warning("`state_cache_memory` leaves no room for prefix-cache state checkpoints beside %d live slots: "
                       "prefix hits on this hybrid model recompute the prompt", num_seqs)
    checkpoints = None
    if num_checkpoints:
        # A checkpoint leaves with its KV block; with lower tiers the block lives on there, and its checkpoint too.
        checkpoints = StateCheckpoints(num_checkpoints, config.cache.state_checkpoint_interval,
                                       drop_on_evict=not config.cache.kv_offload_enabled)
    slots = engine.runner.allocate_state_cache(num_seqs, checkpoints)
    cache = engine.runner.kv_pool.state
    if config.deterministic:
        from tokenmill.linear_attention import invariant_ops

        if not invariant_ops.available():
            raise ConfigError("`deterministic` needs the batch-invariant Gated DeltaNet kernel, which could not be "
                              "built: install a C compiler (gcc) with OpenMP")
        enable_batch_invariant_linear(engine.runner.model)
        cache.batch_invariant = True
    logger.info("linear-attention state pool: %d slots x %d bytes/sequence; %d prefix-cache state checkpoints "
                "every %d blocks (%d bytes)", slots.num_slots, cache.bytes_per_sequence, num_checkpoints,
                config.cache.state_checkpoint_interval, cache.checkpoint_bytes)
    return slots


def log_cuda_kernels() -> None:
    """Say which gated delta rule kernels a CUDA engine's linear layers run: fla-core's, or the torch reference."""
    from tokenmill.linear_attention import fla_ops

    version = fla_ops.version()
    if version is not None:
        logger.info("linear attention on CUDA: fla-core %s kernels (chunk_gated_delta_rule for prefill, "
                    "fused_recurrent_gated_delta_rule for decode)", version)
    else:
        logger.warning("linear attention on CUDA: fla-core is not installed, so the Gated DeltaNet layers run the "
                       "torch reference (slow); install it with `pip install 'tokenmill[fla]'`")


def enable_batch_invariant_linear(model) -> int:
    """Put a hybrid model's own layers (Gated DeltaNet, zero-centred and gated RMSNorms, the attention output
    gate) on their batch-invariant paths; the runner already switched its Linear / SiLU / attention layers.
    Returns the number of modules switched."""
    from tokenmill.models.qwen3_next import BATCH_INVARIANT_MODULES

    count = 0
    for module in model.modules():
        if isinstance(module, BATCH_INVARIANT_MODULES):
            module.batch_invariant = True
            count += 1
    return count
