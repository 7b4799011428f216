"""The contract between CPU planning and execution: SchedulerOutput in, ModelRunnerOutput back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.outputs import PositionLogprobs
from tokenmill.request import Request


@dataclass
class SchedulerOutput:
    """One step's plan.

    ``scheduled_requests[i]`` computes ``num_scheduled_tokens[i]`` tokens starting at its
    ``num_computed_tokens`` with KV blocks ``block_ids[i]``. The runner treats requests as read-only.
    With lower KV tiers, before the forward (even when nothing is scheduled) the blocks in
    ``blocks_to_offload`` are copied out to them, then those in ``blocks_to_load`` are filled from
    them; both are (block_id, block_hash) lists. ``grammar_bitmask`` (a
    ``tokenmill.structured_output.GrammarBitmask``, set by the engine after scheduling) holds the
    next-token masks of the constrained requests that sample this step, filled while the forward runs.
    ``scheduled_spec_decode_tokens`` (vLLM's name) maps a request verifying draft tokens this step to
    them: they are the last ``len(drafts)`` of its ``num_scheduled_tokens``, after its last sampled
    token, and are not part of ``all_token_ids`` (nothing unverified is ever hashed or cached).
    ``kv_loads``: the prompt K/V pulls from producers (prefill/decode disaggregation) this plan parked
    requests for; the engine hands them to the KV connector's worker half.
    """

    scheduled_requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    blocks_to_offload: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_load: list[tuple[int, int]] = field(default_factory=list)
    grammar_bitmask: Any = None
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    kv_loads: list = field(default_factory=list)  # KV transfer pulls to start (kv_transfer.scheduler_side.KVLoad)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_requests


@dataclass
class ModelRunnerOutput:
    """What one step produced, aligned with ``SchedulerOutput.scheduled_requests``.

    sampled_token_ids[i] is None for a request whose prefill chunk did not reach the end of its
    sequence (nothing to sample). prompt_logprobs maps request_id -> entries for the prompt
    positions this step covered (position p's entry scores token p; position 0 has none).
    For a request i that verified draft tokens, ``extra_sampled_token_ids[i]`` holds the tokens that
    follow ``sampled_token_ids[i]`` in this step (one per accepted draft: the accepted drafts after the
    first, then the correction or bonus token), with their entries in ``extra_logprobs[i]`` (each None
    unless log-probabilities were asked for). The number of accepted drafts is their length.
    """

    sampled_token_ids: list[int | None]
    logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)
    extra_sampled_token_ids: dict[int, list[int]] = field(default_factory=dict)
    extra_logprobs: dict[int, list[PositionLogprobs | None]] = field(default_factory=dict)
