"""The phase-free scheduler (as in vLLM v1): every request's num_computed_tokens catches up with
its num_tokens under one token budget, so chunked prefill, decode, prefix hits and resumed
preemption are a single loop. Pure CPU bookkeeping; never imports torch.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tokenmill.config import SchedulerConfig
from tokenmill.kv_cache.kv_cache_manager import KVCacheManager
from tokenmill.lora.step_adapters import StepAdapters
from tokenmill.request import Request, RequestStatus
from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput
from tokenmill.scheduler.request_queue import make_queue

if TYPE_CHECKING:  # torch-free either way: the scheduler half of KV transfer moves no bytes
    from tokenmill.kv_transfer.scheduler_side import KVConnectorScheduler


class Scheduler:
    """Continuous batching with chunked prefill and recompute preemption, first come first served or by priority.

    ``config.policy`` "fcfs": requests run in arrival order; when the pool runs out, the newest running request is
    preempted. "priority" (vLLM's ``--scheduling-policy priority``): the waiting queue is ordered by
    ``Request.priority`` (lower first, ties by arrival); running requests get the step's token budget in that
    order; the victim of a full pool is the running request of the lowest priority (latest arrival among
    equals); and a waiting request that does not fit (no KV room, or ``max_num_seqs`` running) preempts running
    requests of strictly lower priority until it does. A preempted request's full blocks stay in the prefix
    cache, and with a RAM / disk tier they move there when evicted, so it resumes from them, not from scratch.

    Args:
        config: limits (max_num_seqs, max_num_batched_tokens, max_model_len, max_loras adapters per step) and
            the scheduling policy.
        kv_cache_manager: the only door into the KV cache.
        connector: the scheduler half of KV transfer (prefill/decode disaggregation), or None: requests
            whose prompt K/V is arriving from a producer, and finished requests whose blocks a consumer has
            yet to pull. Loads it plans leave in ``SchedulerOutput.kv_loads``; nothing here copies bytes.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 connector: KVConnectorScheduler | None = None) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.priority = config.policy == "priority"
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.connector = connector
        self.waiting_for_remote: dict[str, Request] = {}
        self.leased: dict[str, Request] = {}

    # ---- request lifecycle -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.waiting.add(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) requests wherever they are; frees their blocks."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.waiting_for_remote[request_id]
                self.connector.cancel_load(request_id)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        kv = self.kv_cache_manager
        if self.connector is not None and self.connector.request_finished(
                request, kv.get_block_ids(request.request_id), kv.extra_keys(request.cache_salt, request.lora_digest,
                                                                            request.lora_request)):
            self.leased[request.request_id] = request  # freed when its consumer confirms or the lease expires
        else:
            kv.free(request)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_remote)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- planning ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step under the token budget: running requests first, then waiting ones admitted. Under the
        priority policy the two are merged by (priority, arrival): a waiting request ahead of running ones is
        admitted before them, preempting running requests of strictly lower priority when it does not fit."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager
        if self.connector is not None:
            self._update_from_connector()
        if self.priority:
            self.running.sort(key=_priority_key)
        # Every running request's adapter is counted (they always fit: each was admitted under the limit).
        adapters = StepAdapters(self.config.max_loras, self.running)
        skipped: list[Request] = []  # prefix blocks on their way back from disk, or no adapter slot: others go first
        memory_short = False  # a running request did not fit: admit nobody this step
        waiting_blocked = False  # priority: the waiting head ahead of running requests could not be admitted
        i = 0  # self.running[:i] are planned; the rest (sorted under the priority policy) are not yet
        while budget > 0:
            final = i >= len(self.running)  # every running request is planned: only waiting ones are left
            if not final and (memory_short or waiting_blocked or not self._waiting_ahead_of(self.running[i])):
                request = self.running[i]
                num_preempted = len(out.preempted_req_ids)
                num_new = self._plan_running(out, request, budget)
                memory_short = memory_short or len(out.preempted_req_ids) > num_preempted
                if num_new is None:  # the request itself was preempted, and every one after it
                    break
                budget -= num_new
                i += 1
                continue
            if memory_short or not self.waiting:
                break
            request = self.waiting.peek()
            if len(self.running) >= self.config.max_num_seqs:
                if self._preempt_lower(out, request, i):
                    continue
                if final:
                    break
                waiting_blocked = True
                continue
            if not adapters.fits(request):
                skipped.append(self.waiting.pop())
                continue
            if request.num_computed_tokens:  # its prompt K/V came from a producer: blocks held, no lookup
                hits, num_hit_tokens = [], request.num_computed_tokens
            else:
                hits, num_hit_tokens = kv.get_computed_blocks(request)
            if kv.is_loading(request):
                skipped.append(self.waiting.pop())
                continue
            if self.connector is not None and self._start_remote_prefill(out, request, hits, num_hit_tokens):
                continue
            num_new = request.num_tokens - num_hit_tokens
            if self.config.enable_chunked_prefill or num_new <= budget:
                num_new = min(num_new, budget)
                while kv.allocate_slots(request, num_new, hits) is None:
                    if not self._preempt_lower(out, request, i):
                        break
                else:
                    self._admit(out, request, num_hit_tokens, num_new, i)
                    adapters.add(request)
                    budget -= num_new
                    i += 1
                    continue
            if final:
                break
            waiting_blocked = True
        self.waiting.put_back(skipped)
        out.blocks_to_offload, out.blocks_to_load = kv.take_kv_transfers()
        return out

    def _waiting_ahead_of(self, request: Request) -> bool:
        """Priority policy: whether the waiting head comes before running ``request`` (False under FCFS)."""
        return self.priority and bool(self.waiting) and _priority_key(self.waiting.peek()) < _priority_key(request)

    def _plan_running(self, out: SchedulerOutput, request: Request, budget: int) -> int | None:
        """Schedule running ``request``'s next tokens (and drafts, room permitting), preempting the last running
        requests (the newest; under the priority policy the lowest-priority ones) while the pool is short.
        Returns the tokens scheduled, or None if ``request`` itself had to be preempted."""
        kv = self.kv_cache_manager
        num_base = min(request.num_tokens - request.num_computed_tokens, budget)
        assert num_base > 0, f"{request} has nothing to compute"
        num_new = min(num_base + len(request.spec_token_ids), budget)  # drafts: extra tokens to verify
        while kv.allocate_slots(request, num_new) is None:
            if num_new > num_base:  # no room for the drafts: verify none rather than preempt anyone
                num_new = num_base
                continue
            victim = self.running.pop()  # never a planned one: they come before ``request``
            self._preempt(victim)
            out.preempted_req_ids.add(victim.request_id)
            if victim is request:
                return None
        self._add_scheduled(out, request, num_new)
        return num_new

    def _preempt_lower(self, out: SchedulerOutput, request: Request, planned: int) -> bool:
        """Priority policy: preempt the last running request (the lowest priority, the latest arrival among
        equals) if it is not planned yet (index >= ``planned``) and its priority is strictly lower than waiting
        ``request``'s, to make room for it. Returns whether one was preempted (always False under FCFS)."""
        if not self.priority or len(self.running) <= planned or self.running[-1].priority <= request.priority:
            return False
        victim = self.running.pop()
        self._preempt(victim)
        out.preempted_req_ids.add(victim.request_id)
        return True

    def _admit(self, out: SchedulerOutput, request: Request, num_hit_tokens: int, num_new: int, at: int) -> None:
        """The waiting head, its slots allocated: running from this step, at index ``at`` of ``running`` (the
        end under FCFS; its place in priority order otherwise)."""
        self.waiting.pop()
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.running.insert(at, request)
        self._add_scheduled(out, request, num_new)

    def _start_remote_prefill(self, out: SchedulerOutput, request: Request, hits: list, num_hit_tokens: int) -> bool:
        """Park the head waiting request while its prompt K/V loads from a producer, if it should: its blocks
        are allocated now (not indexed until the K/V is in) and the load goes out in ``out.kv_loads``.
        False: schedule it as usual."""
        num_remote = self.connector.num_remote_tokens(request, num_hit_tokens)
        kv = self.kv_cache_manager
        if num_remote <= 0 or kv.allocate_slots(request, num_remote, hits, delay_cache_blocks=True) is None:
            return False
        self.waiting.pop()
        request.num_computed_tokens = num_hit_tokens
        request.num_cached_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote[request.request_id] = request
        out.kv_loads.append(self.connector.start_load(
            request, num_hit_tokens, num_remote, kv.get_block_ids(request.request_id),
            kv.extra_keys(request.cache_salt, request.lora_digest, request.lora_request)))
        return True

    def _update_from_connector(self) -> None:
        """Loads that ended go back to the head of the queue (K/V in, copied by the worker half before this
        schedule: only the last prompt token left to compute; failed: blocks freed, the prompt computed
        here); ended leases free their blocks."""
        kv = self.kv_cache_manager
        for request_id, ok in self.connector.poll_loads():
            request = self.waiting_for_remote.pop(request_id, None)
            if request is None:
                continue
            if ok:
                num_remote = request.num_prompt_tokens - 1 - request.num_computed_tokens
                self.connector.count_remote_tokens(num_remote)
                request.num_computed_tokens = request.num_prompt_tokens - 1
                kv.cache_blocks(request, request.num_computed_tokens)
            else:
                kv.free(request)
                request.num_computed_tokens = 0
                request.num_cached_tokens = None
            request.status = RequestStatus.WAITING
            self.waiting.put_back([request])
        for request_id in self.connector.released():
            request = self.leased.pop(request_id, None)
            if request is not None:
                kv.free(request)

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        num_drafts = num_new - (request.num_tokens - request.num_computed_tokens)
        if num_drafts > 0:
            out.scheduled_spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_drafts]
        out.scheduled_requests.append(request)
        out.num_scheduled_tokens.append(num_new)
        out.block_ids.append(self.kv_cache_manager.get_block_ids(request.request_id))

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.put_back([request])

    # ---- results ----------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance each scheduled request, append sampled tokens, apply stop rules.

        Returns the requests that received a new token or finished this step.
        """
        updated = []
        for i, request in enumerate(scheduler_output.scheduled_requests):
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += scheduler_output.num_scheduled_tokens[i]
            entry = runner_output.prompt_logprobs.get(request.request_id)
            if entry is not None:
                start, items = entry
                if len(request.prompt_logprobs) == start:  # skip positions already scored (preemption)
                    request.prompt_logprobs.extend(items)
            token_id = runner_output.sampled_token_ids[i]
            if token_id is None:
                continue
            if request.max_tokens == 0:  # prompt-only request (e.g. echo with max_tokens 0)
                self.running.remove(request)
                self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)
                updated.append(request)
                continue
            extra = runner_output.extra_sampled_token_ids.get(i, [])
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(request.request_id)
            if drafts:  # rejected drafts' positions are computed again (their KV overwritten) next step
                request.num_computed_tokens -= len(drafts) - len(extra)
            logprobs = [runner_output.logprobs[i] if runner_output.logprobs is not None else None]
            logprobs += runner_output.extra_logprobs.get(i, [None] * len(extra))
            for token_id, entry in zip([token_id] + extra, logprobs):
                request.append_output_token(token_id)
                if entry is not None:
                    request.logprobs.append(entry)
                    request.cumulative_logprob += entry[token_id].logprob
                status = self._check_stop(request, token_id)
                if status is not None:
                    self.running.remove(request)
                    self._finish(request, status)
                    break
            updated.append(request)
        return updated

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.grammar is not None:  # a constrained request: its matcher advances on every token
            if not request.grammar.accept_token(token_id):
                request.stop_reason = f"the structured-output matcher refused token {token_id}"
                return RequestStatus.FINISHED_ERROR
            if request.grammar.is_terminated():
                return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_id_set:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None


def _priority_key(request: Request) -> tuple[int, float]:
    """Scheduling order under the priority policy: lower ``priority`` first, then earlier arrival."""
    return request.priority, request.arrival_time
