"""Tiny random DeepSeek-V2 / V3 checkpoints (multi-head latent attention + MoE) for the MLA tests.

Built from transformers' config classes with a fixed seed and saved with ``save_pretrained`` next to the SmolLM2
tokenizer, as tests/moe_models.py does. V2: q straight from ``q_proj`` (``q_lora_rank`` None, as V2-Lite), softmax
``group_limited_greedy`` routing over 4 groups, a shared expert, a first dense layer, ``v_head_dim`` unlike
``qk_nope_head_dim``. V3: low-rank q (``q_lora_rank``), sigmoid scores with a random ``e_score_correction_bias``,
grouped top-k by the two best of a group (noaux_tc), renormalized, ``routed_scaling_factor`` 2.5, DeepSeek's YaRN
RoPE with ``mscale_all_dim`` (the softmax-scale correction) and interleaved rope dims. The latent is 32 + 16 = 48
values per token and layer (a multiple of the CPU prefill kernel's vector width).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, PretrainedConfig

from tests.moe_models import save_tiny_checkpoint
from tests.tiny_models import BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE

DEEPSEEK_ARCHS = ("deepseek_v2", "deepseek_v3")
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 32, 16

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_hidden_layers=3, max_position_embeddings=512,
    rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False, bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID, intermediate_size=96, moe_intermediate_size=32,
    n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=1, n_group=4, topk_group=2,
    kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=16, qk_rope_head_dim=QK_ROPE_HEAD_DIM)


def deepseek_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """The transformers config of a tiny DeepSeek model of ``arch`` (a DEEPSEEK_ARCHS entry)."""
    if arch == "deepseek_v2":
        kwargs = dict(q_lora_rank=None, v_head_dim=24, n_shared_experts=1, topk_method="group_limited_greedy",
                      routed_scaling_factor=1.5)
        cls, name = DeepseekV2Config, "DeepseekV2ForCausalLM"
    elif arch == "deepseek_v3":
        kwargs = dict(q_lora_rank=24, v_head_dim=16, n_shared_experts=2, routed_scaling_factor=2.5,
                      norm_topk_prob=True, rope_interleave=True,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "mscale": 1.0, "mscale_all_dim": 1.0})
        cls, name = DeepseekV3Config, "DeepseekV3ForCausalLM"
    else:
        raise ValueError(f"unknown DeepSeek arch {arch!r}; choose from {DEEPSEEK_ARCHS}")
    return cls(architectures=[name], **{**_COMMON, **kwargs, **overrides})


def make_deepseek_model(arch: str, out_dir: Path | str, seed: int = 5, **overrides: Any) -> torch.nn.Module:
    """Build, seed and save a tiny DeepSeek checkpoint into ``out_dir``; returns the eval-mode transformers model
    (float32). V3's correction biases are drawn at random (they start at zero), so they steer the choice."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(deepseek_config(arch, **overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0, 0.3)
    return save_tiny_checkpoint(hf, out_dir)
