"""The engine-thread side of RL rollouts: copy new weights in place, flush or fence the KV tiers,
free and restore the KV pool and the weights (sleep / wake up), abort everything with a final output.

``RLEngineOps`` is a mixin of ``LLMEngine``: its methods run between engine steps on the thread that owns
the engine (the offline ``LLM`` calls them directly, the server through ``AsyncEngine.call``), and all but
``abort_all`` need the engine idle (no unfinished request). The weight bookkeeping lives in ``RLState``
(``LLMEngine.rl_state``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenmill.outputs import RequestOutput
from tokenmill.request import RequestStatus
from tokenmill.rl.checkpoint import (
    Target, WeightUpdateError, check_dense, check_tensor_specs, copy_into, is_ignored, read_checkpoint,
    resolve_checkpoint, weight_targets,
)

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.output_processor import OutputProcessor
    from tokenmill.kv_cache import KVCacheManager
    from tokenmill.kv_offload.store import TieredKVStore
    from tokenmill.models.loader import LoadedModel
    from tokenmill.runner.model_runner import ModelRunner
    from tokenmill.scheduler import Scheduler

logger = logging.getLogger(__name__)

INITIAL_WEIGHT_VERSION = "default"  # SGLang's default --weight-version


@dataclass
class RLState:
    """Weight bookkeeping of one engine.

    Attributes:
        weight_version: the label of the weights being served (reported with every response).
        source_path: where exactly these weights can be read again (the model path, or the last
            ``update_weights_from_disk`` path); None after a tensor update.
        loaded_at: Unix time the current weights were loaded or last updated.
        load_seconds: how long that load or update took (seconds).
        targets: checkpoint name -> parameter slot, fixed at load (shapes never change).
        num_updates, num_flushes: counters (updates applied; prefix-cache flushes, any cause).
        epoch: bumped by each update made without a flush; non-zero epochs key block hashes.
        fingerprint: ``model_fingerprint`` of the current weights, computed when first asked.
        sleep_level: 0 awake, 1 KV pool freed, 2 KV pool and weights freed.
    """

    weight_version: str
    source_path: str | None
    loaded_at: float
    load_seconds: float
    targets: dict[str, Target]
    use_gguf_cache: bool = False  # source_path is the GGUF file the engine loaded (its dequantized cache exists)
    num_updates: int = 0
    num_flushes: int = 0
    epoch: int = 0
    fingerprint: str | None = None
    sleep_level: int = 0
    weights_freed: bool = False
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # while the weights are freed
    host_weights: dict[str, torch.Tensor] | None = None  # level-2 copy when there is no exact source path

    @classmethod
    def initial(cls, loaded) -> RLState:
        """The state of a freshly loaded model (``tokenmill.models.loader.LoadedModel``)."""
        return cls(INITIAL_WEIGHT_VERSION, loaded.model_path, time.time(), loaded.load_seconds,
                   weight_targets(loaded.model), use_gguf_cache=str(loaded.model_path).endswith(".gguf"))


class EngineAsleepError(RuntimeError):
    """The engine is sleeping (its KV pool, and at level 2 its weights, are freed); wake it up first."""


class RLEngineOps:
    """The RL methods of ``LLMEngine`` (a mixin: the engine is the object they use). Each runs between engine
    steps on the thread that owns the engine; all but ``abort_all`` and ``weight_info`` need it idle.

    The engine attributes used, typed here so the methods read as the engine's own: ``rl_state`` (RLState),
    ``loaded`` (the LoadedModel), ``config``, ``runner`` (ModelRunner), ``scheduler``, ``kv_cache_manager``,
    ``kv_store`` (TieredKVStore or None), ``kv_events`` (the publisher or None), ``kv_connector`` (None unless
    PD), ``output_processor``.
    """

    rl_state: RLState
    loaded: LoadedModel
    config: EngineConfig
    runner: ModelRunner
    scheduler: Scheduler
    kv_cache_manager: KVCacheManager
    kv_store: TieredKVStore | None
    kv_events: object | None
    kv_connector: object | None
    output_processor: OutputProcessor

    def check_awake(self) -> None:
        """Raise EngineAsleepError while the engine sleeps."""
        level = self.rl_state.sleep_level
        if level:
            raise EngineAsleepError(f"the engine is sleeping (level {level}); call wake_up first")

    def _check_idle_for(self, what: str) -> None:
        if self.kv_connector is not None:
            # PD disaggregation leases blocks to other engines and checks pulls against a fingerprint it
            # computes once: new weights (or a freed pool) would hand them KV of other weights.
            raise WeightUpdateError(f"{what} is not supported with --kv-transfer-config (prefill/decode "
                                    "disaggregation); start the engine without it", "kv_transfer_config")
        if self.has_unfinished_requests():
            raise RuntimeError(f"{what} needs an idle engine; {self.scheduler.num_running} running and "
                               f"{self.scheduler.num_waiting} waiting requests remain")

    def model_fingerprint(self) -> str:
        """``kv_offload.fingerprint.model_fingerprint`` of the weights served now: the one key that saved
        sessions, transferred blocks and disk-tier records are checked against. Computed once per weight
        version (one pass over the weights) and kept in ``rl_state.fingerprint``; a weight update clears it.

        Raises:
            RuntimeError: the weights are freed (sleep level 2) and were never fingerprinted.
        """
        state = self.rl_state
        if state.fingerprint is None:
            if state.weights_freed:
                raise RuntimeError("the weights are freed (sleep level 2): wake the engine up first")
            from tokenmill.kv_offload.fingerprint import model_fingerprint

            loaded = self.loaded
            state.fingerprint = model_fingerprint(loaded.model, loaded.hf_config, loaded.dtype,
                                                  self.config.cache.block_size, self.runner.kv_pool.dtype)
        return state.fingerprint

    # ---- the prefix cache ----------------------------------------------------------------------------
    def flush_prefix_cache(self, clear_disk: bool = True) -> None:
        """Forget every cached block in the pool and the RAM tier, and with ``clear_disk`` the disk
        records of the current weights (each tier publishes AllBlocksCleared). Needs an idle engine."""
        self._check_idle_for("flushing the prefix cache")
        kv = self.kv_cache_manager
        assert kv.block_pool.reset_prefix_cache(), "an idle engine holds no block"
        if self.kv_store is not None:
            self.kv_store.clear(clear_disk)
        kv.weight_key = None  # nothing older than the current weights is left anywhere
        self.rl_state.num_flushes += 1
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish_pending()

    def _fence_old_blocks(self) -> None:
        """Weights changed without a flush: new block hashes carry the new epoch, so no request hits a
        block made with the old weights, and those blocks are never written to a lower tier."""
        state = self.rl_state
        state.epoch += 1
        kv = self.kv_cache_manager
        kv.weight_key = f"weights:{state.epoch}"
        if self.kv_store is not None:
            self.kv_store.mark_stale(list(kv.block_pool.cached_block_hash_to_block))

    # ---- weight updates ------------------------------------------------------------------------------
    def update_weights(self, tensors: dict[str, torch.Tensor], *, source_path: str | None, flush_cache: bool,
                       weight_version: str | None, started: float | None = None) -> dict:
        """Copy checked tensors (``checkpoint.read_checkpoint`` / ``check_tensor_specs``) into the served
        parameters, then make every KV tier stop serving blocks of the old weights: flushed
        (``flush_cache``) or fenced by the block hashes' weight key; the disk tier moves to the new
        weights' fingerprint directory either way. Needs an idle engine; at sleep level 2 only a full
        checkpoint (``source_path`` set) is accepted, and it fills the freed weights.

        Returns the new ``weight_info``.
        """
        self._check_idle_for("a weight update")
        check_dense(self.loaded.model)
        state = self.rl_state
        if state.weights_freed:
            if source_path is None:
                raise WeightUpdateError("the weights are freed (sleep level 2): send a full checkpoint with "
                                        "update_weights_from_disk, or wake_up first", "serialized_named_tensors")
            self._allocate_weights()
            state.host_weights = None
        copy_into(self.loaded.model, state.targets, tensors)
        state.num_updates += 1
        state.weight_version = weight_version if weight_version is not None else str(state.num_updates)
        state.source_path = source_path
        state.use_gguf_cache = False
        state.fingerprint = None
        if flush_cache:
            self.flush_prefix_cache(clear_disk=False)
        else:
            self._fence_old_blocks()
        store = self.kv_store
        if store is not None and store.disk is not None:
            store.replace_disk(self.model_fingerprint())
        self._publish_kv_events()
        state.loaded_at = time.time()
        state.load_seconds = time.perf_counter() - started if started is not None else 0.0
        logger.info("weights updated to version %r from %s (%s)", state.weight_version, source_path or "tensors",
                    "cache flushed" if flush_cache else f"cache kept, keyed by weight epoch {state.epoch}")
        return self.weight_info(compute_fingerprint=False)

    def update_weights_from_disk(self, model_path: str, flush_cache: bool = True, weight_version: str | None = None
                                 ) -> dict:
        """Read, check and apply a checkpoint in one call on the engine's thread (the offline API; the
        server reads the checkpoint off the engine thread and then calls ``update_weights``)."""
        started = time.perf_counter()
        self._check_idle_for("a weight update")
        check_dense(self.loaded.model)
        tensors = read_checkpoint(model_path, self.loaded.hf_config, self.rl_state.targets,
                                  use_gguf_cache=self.is_served_gguf(model_path))
        return self.update_weights(tensors, source_path=model_path, flush_cache=flush_cache,
                              weight_version=weight_version, started=started)

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True, weight_version: str | None = None
                                   ) -> dict:
        """Replace the named tensors given (``{name: tensor}`` or ``[(name, tensor), ...]``, checkpoint
        names, any subset) in place, checked all or nothing first (the offline API)."""
        started = time.perf_counter()
        self._check_idle_for("a weight update")
        check_dense(self.loaded.model)
        pairs = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                    and isinstance(pair[1], torch.Tensor)):
                raise WeightUpdateError(f"named_tensors[{i}] is not a (name, tensor) pair", "named_tensors")
        targets = self.rl_state.targets
        tie = bool(getattr(self.loaded.hf_config, "tie_word_embeddings", False))
        check_tensor_specs(targets, ((n, tuple(t.shape), t.dtype) for n, t in pairs), tie, partial=True,
                           param="named_tensors")
        tensors = {n: t for n, t in pairs if not is_ignored(n, tie)}
        return self.update_weights(tensors, source_path=None, flush_cache=flush_cache, weight_version=weight_version,
                              started=started)

    def is_served_gguf(self, model_path: str) -> bool:
        """Whether ``model_path`` is the GGUF file the engine was loaded from (its dequantized tensors are in
        the per-machine GGUF cache; other GGUF files are read directly, so a trainer's checkpoints never
        fill the cache)."""
        loaded = Path(str(self.loaded.model_path))
        try:
            _, resolved = resolve_checkpoint(model_path)
        except WeightUpdateError:
            return False
        return loaded.suffix == ".gguf" and resolved.resolve() == loaded.resolve()

    def weight_info(self, compute_fingerprint: bool = True) -> dict:
        """Version, fingerprint (with ``compute_fingerprint`` computed now if not yet known, one pass over
        the weights; None while they are freed), load time and counters of the served weights."""
        state = self.rl_state
        if compute_fingerprint and state.fingerprint is None and not state.weights_freed:
            self.model_fingerprint()
        return {
            "weight_version": state.weight_version,
            "fingerprint": state.fingerprint,
            "model_path": state.source_path,
            "loaded_at": state.loaded_at,
            "load_seconds": state.load_seconds,
            "num_updates": state.num_updates,
            "num_flushes": state.num_flushes,
            "weight_epoch": state.epoch,
            "is_sleeping": state.sleep_level > 0,
            "sleep_level": state.sleep_level,
        }

    # ---- abort ---------------------------------------------------------------------------------------
    def abort_all(self) -> list[RequestOutput]:
        """Finish every unfinished request with finish reason ``abort`` (blocks freed at once) and return
        their final RequestOutputs, so each caller gets a last output saying so."""
        requests = [*self.scheduler.running, *self.scheduler.waiting]
        if not requests:
            return []
        self.scheduler.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_ABORTED)
        outputs, _ = self.output_processor.process(requests)
        return outputs

    # ---- sleep / wake up -----------------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Free the KV pool (level 1; its cached blocks are forgotten, the RAM and disk tiers keep theirs),
        and at level 2 the weights too. Level 2 keeps nothing when the weights can be read again from
        ``source_path``; otherwise (after a tensor update) it keeps a host copy. Needs an idle engine.

        Raises:
            ValueError: ``level`` not 1 or 2 (naming ``level``); EngineAsleepError when already asleep.
        """
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        self.check_awake()
        self._check_idle_for("sleep")
        state = self.rl_state
        runner = self.runner
        assert self.kv_cache_manager.block_pool.reset_prefix_cache()
        state.num_flushes += 1
        self._publish_kv_events()
        runner.release_kv()  # every view (per-layer caches, the tiers') stays valid; CUDA graphs are dropped
        if level == 2:
            self._free_weights()
        state.sleep_level = level
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.info("engine asleep (level %d)", level)

    def wake_up(self) -> None:
        """Restore what ``sleep`` freed: a zeroed KV pool of the same shape, and the weights (read from
        ``source_path`` or the host copy), then capture CUDA graphs again. No-op when awake."""
        state = self.rl_state
        if not state.sleep_level:
            return
        runner = self.runner
        if state.weights_freed:
            self._allocate_weights()
            if state.host_weights is not None:
                params = dict(self.loaded.model.named_parameters())
                with torch.no_grad():
                    for name, tensor in state.host_weights.items():
                        params[name].copy_(tensor)
                state.host_weights = None
            else:
                tensors = read_checkpoint(state.source_path, self.loaded.hf_config, state.targets,
                                          use_gguf_cache=state.use_gguf_cache)
                copy_into(self.loaded.model, state.targets, tensors)
        runner.restore_kv()  # zeroed; CUDA graphs captured again
        state.sleep_level = 0
        logger.info("engine awake")

    def _free_weights(self) -> None:
        state = self.rl_state
        params = dict(self.loaded.model.named_parameters())
        state.param_shapes = {name: tuple(p.shape) for name, p in params.items()}
        try:
            check_dense(self.loaded.model)
            dense = True
        except WeightUpdateError:
            dense = False
        if state.source_path is None or not dense:  # nothing to read them back from: keep them in host memory
            state.host_weights = {name: p.detach().to("cpu", copy=p.device.type != "cpu") for name, p in params.items()}
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for module in self.loaded.model.modules():  # copies derived from the weights (DeepSeek's absorbed MLA)
            drop = getattr(module, "drop_derived_weights", None)
            if drop is not None:
                drop()
        state.weights_freed = True

    def _allocate_weights(self) -> None:
        state = self.rl_state
        for name, p in self.loaded.model.named_parameters():
            p.data = torch.empty(state.param_shapes[name], dtype=p.dtype, device=p.device)
        state.weights_freed = False
