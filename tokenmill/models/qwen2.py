"""Qwen2: the Llama decoder with a bias on q/k/v (none on o_proj or the MLP)."""
from __future__ import annotations

from transformers import PretrainedConfig

from tokenmill.models.llama import DecoderVariant, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM; same forward/compute_logits/load_weights contract as Llama.

    Sliding-window layers (``use_sliding_window``) are rejected by the loader when the window is
    shorter than the served context.
    """

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        return DecoderVariant(qkv_bias=True)
