"""Tiny random mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) for the MoE tests.

Built from the transformers config classes with a fixed seed and saved with ``save_pretrained`` next to the
SmolLM2 tokenizer, as tests/tiny_models.py does for the dense families. Each exercises its family's rules: Mixtral
renormalizes top-2 of 8; Qwen2-MoE has a gated shared expert, ``norm_topk_prob`` off and one dense layer
(``mlp_only_layers``); Qwen3-MoE renormalizes and makes every other layer dense (``decoder_sparse_step`` 2);
OLMoE normalizes the whole q / k projections. ``gguf_compatible`` keeps to what a GGUF can say (llama.cpp: every
qwen3moe layer routed with renormalized weights; OLMoE's rms eps 1e-5, which its converter writes whatever the
config says).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import (AutoModelForCausalLM, MixtralConfig, OlmoeConfig, PretrainedConfig, Qwen2MoeConfig,
                          Qwen3MoeConfig)

from tests.tiny_models import BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE, smollm2_tokenizer

_COMMON: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2,
                               tie_word_embeddings=False, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
                               pad_token_id=EOS_TOKEN_ID)

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def moe_config(arch: str, gguf_compatible: bool = False, **overrides: Any) -> PretrainedConfig:
    """The transformers config of a tiny MoE model of ``arch`` (a MOE_ARCHS entry)."""
    if arch == "mixtral":
        kwargs = dict(num_hidden_layers=2, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                      sliding_window=None)
        cls, name = MixtralConfig, "MixtralForCausalLM"
    elif arch == "qwen2_moe":
        kwargs = dict(num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=3, shared_expert_intermediate_size=96, norm_topk_prob=False,
                      mlp_only_layers=[] if gguf_compatible else [1])
        cls, name = Qwen2MoeConfig, "Qwen2MoeForCausalLM"
    elif arch == "qwen3_moe":
        kwargs = dict(num_hidden_layers=2 if gguf_compatible else 4, intermediate_size=128, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, head_dim=32, norm_topk_prob=True,
                      decoder_sparse_step=1 if gguf_compatible else 2)
        cls, name = Qwen3MoeConfig, "Qwen3MoeForCausalLM"
    elif arch == "olmoe":
        kwargs = dict(num_hidden_layers=2, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=False, rms_norm_eps=1e-5)
        cls, name = OlmoeConfig, "OlmoeForCausalLM"
    else:
        raise ValueError(f"unknown MoE arch {arch!r}; choose from {MOE_ARCHS}")
    return cls(architectures=[name], **{**_COMMON, **kwargs, **overrides})


def make_moe_model(arch: str, out_dir: Path, gguf_compatible: bool = False, seed: int = 11,
                   **overrides: Any) -> torch.nn.Module:
    """Build, seed and save a tiny MoE checkpoint into ``out_dir``; returns the eval-mode transformers model."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(moe_config(arch, gguf_compatible, **overrides), dtype=torch.float32).eval()
    return save_tiny_checkpoint(hf, out_dir)


def save_tiny_checkpoint(hf: torch.nn.Module, out_dir: Path) -> torch.nn.Module:
    """Save the float32 model ``hf`` with the SmolLM2 tokenizer and a generation config into ``out_dir``;
    returns ``hf``."""
    hf.config.dtype = torch.float32
    hf.save_pretrained(out_dir)
    smollm2_tokenizer().save_pretrained(out_dir)
    generation = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": EOS_TOKEN_ID}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return hf


def greedy_and_expert_load(llm, max_tokens: int = 12):
    """Greedy tokens of four fixed short prompts through ``llm`` and the expert-load snapshot they produced (the
    model's counters reset first): what the lean-step tests compare between paths."""
    from tokenmill import SamplingParams

    model = llm.engine.runner.model
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 17, 230 + 3 * i, 41, 9]} for i in range(4)]
    model.expert_load.reset()
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return tokens, model.expert_load.snapshot()
