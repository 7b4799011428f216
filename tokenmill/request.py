"""Request: the engine's per-sequence state (tokens, progress, status). Pure Python, no torch tensors."""
from __future__ import annotations

import enum
import time

from tokenmill.lora_request import LoRARequest
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Lifecycle of a request inside the scheduler."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks allocated, K/V arriving from a producer
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH_CAPPED = "finished_length_capped"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # the request failed alone (a constraint matcher error)

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED,
             RequestStatus.FINISHED_ERROR}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated.

    ``all_token_ids`` = prompt + output. ``num_computed_tokens`` counts tokens whose K/V is in the
    cache; the scheduler schedules ``num_tokens - num_computed_tokens`` more (a prefill chunk, or
    the last sampled token during decode). ``max_tokens`` is already resolved (never None).
    ``seed`` (``params.seed`` + the sequence's index among ``n``; None = the global RNG) and the position
    key the noise of every draw (``sampling.metadata.position_seed``).
    ``grammar`` is the structured-output matcher (``tokenmill.structured_output.Matcher``) of a
    constrained request, advanced on each accepted token; None when unconstrained.
    ``lora_request`` is the adapter the request runs with (None: the base model); ``lora_digest`` the
    hash of its content (``LoRAAdapter.digest``), which its prefix-cache block hashes carry.
    ``session_id``: the agent session the request belongs to (the server's ``X-Session-Id`` header or ``user``
    field): with ``session_kv_ttl`` its cached blocks outlive plain LRU between turns (kv_cache_manager.py).
    ``priority``: under the priority scheduling policy, lower values run first (ties by ``arrival_time``).
    ``kv_transfer_params``: vLLM's field for prefill/decode disaggregation (``do_remote_decode`` on
    the prefill side, ``do_remote_prefill`` and where to pull from on the decode side).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int],
        max_tokens: int,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        seed: int | None = None,
        grammar: object | None = None,
        lora_request: LoRARequest | None = None,
        lora_digest: str | None = None,
        kv_transfer_params: dict | None = None,
        priority: int = 0,
        session_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.session_id = session_id  # an agent session (X-Session-Id / user): its blocks are kept between turns
        self.priority = priority  # the priority scheduling policy runs lower values first (vLLM's field)
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        # EOS ids and params.stop_token_ids, built once: the sampler masks them while min_tokens holds.
        self.stop_token_ids = frozenset(eos_token_ids) | sampling_params.stop_token_id_set
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.seed = seed
        self.grammar = grammar
        self.lora_request = lora_request
        self.lora_digest = lora_digest
        self.error: str | None = None  # why a FINISHED_ERROR request failed
        # Prefill/decode disaggregation (tokenmill/kv_transfer/connector.py): the request's parameters,
        # what its answer tells the decode side (a producer's lease), and whether a remote load was tried.
        self.kv_transfer_params = kv_transfer_params
        self.kv_transfer_params_out: dict | None = None
        self.remote_kv_tried = False

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache, set at first schedule
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        # Filled by the model runner's outputs, consumed by the output processor.
        self.logprobs: list[dict] = []
        self.prompt_logprobs: list = []
        self.cumulative_logprob = 0.0
        # Draft tokens proposed for the next step (speculative decoding); never part of all_token_ids.
        self.spec_token_ids: list[int] = []
        # Chained prefix-cache hashes of this request's full blocks (maintained by the KV cache manager).
        self.block_hashes: list[int] = []
        # Timestamps (time.monotonic()) for metrics.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def lora_int_id(self) -> int | None:
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
