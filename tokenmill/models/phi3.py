"""Phi-3: the Llama decoder whose checkpoint already stores the fused projections.

``self_attn.qkv_proj`` (q | k | v rows) and ``mlp.gate_up_proj`` (gate | up rows) load straight into the
engine's fused ``MergedLinear``s; nothing is split. ``longrope`` RoPE (Phi-3 128k / Phi-3.5) runs with one factor
set per engine, chosen by ``max_model_len`` as llama.cpp chooses by its context size (``layers.rotary_embedding``
says where that differs from transformers). ``partial_rotary_factor`` != 1 is refused by name
(``NotImplementedError`` from ``layers.rotary_embedding.compute_inv_freq``). ``sliding_window``, when set, applies
to every layer (as in transformers' Phi-3).
"""
from __future__ import annotations

from typing import TYPE_CHECKING


from tokenmill.models.llama import DecoderVariant, LlamaForCausalLM
from tokenmill.models.sliding_window import SlidingLayers

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3-mini causal LM; same forward/compute_logits/load_weights contract as Llama.

    Checkpoint tensors: ``model.layers.{i}.self_attn.qkv_proj.weight`` [(H + 2 * KVH) * D, hidden],
    ``model.layers.{i}.mlp.gate_up_proj.weight`` [2 * intermediate, hidden], no biases.
    """

    checkpoint_fuses_projections = True
    sliding_window_layers: SlidingLayers = "all"

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        return DecoderVariant()
