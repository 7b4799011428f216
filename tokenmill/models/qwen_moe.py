"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 decoders with sparse MoE blocks on the layers the config names.

Routing: softmax over all experts (float32), top-k, renormalized when ``norm_topk_prob``. Qwen2-MoE adds a shared
expert (``shared_expert_intermediate_size``) scaled per token by sigmoid(``shared_expert_gate``(x)). MoE layers:
i not in ``mlp_only_layers`` and (i + 1) % ``decoder_sparse_step`` == 0; the others keep a dense MLP of
``intermediate_size``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING


from tokenmill.models.llama import DecoderVariant
from tokenmill.models.sliding_window import SlidingLayers
from tokenmill.models.sparse_moe import MoECausalLM, check_silu
from tokenmill.moe import MoEConfig, RouterConfig, sparse_layer_mask

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _num_experts(config: PretrainedConfig) -> int:
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0)


class Qwen2MoeForCausalLM(MoECausalLM):
    """Qwen1.5-MoE / Qwen2-MoE (e.g. Qwen2-57B-A14B): q/k/v bias (``qkv_bias``), a gated shared expert.

    Sliding-window layers as Qwen2's (``layer_types``).
    """

    sliding_window_layers: SlidingLayers = "layer_types"

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        return DecoderVariant(qkv_bias=bool(getattr(config, "qkv_bias", True)))

    @classmethod
    def moe_layers(cls, config: PretrainedConfig) -> tuple[bool, ...]:
        return sparse_layer_mask(config.num_hidden_layers, _num_experts(config),
                                 mlp_only_layers=getattr(config, "mlp_only_layers", None) or (),
                                 decoder_sparse_step=int(getattr(config, "decoder_sparse_step", 1) or 1))

    @classmethod
    def moe_config(cls, config: PretrainedConfig) -> MoEConfig:
        check_silu(config)
        router = RouterConfig(num_experts=max(_num_experts(config), 1), top_k=int(config.num_experts_per_tok),
                              norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)))
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        return MoEConfig(router, int(config.hidden_size), int(config.moe_intermediate_size),
                         shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k RMSNorm, explicit head_dim), no
    shared expert; ``sliding_window`` (when ``use_sliding_window``) on every layer, as transformers' class does."""

    sliding_window_layers: SlidingLayers = "all"

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderVariant(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)

    @classmethod
    def moe_config(cls, config: PretrainedConfig) -> MoEConfig:
        check_silu(config)
        router = RouterConfig(num_experts=max(_num_experts(config), 1), top_k=int(config.num_experts_per_tok),
                              norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)))
        return MoEConfig(router, int(config.hidden_size), int(config.moe_intermediate_size))
