"""LLMEngine: request intake and the step loop (schedule → execute → update → detokenize).

Synchronous and single-threaded; the server drives it from its own thread.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import replace

import torch

from tokenmill import envs
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.stats_logger import StatsLogger
from tokenmill.kv_cache import KVCacheManager
from tokenmill.kv_events import KVEventCollector
from tokenmill.kv_offload import build_kv_store
from tokenmill.kv_transfer.blocks import BlockIO, tokenizer_fingerprint
from tokenmill.layers.rotary_embedding import set_rope_max_model_len
from tokenmill.lora import LoRARequest
from tokenmill.lora.manager import LoRAManager
from tokenmill.models.loader import load_model
from tokenmill.outputs import RequestOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.rl.engine_ops import RLEngineOps, RLState
from tokenmill.runner.device import resolve_device
from tokenmill.runner.cpu_threads import available_cpus
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import Scheduler
from tokenmill.spec_decode import NgramSpeculator, Speculator
from tokenmill.startup_gc import collector_off_while_loading
from tokenmill.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

# A prompt: text, token ids, or {"prompt": str} / {"prompt_token_ids": list[int]}.
PromptType = str | list[int] | dict


class InjectedFault(RuntimeError):
    """The failure ``TOKENMILL_FAULT_INJECT_STEP`` raises in a model forward (tests of step failures)."""


class StepFailedError(RuntimeError):
    """A model forward raised: the step's requests cannot go on, the engine can.

    ``request_ids``: the ids (as given to ``add_request``) of the requests scheduled in the failed step, still
    in the engine: the caller aborts them (``abort_request`` frees their blocks). ``cause``: what the forward
    raised. The prefix-cache entries of the blocks that step was to write are already gone, so no later request
    can hit K/V that was never written.
    """

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause


class LLMEngine(RLEngineOps):
    """Owns the model runner, the scheduler (and through it the KV cache) and the output processor."""

    def __init__(self, config: EngineConfig) -> None:
        with collector_off_while_loading():  # no collection in the middle of the load (tokenmill/startup_gc.py)
            self._build(config)

    def _build(self, config: EngineConfig) -> None:
        # Objects frozen by an earlier engine in this process go back under the collector first, and a
        # dropped engine's reference cycles are freed before this one loads its weights (tests build many
        # engines in one process).
        if gc.get_freeze_count():
            gc.unfreeze()
            gc.collect()
        torch.set_num_threads(config.num_threads or available_cpus())
        torch.manual_seed(config.seed)
        t0 = time.perf_counter()
        self.device = resolve_device(config.device)
        if config.deterministic and self.device.type != "cpu":  # refuse before loading any weights
            from tokenmill.runner.deterministic import check_deterministic_supported

            check_deterministic_supported(torch.float32, self.device)
        if config.lora is not None and self.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"`enable_lora` runs on the CPU and CUDA backends, not {self.device.type}")
        self.loaded = load_model(config.model, config.dtype, device=self.device, quantization=config.quantization)
        self.tokenizer = self.loaded.tokenizer
        model_max = self.loaded.max_position_embeddings
        max_model_len = config.scheduler.max_model_len or model_max
        if max_model_len > model_max:
            raise ConfigError(f"`max_model_len` {max_model_len} exceeds the model's max_position_embeddings {model_max}")
        try:
            self.scheduler_config = replace(config.scheduler, max_model_len=max_model_len,
                                            max_loras=None if config.lora is None else config.lora.max_loras)
        except ConfigError as exc:
            if config.scheduler.max_model_len is not None:
                raise
            raise ConfigError(
                f"{exc.template}; `max_model_len` defaults to the model's max_position_embeddings ({model_max}): "
                "lower it or raise `max_num_batched_tokens`"
            ) from None
        self.config = replace(config, scheduler=self.scheduler_config)
        self.lora_manager: LoRAManager | None = None  # adapters, with config.lora (installs the Linear hooks)
        if config.lora is not None:
            self.lora_manager = LoRAManager(config.lora, self.loaded.model, self.loaded.dtype, self.device)
        if self.device.type == "cpu":
            if config.cache.kv_cache_dtype != "auto" and config.deterministic:
                raise ConfigError("`kv_cache_dtype` int8/fp8 is not batch-invariant yet: drop it or `deterministic`")
            self.runner = ModelRunner(
                self.loaded, config.cache.block_size, config.cache.num_kv_blocks, config.cache.kv_cache_memory_gib,
                deterministic=config.deterministic, cpu_kernels=config.cpu_kernels, lora_manager=self.lora_manager,
                kv_cache_dtype=config.cache.kv_cache_dtype,
            )
        else:
            if config.cache.kv_cache_dtype != "auto":
                raise ConfigError("`kv_cache_dtype` int8/fp8 runs on the CPU backend for now")
            from tokenmill.runner.cuda_runner import CudaModelRunner

            self.runner = CudaModelRunner(
                self.loaded, config.cache, self.scheduler_config, config.gpu_memory_utilization,
                enforce_eager=config.enforce_eager, lora_manager=self.lora_manager,
            )
        if self.runner.num_kv_tokens < max_model_len:
            # One request must always fit in the pool, or it would wait (or be preempted) forever.
            if config.scheduler.max_model_len is not None:
                raise ConfigError(
                    f"`max_model_len` {max_model_len} exceeds the KV cache capacity of {self.runner.num_kv_tokens} "
                    "tokens; raise `kv_cache_memory` (CPU) / `gpu_memory_utilization` (CUDA) / `num_kv_blocks` "
                    "or lower `max_model_len`"
                )
            logger.warning("max_model_len lowered from %d to the KV cache capacity, %d tokens",
                           max_model_len, self.runner.num_kv_tokens)
            max_model_len = self.runner.num_kv_tokens
            self.scheduler_config = replace(self.scheduler_config, max_model_len=max_model_len)
            self.config = replace(self.config, scheduler=self.scheduler_config)
        # longrope RoPE (Phi-3 128k): short or long factors chosen once by the final max_model_len, before any K/V
        set_rope_max_model_len(self.loaded.model, max_model_len)
        # KV events (docs/kv_events.md): the pool, the manager and the tiers report into one collector.
        kv_events = KVEventCollector(config.cache.block_size) if config.kv_events_config.enable_kv_cache_events else None
        if kv_events is not None and not config.cache.enable_prefix_caching:
            logger.warning("KV events are on but prefix caching is off: no block is ever cached, so none is reported")
        self.rl_state = RLState.initial(self.loaded)  # weight version and sleep state (tokenmill/rl, docs/rl.md)
        self._tokenizer_fingerprint: str | None = None
        self.kv_cache_manager = self._build_kv_cache(max_model_len, kv_events)
        if self.kv_store is not None and self.kv_store.disk is not None:  # the disk tier fingerprinted the weights
            self.rl_state.fingerprint = self.kv_store.disk.fingerprint.hex()
        # Whole blocks in and out of the pool: sessions, and KV transfer's fingerprint (docs/sessions.md).
        self.block_io = BlockIO(self.runner.kv_pool, self.kv_cache_manager, self.kv_store, self.fingerprints,
                                self.lora_manager)
        self.kv_connector = None  # prefill/decode disaggregation (tokenmill/kv_transfer, docs/pd_disaggregation.md)
        if config.kv_transfer_config is not None:
            self.kv_connector = self._build_kv_connector(config.kv_transfer_config)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager,
                                   None if self.kv_connector is None else self.kv_connector.scheduler_side)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured_output_manager = StructuredOutputManager(
            config.structured_outputs_config, self.tokenizer, self.loaded.vocab_size, self.loaded.eos_token_ids
        )
        self.speculator: Speculator | None = None  # speculative decoding (docs/spec_decode.md)
        if config.speculative_config is not None:
            self.speculator = self._build_speculator(config.speculative_config, max_model_len)
        self.stats_logger = StatsLogger()
        self._fault_steps = envs.fault_inject_steps()  # test only (docs/environment.md); empty: no cost per step
        self._num_forwards = 0
        self.model_name = self.loaded.model_path
        self.kv_events = None  # the publisher binds its sockets: last (pyzmq is imported only for it)
        if kv_events is not None:
            from tokenmill.kv_events.publisher import build_kv_event_publisher

            self.kv_events = build_kv_event_publisher(config.kv_events_config, kv_events)
        # Everything alive now (modules, weights, tokenizer tables: ~350k objects) lives as long as the
        # engine: move it out of the collector's generations so that full collections, which would otherwise
        # scan it all in the middle of a decode step (60 ms each here), see only what steps allocate (as
        # vLLM's engine core does after start-up).
        gc.collect()
        gc.freeze()
        logger.info(
            "engine ready in %.1fs: %s (%s), max_model_len=%d, %d KV tokens",
            time.perf_counter() - t0, self.loaded.model_path, self.loaded.dtype, max_model_len, self.runner.num_kv_tokens,
        )

    def _build_kv_cache(self, max_model_len: int, kv_events: KVEventCollector | None) -> KVCacheManager:
        """The KV bookkeeping over the runner's pool, each part given what it listens to at construction: a
        hybrid model's state pool (docs/hybrid_models.md), the host-RAM / disk tiers below the pool
        (``self.kv_store``, None when off; torch-side, so built here, not in kv_cache/) and the KV event collector."""
        config = self.config
        state_slots = None
        if getattr(self.loaded.model, "is_hybrid", False):
            from tokenmill.linear_attention.engine_hook import build_state_pool

            state_slots = build_state_pool(self)
        checkpointed = state_slots is not None and state_slots.checkpoints is not None
        self.kv_store = build_kv_store(config.cache, self.runner.kv_pool, self.loaded, max_model_len,
                                       self.runner.kv_pool.state if checkpointed else None)
        if self.kv_store is not None and kv_events is not None:
            self.kv_store.set_kv_events(kv_events)
        return KVCacheManager(self.runner.num_kv_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                              lower_tiers=self.kv_store, kv_events=kv_events, state_slots=state_slots,
                              session_ttl=config.cache.session_kv_ttl)

    def fingerprints(self) -> tuple[str, str]:
        """(model fingerprint, tokenizer fingerprint) of the weights served now: what saved sessions and
        transferred blocks are checked against. Each computed once (``model_fingerprint``: once per weight
        version) and then reused."""
        if self._tokenizer_fingerprint is None:
            self._tokenizer_fingerprint = tokenizer_fingerprint(self.tokenizer)
        return self.model_fingerprint(), self._tokenizer_fingerprint

    def _build_kv_connector(self, transfer_config):
        from tokenmill.kv_transfer.connector import KVConnector

        if self.device.type != "cpu":
            raise ConfigError("`kv_transfer_config` runs on the CPU backend for now")
        if not self.config.cache.enable_prefix_caching:
            raise ConfigError("`kv_transfer_config` needs prefix caching (transferred blocks are prefix-cache entries)")
        return KVConnector(transfer_config, self.runner.kv_pool, self.config.cache.block_size,
                           self.model_fingerprint)

    def _build_speculator(self, spec_config, max_model_len: int) -> Speculator:
        valid_prefix = self.structured_output_manager.valid_draft_prefix
        if spec_config.method == "ngram":
            return NgramSpeculator(spec_config, max_model_len, valid_prefix)
        if self.device.type != "cpu":
            raise ConfigError("`speculative_config` method 'draft_model' runs on the CPU backend for now")
        from tokenmill.spec_decode.draft_model import DraftModelSpeculator

        plan = self.runner.kernel_plan
        return DraftModelSpeculator(spec_config, max_model_len, self.loaded, self.runner.num_kv_blocks,
                                    self.config.cache.block_size, valid_prefix,
                                    cpu_kernels=plan is not None and plan.isa is not None)

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    @property
    def expert_load(self):
        """A mixture-of-experts model's ``tokenmill.moe.ExpertLoad`` (tokens per expert), else None."""
        return getattr(self.loaded.model, "expert_load", None)

    def get_tokenizer(self):
        return self.tokenizer

    # ---- intake ---------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids). Raises ValueError on an empty or invalid prompt."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError(
                f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
            )
        token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.loaded.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return None, token_ids

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        kv_transfer_params: dict | None = None,
        priority: int = 0,
        session_id: str | None = None,
    ) -> None:
        """Validate, tokenize and queue a request (``params.n`` sequences), with ``lora_request``'s
        adapter applied (None: the base model). ``kv_transfer_params``: prefill/decode disaggregation
        (vLLM's field; needs ``kv_transfer_config``). ``priority``: under ``scheduling_policy="priority"``,
        lower values run first (ties by arrival); must be 0 otherwise. ``session_id``: the agent session (with
        ``session_kv_ttl`` its cached blocks are kept between turns).

        Raises:
            ValueError: empty prompt, prompt too long, or prompt + max_tokens over max_model_len;
                a ``lora_request`` without ``enable_lora`` or whose adapter is refused (the message
                names the adapter and the reason).
            tokenmill.structured_output.ConstraintError (a ValueError): an invalid constraint.
        """
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {type(priority).__name__}")
        if priority and self.scheduler_config.policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy='priority' (the engine runs fcfs)")
        params = (params or SamplingParams()).with_defaults(self.loaded.generation_config)
        self._check_token_ids(params)
        text, token_ids = self.tokenize_prompt(prompt)
        num_prompt = len(token_ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt has {num_prompt} tokens; max_model_len is {self.max_model_len}, "
                "so at most {} prompt tokens fit".format(self.max_model_len - 1)
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        if num_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {num_prompt + max_tokens} "
                f"exceeds max_model_len ({self.max_model_len})"
            )
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
            if self.lora_manager is None:
                raise ValueError(f"lora_request {lora_request.lora_name!r} needs an engine started with enable_lora=True")
            lora_digest = self.lora_manager.register(lora_request).digest  # read and checked before anything is queued
        else:
            lora_digest = None
        if kv_transfer_params is not None:
            if not isinstance(kv_transfer_params, dict):
                raise ValueError(f"kv_transfer_params must be an object, got {type(kv_transfer_params).__name__}")
            if self.kv_connector is None:
                raise ValueError("kv_transfer_params needs a server started with --kv-transfer-config")
            if params.n != 1:
                raise ValueError("kv_transfer_params needs n = 1")
        constraint = params.structured_outputs
        if constraint is not None:
            self.structured_output_manager.compile(constraint)  # raises before anything is queued
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}-{i}"
            # each draw keyed by seed and position (sampling/metadata.py)
            seed = None if params.seed is None else (params.seed + i) % 2**64
            grammar = None if constraint is None else self.structured_output_manager.new_matcher(constraint)
            children.append(
                Request(child_id, token_ids, params, self.loaded.eos_token_ids, max_tokens,
                        arrival_time=arrival_time, cache_salt=cache_salt, seed=seed, grammar=grammar,
                        lora_request=lora_request, lora_digest=lora_digest, kv_transfer_params=kv_transfer_params,
                        priority=priority, session_id=session_id)
            )
        self.output_processor.add_request(request_id, text, children)
        for child in children:
            self.scheduler.add_request(child)

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.loaded.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids or [])):
            bad = [t for t in ids if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(f"{name} has token ids outside [0, {vocab}): {bad[:5]}")

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests (by the ids given to add_request); their KV blocks are freed at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            children = self.output_processor.child_ids(request_id)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            self.output_processor.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or KV transfers to finish (loads in flight, leases to free when they end)."""
        return self.scheduler.has_unfinished_requests() or (
            self.kv_connector is not None and self.kv_connector.has_pending)

    # ---- adapters (vLLM's add_lora / remove_lora / list_loras) ---------------------------
    def _lora(self):
        if self.lora_manager is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True")
        return self.lora_manager

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read, check and register an adapter ahead of its requests (kept in the host cache).

        Returns False if its id is already registered. Raises ValueError without ``enable_lora``;
        ``LoRAAdapterError`` (a ValueError naming the adapter and the reason) if it is refused."""
        manager = self._lora()
        return manager.add(manager.check(lora_request))

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter no unfinished request uses; its id is retired.

        Returns False if the id is not registered. Raises ValueError while a request still uses it."""
        if self.lora_requests_in_flight(lora_int_id):
            raise ValueError(f"adapter {lora_int_id} still has requests in flight")
        return self._lora().remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """Ids of the registered adapters."""
        return {r.lora_int_id for r in self._lora().list_loras()}

    def lora_requests_in_flight(self, lora_int_id: int) -> int:
        """Unfinished sequences (running or waiting) that use adapter ``lora_int_id``."""
        return sum(r.lora_int_id == lora_int_id for queue in (self.scheduler.running, self.scheduler.waiting)
                   for r in queue)

    def lora_adapters_by_state(self) -> tuple[list[str], list[str]]:
        """Names of the adapters of running and of waiting sequences (each name once, sorted)."""
        def names(requests) -> list[str]:
            return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})

        return names(self.scheduler.running), names(self.scheduler.waiting)

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns a RequestOutput for every request with news."""
        pool = self.runner.kv_pool
        pool.step_started()  # the KV pool's pages fault in only while no step runs
        try:
            outputs = self._step()
        finally:
            pool.step_ended()
        if self.kv_events is not None:
            self.kv_events.publish_pending()  # the step's KV events, as one batch (never blocks)
        if envs.check_integrity() and not self.has_unfinished_requests():  # went idle: nothing may be held
            self.check_integrity(idle=True)
        return outputs

    def _step(self) -> list[RequestOutput]:
        step_start = time.perf_counter()
        if self.kv_connector is not None:  # K/V that arrived from producers into its blocks, before planning
            self.kv_connector.before_schedule()
        scheduler_output = self.scheduler.schedule()
        if self.kv_connector is not None:
            self.kv_connector.after_schedule(scheduler_output.kv_loads)
        if self.kv_store is not None:  # copies to / from the lower KV tiers, before the forward
            self.kv_store.transfer(scheduler_output.blocks_to_offload, scheduler_output.blocks_to_load)
        if scheduler_output.is_empty:
            if self.kv_store is not None:  # nothing runnable: wait for prefix blocks coming back from disk
                self.kv_store.wait_for_loads(timeout=0.5)
            if self.kv_connector is not None:  # ... or for K/V from a producer, or a lease to end
                self.kv_connector.wait(0.05)
            return []
        # Constrained requests' masks are filled on a worker thread while the forward runs.
        scheduler_output.grammar_bitmask = self.structured_output_manager.start_bitmask(
            scheduler_output.scheduled_requests, scheduler_output.num_scheduled_tokens,
            scheduler_output.scheduled_spec_decode_tokens,
        )
        try:
            if self._fault_steps:
                self._inject_fault()
            runner_output = self.runner.execute_model(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - contained: the step's requests fail, not the engine
            raise self._step_failed(scheduler_output, exc) from exc
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        num_sampled = sum(t is not None for t in runner_output.sampled_token_ids)
        num_drafts = sum(len(d) for d in scheduler_output.scheduled_spec_decode_tokens.values())
        num_generated = num_sampled + sum(len(t) for t in runner_output.extra_sampled_token_ids.values())
        self.stats_logger.record_step(scheduler_output.total_num_scheduled_tokens - num_sampled - num_drafts,
                                      num_generated)
        spec_stats = None
        if self.speculator is not None:
            # Only steps of decoding requests (one token each plus its drafts) price the cost model: the
            # steps it plans. A short prefill of the same size runs another path and is far slower (a
            # 5-token prefill timed 42 ms against 18 ms for a 5-row verify), and a size priced that high
            # would never be planned, so never timed again.
            decode_only = (scheduler_output.total_num_scheduled_tokens - num_drafts
                           == len(scheduler_output.scheduled_requests))
            self.speculator.record(scheduler_output.scheduled_spec_decode_tokens,
                                   [r.request_id for r in scheduler_output.scheduled_requests],
                                   {i: len(t) for i, t in runner_output.extra_sampled_token_ids.items()},
                                   scheduler_output.total_num_scheduled_tokens if decode_only else None,
                                   time.perf_counter() - step_start)
            spec_stats = self.speculator.stats
        self.stats_logger.maybe_log(self.scheduler, self.kv_cache_manager, self.kv_store, spec_stats)
        outputs, to_stop = self.output_processor.process(updated)
        if to_stop:
            self.scheduler.finish_requests(to_stop, RequestStatus.FINISHED_STOPPED)
        if self.speculator is not None:  # drafts for the next step
            self.speculator.propose(self.scheduler.running)
        return outputs

    def _inject_fault(self) -> None:
        self._num_forwards += 1
        if self._num_forwards in self._fault_steps:
            raise InjectedFault(f"fault injected in model forward {self._num_forwards} (TOKENMILL_FAULT_INJECT_STEP)")

    def _step_failed(self, scheduler_output, exc: Exception) -> StepFailedError:
        """Contain a forward that raised: wait for the step's grammar masks (their worker thread reads the
        matchers), drop the prefix-cache entries of the blocks the step was to write (``allocate_slots``
        indexed them before the forward), and name the step's requests for the caller to fail.

        Raises:
            AssertionError: the KV pool's invariants no longer hold (the engine cannot go on).
        """
        if self.kv_cache_manager.state_slots is not None:  # hybrid models: the state checkpoints were planned
            raise exc  # against this step too; dropping them is not supported, so the engine reports dead
        if scheduler_output.grammar_bitmask is not None:
            try:
                scheduler_output.grammar_bitmask.result()
            except Exception:  # noqa: BLE001 - the step failed already
                pass
        parents = self.output_processor.child_to_parent
        request_ids = []
        for request in scheduler_output.scheduled_requests:
            self.kv_cache_manager.discard_unwritten(request)
            request_ids.append(parents.get(request.request_id, request.request_id))
        self.check_integrity()
        logger.error("engine step failed (%d requests fail with it): %s: %s", len(scheduler_output.scheduled_requests),
                     type(exc).__name__, exc, exc_info=exc)
        return StepFailedError(list(dict.fromkeys(request_ids)), exc)

    def close(self, save_cached: bool = True) -> None:
        """Release the KV tiers: with a disk tier, write every cached block held only in the pool or
        in RAM to disk (``save_cached``; skip it after a crash, when block data may be stale),
        flush and sync the disk writer and release its directory lock. Idempotent. With KV events,
        a last batch says every block is gone, and the publisher's sockets are released. The objects
        frozen at start-up go back under the garbage collector, so a closed engine can be collected."""
        gc.unfreeze()
        self.structured_output_manager.close()
        if self.kv_connector is not None:
            for request_id in self.kv_connector.close():  # leases nobody will pull any more
                request = self.scheduler.leased.pop(request_id, None)
                if request is not None:
                    self.kv_cache_manager.free(request)
            self.kv_connector = self.scheduler.connector = None
        if self.kv_store is not None:
            offload = self.kv_cache_manager.offload
            self.kv_store.close(self.kv_cache_manager.cached_blocks() if save_cached and offload is not None else None)
        if self.kv_events is not None:
            self.kv_events.close()

    def check_integrity(self, idle: bool = False) -> None:
        """Assert the KV pool's invariants (free + cached + in use == total, nothing leaked); with ``idle`` (no
        request left, no transfer pending) also that every block and state slot is free again. Run after every
        step that leaves the engine idle when TOKENMILL_CHECK_INTEGRITY=1 (the test suite sets it).

        Raises:
            AssertionError: a broken invariant, naming it.
        """
        self.kv_cache_manager.check_integrity(idle=idle)
