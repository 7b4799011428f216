"""Speculators: the engine's one door to speculative decoding.

After every step a speculator sets each running request's ``spec_token_ids`` (the drafts the
scheduler adds to its next step), and records what the step verified. ``Speculator`` owns what
every proposer shares (which requests take part, how many drafts each may have, the constraint
check, the counters); ``NgramSpeculator`` proposes by prompt lookup. CPU bookkeeping and numpy;
never imports torch (the draft-model proposer, ``draft_model.py``, does).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

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
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int, valid_draft_prefix=None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.valid_draft_prefix = valid_draft_prefix
        self.stats = SpecDecodingStats(config.num_speculative_tokens)

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` of every running request: drafts for those about to decode that
        take part (none above ``disable_by_batch_size`` running requests, none for a request that
        opted out), at most ``num_speculative_tokens`` and never past ``max_tokens`` or ``max_model_len``.
        """
        cfg = self.config
        off = cfg.disable_by_batch_size is not None and len(running) > cfg.disable_by_batch_size
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
            if k > 0:
                chosen.append(request)
                limits.append(k)
        self.forget_others(running)
        for request, drafts in zip(chosen, self.propose_drafts(chosen, limits)):
            if request.grammar is not None and drafts and self.valid_draft_prefix is not None:
                drafts = drafts[: self.valid_draft_prefix(request.grammar, drafts)]
            request.spec_token_ids = drafts

    def propose_drafts(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        """Drafts for ``requests`` (at most ``limits[i]`` tokens for request i)."""
        raise NotImplementedError

    def forget_others(self, running: list[Request]) -> None:
        """Drop per-request state of requests no longer running (a stateless proposer keeps none)."""

    def record(self, scheduled_spec_decode_tokens: dict[str, list[int]], request_ids: list[str],
               num_accepted: dict[int, int]) -> None:
        """Count one step: ``request_ids[i]`` verified ``scheduled_spec_decode_tokens[id]`` and
        accepted ``num_accepted[i]`` of them (absent: none)."""
        for i, request_id in enumerate(request_ids):
            drafts = scheduled_spec_decode_tokens.get(request_id)
            if drafts:
                self.stats.observe(len(drafts), num_accepted.get(i, 0))


class NgramSpeculator(Speculator):
    """Drafts by prompt lookup in each request's own prompt and output (``ngram_proposer``)."""

    def propose_drafts(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        cfg = self.config
        return [propose_ngram(np.asarray(r.all_token_ids, dtype=np.int64), cfg.lookup_min, cfg.lookup_max, k).tolist()
                for r, k in zip(requests, limits)]
