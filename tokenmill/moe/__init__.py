"""Mixture-of-experts layers: routing rules, routed and shared experts, the grouped expert step, expert load.

See docs/moe.md. Imports ``tokenmill.layers`` only; the model files (``tokenmill.models``) import this package.
"""
from tokenmill.moe.experts import (ExpertMLP, combine_in_rank_order, dense_expert_step, expert_counts,
                                   grouped_expert_step, reference_expert_step)
from tokenmill.moe.layer import MoEConfig, Router, SparseMoeBlock, sparse_layer_mask
from tokenmill.moe.load_stats import BUCKETS, ExpertLoad, ExpertLoadSnapshot
from tokenmill.moe.routing import RouterConfig, select_experts, stable_topk

__all__ = [
    "BUCKETS",
    "ExpertLoad",
    "ExpertLoadSnapshot",
    "ExpertMLP",
    "MoEConfig",
    "Router",
    "RouterConfig",
    "SparseMoeBlock",
    "combine_in_rank_order",
    "dense_expert_step",
    "expert_counts",
    "grouped_expert_step",
    "reference_expert_step",
    "select_experts",
    "sparse_layer_mask",
    "stable_topk",
]
