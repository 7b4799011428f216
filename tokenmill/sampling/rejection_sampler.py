"""Verification of draft tokens against the target model: the rejection sampler, its one-hot form
(what the n-gram proposer uses) and a slow reference beside them.

The rule is standard speculative sampling (Leviathan, Kalman and Matias, "Fast Inference from
Transformers via Speculative Decoding", 2023; Chen et al., "Accelerating Large Language Model
Decoding with Speculative Sampling", 2023): draft token d drawn from q is accepted with probability
min(1, p(d) / q(d)); the first rejected one is replaced by a draw from normalize(max(p - q, 0)); when
every draft is accepted, one more (bonus) token is drawn from p. The output is then distributed
exactly as tokens drawn from p one at a time.

For a proposer without probabilities (n-gram: q is one-hot at d) the rule reads: accept d with
probability p(d), else draw from p with d removed. :func:`accept_sampled_prefix` realises it by
drawing x ~ p at every position with the position's own seeded noise and accepting d iff x == d,
keeping x at the first mismatch: P(accept) = p(d), and a rejected position outputs x ~ p(. | x != d)
= normalize(max(p - onehot(d), 0)). Since the draw at a position is the one plain decoding makes
there (the sampler keys a seeded request's noise by position), a verified token is the very token
plain decoding would produce: greedy and seeded outputs are the same with and without speculation.
"""
from __future__ import annotations

import torch


def accept_sampled_prefix(sampled: list[int], draft_token_ids: list[int]) -> int:
    """Number of draft tokens accepted when ``sampled[j]`` is the target's token at draft position j.

    Args:
        sampled: [m + 1] tokens the target sampled (greedy: its argmax) at the m draft positions and
            the bonus position, each given the drafts before it.
        draft_token_ids: [m] the drafts.
    Returns:
        a, 0 <= a <= m: the longest prefix with ``sampled[j] == draft_token_ids[j]``. The step's output
        tokens are ``sampled[: a + 1]`` (the accepted drafts, then the correction or bonus token).
    """
    assert len(sampled) == len(draft_token_ids) + 1, (len(sampled), len(draft_token_ids))
    for j, draft in enumerate(draft_token_ids):
        if sampled[j] != draft:
            return j
    return len(draft_token_ids)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_draft_tokens: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling over a batch, vectorised (no loop over rows or positions).

    Args:
        target_probs: [B, K + 1, V] f32, p at each draft position and the bonus position.
        draft_token_ids: [B, K] int64 (entries past a row's ``num_draft_tokens`` are ignored).
        draft_probs: [B, K, V] f32, q at each draft position; None: one-hot at the draft token.
        num_draft_tokens: [B] int64, m <= K drafts per row.
        uniforms: [B, K] f32 in [0, 1), the acceptance draws.
        noise: [B, K + 1, V] f32 Exp(1) draws for the recovery and bonus samples (exponential race).
    Returns:
        (output_token_ids [B, K + 1] int64, num_accepted [B] int64): row b's output is
        ``output_token_ids[b, : num_accepted[b] + 1]``; later entries are unspecified.
    """
    batch, k_max = draft_token_ids.shape
    if k_max == 0:
        bonus = (target_probs[:, 0] / noise[:, 0]).argmax(dim=1, keepdim=True)  # [B, 1]
        return bonus, torch.zeros(batch, dtype=torch.int64, device=bonus.device)
    positions = torch.arange(k_max, device=draft_token_ids.device)
    valid = positions[None, :] < num_draft_tokens[:, None]  # [B, K]
    safe_drafts = torch.where(valid, draft_token_ids, 0)
    p_draft = target_probs[:, :k_max].gather(2, safe_drafts.unsqueeze(2)).squeeze(2)  # [B, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = target_probs[:, :k_max].scatter(2, safe_drafts.unsqueeze(2), 0.0)  # p with d removed
    else:
        q_draft = draft_probs.gather(2, safe_drafts.unsqueeze(2)).squeeze(2)
        residual = (target_probs[:, :k_max] - draft_probs).clamp_min_(0.0)
    accepted = (uniforms * q_draft < p_draft) & valid  # u < p/q, without dividing by q
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]
    # A residual with no mass (p == q there) can only be reached with probability 0; fall back to p.
    empty = residual.sum(dim=2, keepdim=True) <= 0
    residual = torch.where(empty, target_probs[:, :k_max], residual)
    recovered = (residual / noise[:, :k_max]).argmax(dim=2)  # [B, K]
    bonus = (target_probs / noise).argmax(dim=2)  # [B, K + 1]
    output = torch.cat([safe_drafts, bonus[:, -1:]], dim=1).clone()  # [B, K + 1]
    rows = torch.arange(batch, device=output.device)
    end = num_accepted  # the position of the correction or bonus token
    final = torch.where(end < num_draft_tokens, recovered.gather(1, end.clamp_max(k_max - 1).unsqueeze(1)).squeeze(1),
                        bonus.gather(1, end.unsqueeze(1)).squeeze(1))
    output[rows, end] = final
    return output, num_accepted


def rejection_sample_reference(
    target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> list[int]:
    """One row of speculative sampling, step by step as the papers write it (slow; for tests).

    Args:
        target_probs: [m + 1, V] p at each draft position and the bonus position.
        draft_token_ids: [m] the drafts.
        draft_probs: [m, V] q, or None for one-hot at the draft.
        generator: the CPU generator every draw uses.
    Returns:
        the output tokens (accepted drafts, then the correction or bonus token).
    """
    out = []
    for j, d in enumerate(draft_token_ids):
        p = target_probs[j]
        q = torch.zeros_like(p) if draft_probs is None else draft_probs[j]
        if draft_probs is None:
            q[d] = 1.0
        if torch.rand((), generator=generator).item() < min(1.0, (p[d] / q[d]).item()):
            out.append(d)
            continue
        residual = (p - q).clamp_min(0.0)
        residual = residual / residual.sum() if residual.sum() > 0 else p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(draft_token_ids)], 1, generator=generator)))
    return out
