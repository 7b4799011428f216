"""Qwen2: the Llama decoder with a bias on q/k/v (none on o_proj or the MLP)."""
from __future__ import annotations

from typing import TYPE_CHECKING


from tokenmill.models.llama import DecoderVariant, LlamaForCausalLM
from tokenmill.models.sliding_window import SlidingLayers

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM; same forward/compute_logits/load_weights contract as Llama.

    Sliding-window layers: those ``config.layer_types`` names "sliding_attention" (transformers derives them
    from ``use_sliding_window`` and ``max_window_layers``).
    """

    sliding_window_layers: SlidingLayers = "layer_types"

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        return DecoderVariant(qkv_bias=True)
