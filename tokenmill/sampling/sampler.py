"""Sampler: turns one step's logits [B, V] into sampled token ids and optional log-probabilities.

Order (as in vLLM): logit bias -> min_tokens masking -> penalties -> log-probabilities ->
temperature -> top-k -> top-p -> min-p -> sample. Greedy rows take the argmax; random rows use
the exponential race (argmax of probs / Exp(1) noise), so nothing waits on the host (but top-p's
check for a nucleus larger than its candidates, top_k_top_p.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenmill.sampling import race_kernel
from tokenmill.sampling.argmax_kernel import argmax_rows
from tokenmill.sampling.metadata import SamplingMetadata, position_seed
from tokenmill.sampling.penalties import apply_logit_bias, apply_min_tokens, apply_penalties
from tokenmill.sampling.top_k_top_p import apply_min_p, apply_top_k_top_p


@dataclass
class SamplerOutput:
    """What the Sampler returns for B rows.

    Attributes:
        sampled_token_ids: [B] int64.
        logprobs: [B] f32, log-probability of the sampled token; None if no row asked.
        sampled_ranks: [B] int64, rank of the sampled token (1 = most likely; tokens with an
            equal log-probability share the best rank). None if no row asked.
        top_logprob_ids: [B, k] int64 with k = ``max_num_logprobs`` (may be 0), most likely first.
        top_logprobs: [B, k] f32, matching ``top_logprob_ids``.
    """

    sampled_token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None
    top_logprob_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class Sampler:
    """Samples one token per row; stateless apart from the vocabulary size.

    Log-probabilities are ``log_softmax`` of the logits after bias, min_tokens masking and
    penalties but before temperature and top-k/top-p/min-p: they describe the model's
    (penalised) distribution, independent of how a token was then drawn from it.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample from ``logits`` [B, V] f32 (modified in place) described by ``metadata``."""
        assert logits.dim() == 2 and logits.shape == (metadata.batch_size, self.vocab_size), logits.shape
        logits = logits.float()  # a no-op for f32 logits
        apply_logit_bias(logits, metadata)
        apply_min_tokens(logits, metadata)
        apply_penalties(logits, metadata)

        all_logprobs = None
        if metadata.max_num_logprobs is not None:
            all_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V], a fresh tensor

        greedy_ids = None if metadata.all_random else argmax_rows(logits)  # [B]; torch.argmax's answer
        if metadata.all_greedy:
            assert greedy_ids is not None
            sampled = greedy_ids
        else:
            random_ids = self._sample_random(logits, metadata)  # [B]
            sampled = random_ids if greedy_ids is None else torch.where(metadata.is_greedy, greedy_ids, random_ids)

        if all_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        assert metadata.max_num_logprobs is not None
        return gather_logprobs(all_logprobs, sampled, metadata.max_num_logprobs)

    @staticmethod
    def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, filters, then the exponential race. Returns [B] int64 (greedy rows: junk)."""
        temperature = metadata.temperature.masked_fill(metadata.is_greedy, 1.0)  # [B], no div by 0
        logits.div_(temperature.unsqueeze(1))
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, metadata.max_top_k)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        probs = logits.softmax(dim=-1)  # [B, V]
        return exponential_race(probs, metadata.generators, metadata.seeds)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator],
                     seeds: dict[int, int] | None = None) -> torch.Tensor:
    """Sample one token per row: ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d.

    Equivalent to ``multinomial(probs, 1)`` but with no host sync. A seeded row's noise comes from
    its seed alone, so its draws do not depend on the rest of the batch; other rows' noise comes from
    the global RNG (``torch.manual_seed`` repeats it). On a CPU with the C kernel (and ``seeds``
    holding every row of ``generators``), the noise is a counter-based hash of the row's seed and the
    token index, and the race runs in C (``race_kernel``: [64, 49152] in under 1 ms); unseeded rows then
    get ``position_seed(base, row)`` with one ``base`` drawn from the global RNG per call. Elsewhere
    (CUDA, no compiler) rows listed in ``generators`` draw their V noise values from their own
    generator (one loop over seeded rows, never over tokens) and the race runs in torch, as below.
    The two paths draw from the same distribution, with different noise. The winner's margin over
    the runner-up is of the order of the ratios themselves, so
    logits that differ in their last bits (a request resumed by prefilling prompt + output, a verify
    step of speculative decoding) almost never change a seeded draw. An inverse-CDF draw (one uniform
    per row) moves with every change in the cumulative sums below it: tried, it changed a resumed
    stream in tests/test_router_failover.py and 20 of 300 draws in tests/test_sampling.py's
    ``test_a_seeded_draw_survives_small_changes_in_the_logits``, where the race changes none.

    The torch path's noise is ``-log1p(-(u + 2^-54))`` of float64 uniforms ``u`` in [0, 1) (multiples of 2^-53:
    ``u + 2^-54`` is never 0), the logarithm taken in the dtype of ``probs`` and capped at 54 ln 2.
    torch draws uniforms one at a time on a CPU as it does exponentials, but without the logarithm,
    which then runs vectorised and threaded: [64, 49152] took 60 ms with ``exponential_`` and takes
    ~20 ms. Float32 uniforms were faster (11 ms) but are multiples of 2^-24: u = 0 came up once in
    2^24 draws, and its noise of 0 made that token win whatever its probability (a wrong token in
    ~0.3% of rows of 49152 tokens); they also tie often near 0, which favours low token ids.

    Args:
        probs: [B, V] f32, rows summing to 1 (filtered tokens exactly 0); overwritten by the torch path.
        generators: row index -> generator on ``probs.device``.
        seeds: row index -> the 64-bit seed its generator holds (``SamplingMetadata.seeds``); None
            keeps the torch path.
    Returns:
        [B] int64 sampled token ids.
    """
    if seeds is not None and race_kernel.takes(probs) and all(row in seeds for row in generators):
        base = int(torch.randint(0, 2**62, ())) if len(seeds) < probs.shape[0] else 0  # the global RNG
        values = [seeds[row] if row in seeds else position_seed(base, row) for row in range(probs.shape[0])]
        return race_kernel.race_rows(probs, torch.tensor([v - 2**64 if v >= 2**63 else v for v in values]))
    u = torch.empty(probs.shape, dtype=torch.float64, device=probs.device)  # [B, V]
    if len(generators) < probs.shape[0]:
        u.uniform_()
    for row, generator in generators.items():
        u[row].uniform_(generator=generator)
    # Exp(1) = -log(1 - u), u moved off 0: > 0 (so 0 / noise is 0 for a filtered token, never nan),
    # and finite (capped where u rounds to 1). The float32 copy of u keeps its relative precision
    # near 0, where small noise decides the race; near 1 it rounds to a 2^-24 grid, which coarsens
    # only large noise (a token with noise above ~10, probability e^-10, almost never wins).
    noise = u.add_(2.0**-54).to(probs.dtype).neg_().log1p_().neg_().clamp_(max=54 * math.log(2))
    return argmax_rows(probs.div_(noise))


def gather_logprobs(all_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int) -> SamplerOutput:
    """Package the sampled tokens with their log-probabilities, ranks and the top alternatives.

    Args:
        all_logprobs: [B, V] f32 log-probabilities.
        sampled: [B] int64 sampled token ids.
        num_logprobs: k, the number of top alternatives to return (may be 0).
    Returns:
        SamplerOutput with every field set; ``top_*`` are [B, k], most likely first.
    """
    sampled_logprobs = all_logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
    ranks = (all_logprobs > sampled_logprobs).sum(dim=-1) + 1  # [B]
    if num_logprobs > 0:
        top_logprobs, top_ids = all_logprobs.topk(num_logprobs, dim=-1)  # [B, k], sorted
    else:
        batch_size = all_logprobs.shape[0]
        top_logprobs = all_logprobs.new_empty((batch_size, 0))
        top_ids = torch.empty((batch_size, 0), dtype=torch.int64, device=all_logprobs.device)
    return SamplerOutput(
        sampled_token_ids=sampled,
        logprobs=sampled_logprobs.squeeze(1),
        sampled_ranks=ranks,
        top_logprob_ids=top_ids,
        top_logprobs=top_logprobs,
    )
