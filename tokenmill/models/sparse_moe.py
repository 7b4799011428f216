"""MoECausalLM: the Llama decoder with ``tokenmill.moe.SparseMoeBlock`` in place of the MLP on its MoE layers.

Each family (mixtral.py, qwen_moe.py, olmoe.py) says how its config reads as a ``MoEConfig`` (router rule, expert
widths, shared expert), which layers are MoE (the others keep a dense ``LlamaMLP`` of ``intermediate_size``) and
how its checkpoint names differ from the module names (``checkpoint_renames``). The model owns one
``ExpertLoad`` (``expert_load``) that every MoE layer counts its step's tokens per expert into.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from collections.abc import Callable, Iterable

import torch
from torch import nn

from tokenmill.models.llama import LlamaForCausalLM, LlamaModel
from tokenmill.moe import ExpertLoad, MoEConfig, SparseMoeBlock

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def check_silu(config: PretrainedConfig) -> None:
    """Raises ValueError unless the experts' activation is SiLU (the only one these families use)."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported for MoE experts (only 'silu')")


class MoECausalLM(LlamaForCausalLM):
    """A Llama-family causal LM whose MoE layers route each token to k experts (see the module docstring).

    forward / compute_logits / load_weights as ``LlamaForCausalLM``; ``expert_load`` counts tokens per expert.
    """

    # (checkpoint substring, module substring) replaced in every checkpoint name before loading
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    @classmethod
    def moe_config(cls, config: PretrainedConfig) -> MoEConfig:
        """The family's MoE layer configuration. Raises ValueError for a config it cannot run."""
        raise NotImplementedError

    @classmethod
    def moe_layers(cls, config: PretrainedConfig) -> tuple[bool, ...]:
        """Which layers are MoE (default: all)."""
        return (True,) * config.num_hidden_layers

    def attention_factory(self, config: PretrainedConfig) -> Callable[[int], nn.Module] | None:
        """Layer index -> its attention module; None (the default) for Llama's (DeepSeek: latent attention)."""
        return None

    @classmethod
    def rope_dim(cls, config: PretrainedConfig) -> int | None:
        """The width RoPE rotates; None (the default) for the head_dim."""
        return None

    def build_decoder(self, config: PretrainedConfig) -> nn.Module:
        moe = self.moe_config(config)
        sparse = self.moe_layers(config)
        moe_index = {layer: j for j, layer in enumerate(i for i, s in enumerate(sparse) if s)}
        self.expert_load = ExpertLoad(len(moe_index), moe.router.num_experts)

        def mlp(layer: int) -> nn.Module | None:
            return SparseMoeBlock(moe, moe_index[layer], self.expert_load) if sparse[layer] else None

        return LlamaModel(config, self.decoder_variant(config), self.sliding_windows(config), mlp,
                          self.attention_factory(config), self.rope_dim(config))

    def _rename(self, name: str) -> str:
        for old, new in self.checkpoint_renames:
            name = name.replace(old, new)
        return name

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As ``LlamaForCausalLM.load_weights``, after ``checkpoint_renames``; expert gate/up_proj go into each
        expert's ``gate_up_proj``."""
        super().load_weights((self._rename(name), tensor) for name, tensor in weights)
