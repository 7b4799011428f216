"""Expert load: how many tokens each expert of each MoE layer was routed, per step and in total.

Every MoE layer adds its step's counts (``expert_counts``: tokens per expert) here with a few tensor ops on the
counts' device (no host sync, so a captured CUDA graph records them too): the running total per (layer, expert)
and a histogram of the per-step values, one observation per (step, layer, expert). ``snapshot`` turns them into
plain numbers for ``/metrics`` (``tokenmill:moe_expert_tokens``) and ``/debug/status``; routing skew shows as a
wide histogram and as a large max / mean ratio of an expert's tokens. Warm-up and profiling passes count too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# upper bounds ("le") of the histogram's buckets, in tokens per expert per layer per step; +Inf is implied
BUCKETS: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class ExpertLoadSnapshot:
    """Plain-number copy of an ``ExpertLoad``.

    buckets: cumulative (le, observations <= le) pairs, then (inf, count); sum: tokens routed in total (each
    token counted k times); count: observations (steps x MoE layers x experts); tokens_per_expert: each
    expert's total over all MoE layers; layer_imbalance: per MoE layer, its busiest expert's total over the
    mean expert's (1.0: perfectly even; 0.0 before any token).
    """

    buckets: tuple[tuple[float, int], ...]
    sum: int
    count: int
    tokens_per_expert: tuple[int, ...]
    layer_imbalance: tuple[float, ...]

    def summary(self) -> dict:
        """For ``/debug/status``: totals, the per-layer imbalance and the busiest / idlest experts."""
        totals = self.tokens_per_expert
        ranked = sorted(range(len(totals)), key=lambda e: (-totals[e], e))
        return {
            "num_experts": len(totals),
            "num_moe_layers": len(self.layer_imbalance),
            "routed_tokens_total": self.sum,
            "tokens_per_expert": list(totals),
            "max_over_mean_per_layer": [round(x, 4) for x in self.layer_imbalance],
            "busiest_experts": ranked[:8],
            "idle_experts": [e for e in range(len(totals)) if totals[e] == 0],
        }


class ExpertLoad:
    """Running expert-load counters of one model: ``record`` from the MoE layers, ``snapshot`` for readers.

    num_moe_layers: the model's MoE layers (dense layers have none); num_experts: routed experts per layer.
    """

    def __init__(self, num_moe_layers: int, num_experts: int, device: torch.device | str = "cpu") -> None:
        self.num_moe_layers = num_moe_layers
        self.num_experts = num_experts
        self.totals = torch.zeros(num_moe_layers, num_experts, dtype=torch.int64, device=device)
        self.histogram = torch.zeros(len(BUCKETS) + 1, dtype=torch.int64, device=device)  # per bucket, last +Inf
        self._bounds = torch.tensor(BUCKETS, dtype=torch.int64, device=device)
        self._ones = torch.ones(num_experts, dtype=torch.int64, device=device)

    def record(self, moe_layer: int, counts: torch.Tensor) -> None:
        """Add one step of one MoE layer: counts [E] int64, tokens per expert."""
        if self.totals.device != counts.device:  # the model moved after construction (CPU-built, then to CUDA)
            self.to(counts.device)
        self.totals[moe_layer] += counts
        self.histogram.scatter_add_(0, torch.bucketize(counts, self._bounds), self._ones)

    def to(self, device: torch.device | str) -> None:
        """Move the counters (keeping their values)."""
        self.totals = self.totals.to(device)
        self.histogram = self.histogram.to(device)
        self._bounds = self._bounds.to(device)
        self._ones = self._ones.to(device)

    def reset(self) -> None:
        """Zero every counter."""
        self.totals.zero_()
        self.histogram.zero_()

    def snapshot(self) -> ExpertLoadSnapshot:
        """The counters as plain numbers (one host copy of a few small tensors)."""
        per_bucket = self.histogram.tolist()
        cumulative, running = [], 0
        for le, n in zip((*BUCKETS, float("inf")), per_bucket):
            running += n
            cumulative.append((float(le), running))
        totals = self.totals.double()
        mean = totals.mean(dim=1)
        imbalance = torch.where(mean > 0, totals.amax(dim=1) / mean.clamp(min=1e-9), torch.zeros_like(mean))
        return ExpertLoadSnapshot(buckets=tuple(cumulative), sum=int(self.totals.sum()), count=running,
                                  tokens_per_expert=tuple(self.totals.sum(dim=0).tolist()),
                                  layer_imbalance=tuple(imbalance.tolist()))
