"""Speculators: the engine's one door to speculative decoding.

After every step a speculator sets each running request's ``spec_token_ids`` (the drafts the
scheduler adds to its next step), and records what the step verified and how long it took.
``Speculator`` owns what every proposer shares (which requests take part, how many drafts each may
have, adaptive verification, the constraint check, the counters); ``NgramSpeculator`` proposes by
prompt lookup. CPU bookkeeping and numpy; never imports torch (the draft-model proposer,
``draft_model.py``, does).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tokenmill.spec_decode.adaptive import AcceptanceEstimate, StepCostModel, plan_num_drafts
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.metrics import SpecDecodingStats
from tokenmill.spec_decode.ngram_proposer import propose_ngram

if TYPE_CHECKING:
    from tokenmill.request import Request


class Speculator:
    """Chooses the requests that speculate and keeps the counters; subclasses propose the drafts.

    Args:
        config: the speculative config.
        max_model_len: drafts never take a request past it.
        valid_draft_prefix: ``(matcher, drafts) -> n``, how many leading drafts a constrained
            request's matcher allows (``StructuredOutputManager.valid_draft_prefix``); drafts past
            them are dropped, so every draft position has a mask.

    With ``config.enable_adaptive_verification``, ``cost_model`` (step time by scheduled tokens) and
    ``estimates`` (request id -> ``AcceptanceEstimate``) decide how many drafts each request verifies
    (``spec_decode.adaptive.plan_num_drafts``); ``num_paused_total`` counts pauses of requests whose
    drafts stopped paying.
    """

    # True when proposing costs next to nothing (n-gram lookup): propose first, then plan with the drafts
    # found; False (a draft model): plan first, and propose only as many as planned.
    proposals_are_free = True

    def __init__(self, config: SpeculativeConfig, max_model_len: int, valid_draft_prefix=None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.valid_draft_prefix = valid_draft_prefix
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        self.cost_model = StepCostModel(max_tokens=256)
        self.estimates: dict[str, AcceptanceEstimate] = {}
        self.num_paused_total = 0

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` of every running request: drafts for those about to decode that
        take part (none above ``disable_by_batch_size`` running requests, none for a request that
        opted out or is paused), at most ``num_speculative_tokens`` and never past ``max_tokens`` or
        ``max_model_len``; with adaptive verification, as many as ``plan_num_drafts`` gives each.
        """
        cfg = self.config
        off = cfg.disable_by_batch_size is not None and len(running) > cfg.disable_by_batch_size
        adaptive = cfg.enable_adaptive_verification
        chosen, limits = [], []
        for request in running:
            request.spec_token_ids = []
            if off or request.sampling_params.disable_speculative_decoding:
                continue
            if request.num_computed_tokens != request.num_tokens - 1:  # still in prefill
                continue
            # The step yields accepted drafts + 1 tokens: leave room for that last one.
            k = min(cfg.num_speculative_tokens, request.max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens - 1)
            if k > 0 and adaptive and self._estimate(request).is_paused(request.num_output_tokens):
                k = 0
            if k > 0:
                chosen.append(request)
                limits.append(k)
        self.forget_others(running)
        if not chosen:
            return
        if adaptive and not self.proposals_are_free:
            limits = self._plan(chosen, limits, len(running))
            chosen, limits = [r for r, n in zip(chosen, limits) if n], [n for n in limits if n]
        proposals = self.propose_drafts(chosen, limits) if chosen else []
        if adaptive and self.proposals_are_free:
            planned = self._plan(chosen, [len(d) for d in proposals], len(running))
            proposals = [d[:n] for d, n in zip(proposals, planned)]
        for request, drafts in zip(chosen, proposals):
            if request.grammar is not None and drafts and self.valid_draft_prefix is not None:
                drafts = drafts[: self.valid_draft_prefix(request.grammar, drafts)]
            request.spec_token_ids = drafts

    def _estimate(self, request: Request) -> AcceptanceEstimate:
        estimate = self.estimates.get(request.request_id)
        if estimate is None:
            estimate = self.estimates[request.request_id] = AcceptanceEstimate(self.config.num_speculative_tokens)
        return estimate

    def _plan(self, requests: list[Request], caps: list[int], base_tokens: int) -> list[int]:
        """Drafts per request under the cost model; a request that could draft but gets none is paused.
        No drafts until a step of at most ``base_tokens`` tokens has been timed (it is then timed first),
        nor when the cost model asks to time a ``base_tokens`` step again (``needs_probe``: nobody is
        paused for that)."""
        if not self.cost_model.has_measured_up_to(base_tokens) or self.cost_model.needs_probe(base_tokens):
            return [0] * len(requests)
        estimates = [self._estimate(r) for r in requests]
        planned = plan_num_drafts([e.survival() for e in estimates], caps, base_tokens, self.cost_model)
        for request, estimate, cap, n in zip(requests, estimates, caps, planned):
            if cap and not n:
                estimate.pause_now(request.num_output_tokens)
                self.num_paused_total += 1
        return planned

    def propose_drafts(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        """Drafts for ``requests`` (at most ``limits[i]`` tokens for request i)."""
        raise NotImplementedError

    def forget_others(self, running: list[Request]) -> None:
        """Drop per-request state of requests no longer running (subclasses extend this)."""
        if self.estimates:
            alive = {r.request_id for r in running}
            for request_id in [r for r in self.estimates if r not in alive]:
                del self.estimates[request_id]

    def record(self, scheduled_spec_decode_tokens: dict[str, list[int]], request_ids: list[str],
               num_accepted: dict[int, int], num_scheduled_tokens: int | None = None,
               step_seconds: float | None = None) -> None:
        """Count one step: ``request_ids[i]`` verified ``scheduled_spec_decode_tokens[id]`` and
        accepted ``num_accepted[i]`` of them (absent: none). ``num_scheduled_tokens`` and
        ``step_seconds`` (the step's tokens and duration) feed the cost model."""
        for i, request_id in enumerate(request_ids):
            drafts = scheduled_spec_decode_tokens.get(request_id)
            if drafts:
                accepted = num_accepted.get(i, 0)
                self.stats.observe(len(drafts), accepted)
                estimate = self.estimates.get(request_id)
                if estimate is not None:
                    estimate.observe(len(drafts), accepted)
        if num_scheduled_tokens is not None and step_seconds is not None:
            self.cost_model.observe(num_scheduled_tokens, step_seconds)


class NgramSpeculator(Speculator):
    """Drafts by prompt lookup in each request's own prompt and output (``ngram_proposer``)."""

    def propose_drafts(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        cfg = self.config
        return [propose_ngram(np.asarray(r.all_token_ids, dtype=np.int64), cfg.lookup_min, cfg.lookup_max, k).tolist()
                for r, k in zip(requests, limits)]
