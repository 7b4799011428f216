"""Qwen3: the Llama decoder with per-head RMSNorm on q and k (before RoPE) and an explicit head_dim."""
from __future__ import annotations

from typing import TYPE_CHECKING


from tokenmill.models.llama import DecoderVariant, LlamaForCausalLM
from tokenmill.models.sliding_window import SlidingLayers

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense causal LM; ``self_attn.q_norm`` / ``self_attn.k_norm`` are RMSNorm over head_dim.

    ``config.head_dim`` may differ from hidden_size // num_attention_heads. Sliding-window layers as Qwen2's.
    """

    sliding_window_layers: SlidingLayers = "layer_types"

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderVariant(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
