"""SpecDecodingStats: the speculative-decoding counters (vLLM's names), cumulative since start.

Pure Python. The engine records every verified step here; the server exports the counters as
``tokenmill:spec_decode_*`` and the stats log prints the acceptance rate.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Counters over every request that verified drafts.

    Attributes:
        num_drafts: (request, step) pairs that verified at least one draft token.
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: draft tokens accepted (each also saves a step).
        num_accepted_tokens_per_pos: [k] accepted drafts by position in the draft (0 = first); never
            increasing along the positions, since a draft token is accepted only after the ones before it.
    """

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Record one request's verify: ``num_accepted_tokens`` of its ``num_draft_tokens`` drafts."""
        assert 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_speculative_tokens
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / draft tokens (0.0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens gained per verifying step of a request: 1 + accepted drafts per draft (1.0 before any)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def snapshot(self) -> dict:
        """The counters as a plain dict (for the server's EngineStats)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }
