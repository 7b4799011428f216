"""Top-k expert selection: each family's rule as one pure function of the router logits.

Rules (``RouterConfig``), as the transformers model files compute them:
- Mixtral: softmax over every expert (float32), top-k, renormalized over the k (``norm_topk_prob=True``);
- Qwen2-MoE, Qwen3-MoE, OLMoE: softmax, top-k, renormalized only when the config's ``norm_topk_prob`` says so;
- softmax over the k chosen logits (``softmax_after_topk``): the same weights as softmax-top-k-renormalize up to
  rounding (Mistral's reference Mixtral, vLLM's ``renormalize``);
- DeepSeek-V2: softmax, the ``topk_group`` best of ``num_groups`` expert groups by their best score
  (``group_scoring="max"``, ``topk_method="group_limited_greedy"``; one group is plain greedy), top-k within
  them, weights times ``routed_scaling_factor``;
- DeepSeek-V3: sigmoid scores, choice on ``score + e_score_correction_bias`` (the bias steers the choice, not the
  weights), groups ranked by the sum of their two best biased scores (``group_scoring="top2_sum"``), weights the
  unbiased scores of the chosen experts, renormalized (``norm_topk_prob``), times ``routed_scaling_factor``.

Ties: an exact tie picks the lowest expert (and group) index, by a stable descending sort, so a token's choice
depends only on its own scores. (``torch.topk``, which transformers calls, orders tied values as its CPU kernel
happens to; where every tied expert is chosen both pick the same set.) The rank order of the k chosen experts
(descending score, ties by index) is the order their outputs are summed in (``experts.combine_in_rank_order``).
Pure torch on [T, E] tensors; no Python loop over tokens. Deterministic mode (``invariant``): torch's sigmoid
runs an element through a vector or a scalar exp depending on where it sits in the batch (bits differ), so sigmoid
scores come from ``invariant_sigmoid`` instead; softmax over a row is already the same code for every row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from tokenmill.layers.silu_and_mul_kernel import bi_silu_and_mul

Scoring = Literal["softmax", "sigmoid"]
GroupScoring = Literal["max", "top2_sum"]


@dataclass(frozen=True)
class RouterConfig:
    """How one family turns router logits [T, E] into k (weight, expert) pairs per token.

    num_experts: E (routed experts). top_k: k, 1 <= k <= E. scoring: "softmax" over all E (float32) or
    "sigmoid" per expert. softmax_after_topk: pick the k largest logits, then softmax over those k (softmax
    scoring only). norm_topk_prob: divide the k weights by their sum. num_groups / topk_groups: grouped top-k
    (E split into ``num_groups`` equal groups, only the ``topk_groups`` best groups eligible; 1 / 1 is plain
    top-k). group_scoring: a group's score, its best expert ("max", DeepSeek-V2) or the sum of its two best
    ("top2_sum", DeepSeek-V3). routed_scaling_factor: multiplies the final weights. correction_bias: the choice
    is made on ``score + e_score_correction_bias`` (DeepSeek-V3's aux-loss-free balancing); the weights stay
    the unbiased scores.

    Raises (on construction):
        ValueError: a field out of range or a combination no family uses (named).
    """

    num_experts: int
    top_k: int
    scoring: Scoring = "softmax"
    softmax_after_topk: bool = False
    norm_topk_prob: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_scoring: GroupScoring = "max"
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok (top_k) must be in [1, {self.num_experts}], got {self.top_k}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if self.softmax_after_topk and (self.scoring != "softmax" or self.num_groups > 1 or self.correction_bias):
            raise ValueError("softmax_after_topk is for plain softmax routing (no groups, no correction bias)")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(f"n_group {self.num_groups} must divide num_experts {self.num_experts}")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group must be in [1, n_group={self.num_groups}], got {self.topk_groups}")
        per_group = self.num_experts // self.num_groups
        if self.topk_groups * per_group < self.top_k:
            raise ValueError(f"topk_group {self.topk_groups} groups of {per_group} experts hold fewer than "
                             f"num_experts_per_tok {self.top_k}")
        if self.group_scoring not in ("max", "top2_sum"):
            raise ValueError(f"group_scoring must be 'max' or 'top2_sum', got {self.group_scoring!r}")
        if self.group_scoring == "top2_sum" and self.num_groups > 1 and per_group < 2:
            raise ValueError("group_scoring 'top2_sum' needs at least 2 experts per group")


def invariant_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) with each element's bits independent of its position in the batch (deterministic mode).

    x: [T, n] float32 or bfloat16 on CPU. Computed as silu(x) / x (0.5 at x = 0) with silu from the batch-invariant
    SiLU kernel (``layers.silu_and_mul_kernel``, one exp for vector lanes and tails alike): one extra rounding
    against torch.sigmoid, the same bits for a token alone or in any batch.

    Raises:
        RuntimeError: the batch-invariant kernels are not available.
    """
    silu = bi_silu_and_mul(torch.cat([x, torch.ones_like(x)], dim=-1))  # (T, n): x * sigmoid(x)
    return torch.where(x == 0, torch.full_like(x, 0.5), silu / x)


def stable_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row, in descending order, exact ties broken by the lowest index.

    values: [T, N] float; returns (values [T, k], indices [T, k] int64). NaNs are not expected (router logits
    of finite activations).
    """
    sorted_values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return sorted_values[:, :k], order[:, :k]


def _group_mask(choice: torch.Tensor, config: RouterConfig) -> torch.Tensor:
    """[T, E] bool: True for the experts of each token's ``topk_groups`` best groups."""
    num_tokens = choice.shape[0]
    per_group = config.num_experts // config.num_groups
    grouped = choice.view(num_tokens, config.num_groups, per_group)  # (T, G, E/G)
    if config.group_scoring == "max":
        group_scores = grouped.amax(dim=-1)  # (T, G)
    else:
        group_scores = stable_topk(grouped.reshape(-1, per_group), 2)[0].sum(-1).view(num_tokens, -1)  # (T, G)
    _, groups = stable_topk(group_scores, config.topk_groups)  # (T, topk_groups)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)  # (T, G)
    return keep.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, config.num_experts)


def select_experts(router_logits: torch.Tensor, config: RouterConfig, correction_bias: torch.Tensor | None = None,
                   invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts and their weights, by ``config``'s rule (module docstring).

    router_logits: [T, E] (any float dtype; computed in float32). correction_bias: [E], required exactly when
    ``config.correction_bias``. invariant: deterministic mode (sigmoid scores by ``invariant_sigmoid``). Returns
    (weights [T, k] float32, expert ids [T, k] int64), in rank order.

    Raises:
        ValueError: logits of the wrong width, or a correction bias given without the config asking for one
            (or missing when it does).
    """
    if router_logits.dim() != 2 or router_logits.shape[1] != config.num_experts:
        raise ValueError(f"router logits must be [T, {config.num_experts}], got {tuple(router_logits.shape)}")
    if (correction_bias is not None) != config.correction_bias:
        raise ValueError("e_score_correction_bias must be given exactly when the router config uses one")
    logits = router_logits.float()
    if config.softmax_after_topk:
        top_logits, ids = stable_topk(logits, config.top_k)
        weights = torch.softmax(top_logits, dim=-1)
    else:
        if config.scoring == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = invariant_sigmoid(logits) if invariant else torch.sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if config.num_groups > 1:
            # masked experts can never be chosen: -inf for biased choice scores (DeepSeek-V3), 0 otherwise
            # (DeepSeek-V2; softmax scores are positive, so a masked expert still loses to every eligible one)
            fill = float("-inf") if correction_bias is not None else 0.0
            choice = choice.masked_fill(~_group_mask(choice, config), fill)
        _, ids = stable_topk(choice, config.top_k)
        weights = scores.gather(1, ids)  # (T, k) unbiased scores
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if config.scoring == "sigmoid" else 0.0))
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return weights, ids
