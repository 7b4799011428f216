"""OLMoE: the Llama decoder with RMSNorm over the whole q and k projections and a sparse MoE block on every layer."""
from __future__ import annotations

from typing import TYPE_CHECKING


from tokenmill.models.llama import DecoderVariant
from tokenmill.models.sparse_moe import MoECausalLM, check_silu
from tokenmill.moe import MoEConfig, RouterConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class OlmoeForCausalLM(MoECausalLM):
    """OLMoE-1B-7B and alike: ``q_norm`` [heads * head_dim] and ``k_norm`` [kv_heads * head_dim] before RoPE;
    every layer MoE (``num_experts`` of ``intermediate_size``; softmax, top-k, renormalized when
    ``norm_topk_prob``); no shared expert; biases on all four attention projections when ``attention_bias``.

    Raises (on construction):
        ValueError: ``clip_qkv`` set (clamping q/k/v is not implemented).
    """

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        if getattr(config, "clip_qkv", None) is not None:
            raise ValueError(f"OLMoE clip_qkv={config.clip_qkv} is not supported (only null)")
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderVariant(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm_whole=True)

    @classmethod
    def moe_config(cls, config: PretrainedConfig) -> MoEConfig:
        check_silu(config)
        router = RouterConfig(num_experts=int(config.num_experts), top_k=int(config.num_experts_per_tok),
                              norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)))
        return MoEConfig(router, int(config.hidden_size), int(config.intermediate_size))
