"""Sampler: turns one step's logits [B, V] into sampled token ids and optional log-probabilities.

Order (as in vLLM): logit bias -> min_tokens masking -> penalties -> log-probabilities ->
temperature -> top-k -> top-p -> min-p -> sample. Greedy rows take the argmax; random rows use
the exponential race (argmax of probs / Exp(1) noise), so nothing waits on the host (but top-p's
check for a nucleus larger than its candidates, top_k_top_p.py).
"""
from __future__ import annotations

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
        return exponential_race(probs, metadata.seeds)


def exponential_race(probs: torch.Tensor, seeds: dict[int, int]) -> torch.Tensor:
    """Sample one token per row: ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d.

    Equivalent to ``multinomial(probs, 1)`` but with no host sync. The noise is a counter-based hash of
    the row's 64-bit seed and the token index (``race_kernel``): a seeded row uses ``seeds[row]``
    (``position_seed`` of its seed and position), so its draws depend on the seed, the position and the
    probabilities only, never on the rest of the batch; other rows use ``position_seed(base, row)`` with
    one ``base`` drawn from the global RNG per call (``torch.manual_seed`` repeats them). On a CPU with
    the C kernel the race runs in C, taking a logarithm only for tokens that can still win ([64, 49152]:
    ~1 ms on 2 threads, against ~20 ms for torch's float64 uniforms); elsewhere (CUDA, no compiler)
    ``race_noise_torch`` computes the same noise with tensor ops. So CPU workers with and without the
    kernel, and GPU workers, draw the same tokens for a seeded request (a stream the router resumes
    elsewhere continues as it would have), up to the last bit of a double-precision logarithm.

    The winner's margin over the runner-up is of the order of the ratios themselves, so logits that
    differ in their last bits (a request resumed by prefilling prompt + output, a verify step of
    speculative decoding) almost never change a seeded draw. An inverse-CDF draw (one uniform per row)
    moves with every change in the cumulative sums below it: tried, it changed a resumed stream in
    tests/test_router_failover.py and 20 of 300 draws in tests/test_sampling.py's
    ``test_a_seeded_draw_survives_small_changes_in_the_logits``, where the race changes none. Uniforms
    that can be 0 must be avoided: float32 uniforms in [0, 1) gave a noise of 0 once in 2^24 tokens,
    and that token won whatever its probability (~0.3% of rows of 49152 tokens); the hash's uniforms
    lie in [2^-32, 1 - 2^-24].

    Args:
        probs: [B, V] f32, rows summing to 1 (filtered tokens exactly 0); overwritten off the C path.
        seeds: row index -> the 64-bit seed of a seeded row's draw (``SamplingMetadata.seeds``).
    Returns:
        [B] int64 sampled token ids.
    """
    batch = probs.shape[0]
    base = int(torch.randint(0, 2**62, ())) if len(seeds) < batch else 0  # the global RNG
    values = [seeds[row] if row in seeds else position_seed(base, row) for row in range(batch)]
    row_seeds = torch.tensor([v - 2**64 if v >= 2**63 else v for v in values], dtype=torch.int64)  # [B]
    if race_kernel.takes(probs):
        return race_kernel.race_rows(probs, row_seeds)
    return argmax_rows(probs.div_(race_noise_torch(row_seeds, probs.shape[1], probs.device)))


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """race.c's mix32 (Wellons' lowbias32) on int64 tensors holding 32-bit values (products wrap; masked)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def race_noise_torch(seeds: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """The race's Exp(1) noise [B, vocab] float32 for rows seeded ``seeds`` ([B] int64, two's complement),
    with tensor ops on ``device``: race.c's hash, uniform and ``(float)-log1p(-(double)w)``, value for
    value (the logarithm up to its last double bit)."""
    s = seeds.to(device=device, dtype=torch.int64)
    k1, k2 = (s & _M32).unsqueeze(1), ((s >> 32) & _M32).unsqueeze(1)  # [B, 1]
    index = torch.arange(vocab, device=device, dtype=torch.int64)  # [V]
    h = _mix32(_mix32((index * 0x9E3779B9 + k1) & _M32) ^ k2)  # [B, V], 32-bit values
    w = ((h >> 1).to(torch.float32) * 2.0**-31 + 2.0**-32).clamp_(max=1.0 - 2.0**-24)
    return w.double().neg_().log1p_().neg_().float()


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
