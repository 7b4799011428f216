"""SamplingRow and SamplingMetadata: the per-step batch tensors the Sampler reads.

Builds every tensor once per step with one Python loop over requests (never over tokens or
vocab). Holds no model state and samples nothing; the Sampler owns the math.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from tokenmill.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: dividing logits by them would overflow.
GREEDY_TEMPERATURE_EPS = 1e-5
_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The RNG seed of a seeded request's draw at sequence ``position`` (its index in prompt + output):
    SplitMix64's finaliser (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
    2014) over ``seed`` and ``position``, a 64-bit unsigned int.

    Keying every draw by position (rather than advancing one stream) makes a seeded continuation
    independent of where it started: a request re-sent elsewhere as prompt + the tokens generated so
    far samples the same next tokens (the router resumes broken streams this way), and a speculative
    verifier can draw for any position in any order.
    """
    x = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass
class SamplingRow:
    """One row of the sampling batch: one request at one decode position.

    Args:
        params: the request's SamplingParams, already resolved with ``with_defaults``.
        prompt_token_ids: the prompt, used by the repetition penalty.
        output_token_ids: tokens generated so far (before this step).
        seed: the sequence's seed (``params.seed + child index``), or None. A non-greedy seeded row
            draws with ``position_seed(seed, position)`` where position = len(prompt) + len(output)
            (greedy rows draw nothing).
        stop_token_ids: EOS ids plus ``params.stop_token_ids``; masked to ``-inf`` while
            ``len(output_token_ids) < params.min_tokens``.
        min_tokens_exempt: the row's output constraint allows only end-of-sequence tokens now, so
            ``min_tokens`` does not mask them (the constraint decides when a constrained output ends).
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int | None = None
    stop_token_ids: set[int] = field(default_factory=set)
    min_tokens_exempt: bool = False


@dataclass
class SamplingMetadata:
    """Batch tensors for one sampling step (B rows, vocabulary size V).

    Optional tensors are None when no row needs them, so the Sampler can skip the work.

    Attributes:
        temperature: [B] f32, as requested (greedy rows hold values < GREEDY_TEMPERATURE_EPS).
        is_greedy: [B] bool, rows sampled by argmax.
        all_greedy / all_random: every row greedy / no row greedy.
        top_k: [B] int64 in [1, V]; V for rows without top-k (and greedy rows). None if unused.
        max_top_k: largest enabled top-k over rows (host int, avoids a device sync). None if unused.
        top_p: [B] f32 in (0, 1]; 1.0 for rows without top-p. None if unused.
        min_p: [B] f32 in [0, 1]; 0.0 for rows without min-p. None if unused.
        repetition_penalties: [B] f32 (1.0 = off). None if no row uses it.
        frequency_penalties: [B] f32 (0.0 = off). None if no row uses it.
        presence_penalties: [B] f32 (0.0 = off). None if no row uses it.
        prompt_token_ids: [B, max_prompt_len] int64 padded with V; only when the repetition
            penalty is used.
        output_token_ids: [B, max_output_len] int64 padded with V; only when a penalty is used.
        logit_bias: (row ids [N] int64, token ids [N] int64, biases [N] f32), or None.
        min_tokens_mask: (row ids [M] int64, token ids [M] int64) of stop tokens to mask, or None.
        max_num_logprobs: max of ``params.logprobs`` over rows; None if no row asks.
        seeds: row index -> the 64-bit seed of the row's draw (``position_seed``), for seeded rows that
            sample randomly (the race keys its noise by it).
    """

    temperature: torch.Tensor
    is_greedy: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    max_top_k: int | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    presence_penalties: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    max_num_logprobs: int | None
    seeds: dict[int, int] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls, rows: list[SamplingRow], vocab_size: int, *, device: torch.device | str = "cpu"
    ) -> SamplingMetadata:
        """Build the step's tensors from ``rows`` (B >= 1) for a vocabulary of ``vocab_size``.

        Tensors are assembled on the CPU and copied to ``device`` (pinned, non-blocking on GPU).

        Raises:
            ValueError: naming ``logit_bias`` when a biased token id is outside [0, vocab_size).
        """
        assert rows, "SamplingMetadata.build needs at least one row"
        device = torch.device(device)
        params = [row.params for row in rows]
        for p in params:
            assert p.temperature is not None and p.top_p is not None and p.top_k is not None, (
                "SamplingParams must be resolved with with_defaults before sampling"
            )
            assert p.repetition_penalty is not None

        greedy = [p.temperature < GREEDY_TEMPERATURE_EPS for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        random_params = [p for p, g in zip(params, greedy) if not g]

        def to_device(values: list, dtype: torch.dtype) -> torch.Tensor:
            tensor = torch.tensor(values, dtype=dtype)
            return _move(tensor, device)

        # Filters only matter for rows that sample randomly; greedy rows get the "off" value.
        top_k = max_top_k = None
        if any(0 < p.top_k < vocab_size for p in random_params):
            ks = [vocab_size if g or p.top_k == 0 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
            max_top_k = max(k for k in ks if k < vocab_size)
            top_k = to_device(ks, torch.int64)
        top_p = None
        if any(p.top_p < 1.0 for p in random_params):
            top_p = to_device([1.0 if g else p.top_p for p, g in zip(params, greedy)], torch.float32)
        min_p = None
        if any(p.min_p > 0.0 for p in random_params):
            min_p = to_device([0.0 if g else p.min_p for p, g in zip(params, greedy)], torch.float32)

        # Penalties apply to greedy rows too.
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_freq = any(p.frequency_penalty != 0.0 for p in params)
        use_pres = any(p.presence_penalty != 0.0 for p in params)
        rep = to_device([p.repetition_penalty for p in params], torch.float32) if use_rep else None
        freq = to_device([p.frequency_penalty for p in params], torch.float32) if use_freq else None
        pres = to_device([p.presence_penalty for p in params], torch.float32) if use_pres else None
        prompt_ids = output_ids = None
        if use_rep:
            prompt_ids = _move(_pad_token_ids([r.prompt_token_ids for r in rows], vocab_size), device)
        if use_rep or use_freq or use_pres:
            output_ids = _move(_pad_token_ids([r.output_token_ids for r in rows], vocab_size), device)

        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        mask_rows: list[int] = []
        mask_tokens: list[int] = []
        for i, row in enumerate(rows):
            if row.params.logit_bias:
                for token_id, bias in row.params.logit_bias.items():
                    if not 0 <= token_id < vocab_size:
                        raise ValueError(f"logit_bias token id must be in [0, {vocab_size}), got {token_id}")
                    bias_rows.append(i)
                    bias_tokens.append(token_id)
                    bias_values.append(bias)
            if len(row.output_token_ids) < row.params.min_tokens and not row.min_tokens_exempt:
                # Ids the model cannot emit need no masking.
                stop_ids = [t for t in row.stop_token_ids if 0 <= t < vocab_size]
                mask_rows.extend([i] * len(stop_ids))
                mask_tokens.extend(stop_ids)
        logit_bias = None
        if bias_rows:
            logit_bias = (
                to_device(bias_rows, torch.int64),
                to_device(bias_tokens, torch.int64),
                to_device(bias_values, torch.float32),
            )
        min_tokens_mask = None
        if mask_rows:
            min_tokens_mask = (to_device(mask_rows, torch.int64), to_device(mask_tokens, torch.int64))

        seeds = {i: position_seed(row.seed, len(row.prompt_token_ids) + len(row.output_token_ids))
                 for i, (row, g) in enumerate(zip(rows, greedy)) if row.seed is not None and not g}
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=to_device([p.temperature for p in params], torch.float32),
            is_greedy=to_device(greedy, torch.bool),
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalties=rep,
            frequency_penalties=freq,
            presence_penalties=pres,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            logit_bias=logit_bias,
            min_tokens_mask=min_tokens_mask,
            max_num_logprobs=max(asked) if asked else None,
            seeds=seeds,
        )


def _pad_token_ids(seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    """Right-pad token id lists into one [len(seqs), max_len] int64 tensor filled with ``pad_id``."""
    tensors = [torch.tensor(s, dtype=torch.int64) for s in seqs]
    return pad_sequence(tensors, batch_first=True, padding_value=pad_id)


def _move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a CPU tensor to ``device``; through pinned memory and non-blocking when not CPU."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
