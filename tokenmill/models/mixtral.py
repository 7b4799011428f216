"""Mixtral: the Mistral decoder with a sparse MoE block (softmax over all experts, top-k, renormalized)."""
from __future__ import annotations

from typing import TYPE_CHECKING


from tokenmill.models.llama import DecoderVariant
from tokenmill.models.sliding_window import SlidingLayers
from tokenmill.models.sparse_moe import MoECausalLM, check_silu
from tokenmill.moe import MoEConfig, RouterConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MixtralForCausalLM(MoECausalLM):
    """Mixtral 8x7B / 8x22B and alike: every layer MoE, ``num_local_experts`` experts of ``intermediate_size``,
    ``num_experts_per_tok`` per token, no shared expert, no biases; ``sliding_window`` (when set) on every layer.

    Checkpoint names ``block_sparse_moe.gate`` / ``experts.{e}.w1 w3 w2`` load into ``mlp.gate`` /
    ``experts.{e}.gate_proj up_proj down_proj``.
    """

    sliding_window_layers: SlidingLayers = "all"
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                          (".w2.", ".down_proj."))

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        return DecoderVariant()

    @classmethod
    def moe_config(cls, config: PretrainedConfig) -> MoEConfig:
        check_silu(config)
        router = RouterConfig(num_experts=int(config.num_local_experts), top_k=int(config.num_experts_per_tok),
                              norm_topk_prob=True)
        return MoEConfig(router, int(config.hidden_size), int(config.intermediate_size))
