"""Reads a GGUF file into Hugging Face terms: a transformers config, HF-named float tensors, a tokenizer.

Tensors are dequantized with ``gguf.quants.dequantize`` (the model then runs dense in bf16/fp32), or,
with ``quantized=True``, the matrices in a format of ``tokenmill.quantization`` (Q4_0, Q4_1, Q8_0,
Q4_K, Q6_K) come out as ``QuantizedTensor``s holding the file's blocks; llama.cpp's Q/K row
permutation is undone for the ``llama`` architecture (whole rows, so blocks are moved as they are). Supported GGUF
architectures: llama (incl. Mistral exported as llama), qwen2, qwen3.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

# GGUF general.architecture -> (config class, HF architecture name)
_ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], str]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_gguf(path: Path) -> GGUFReader:
    """Memory-map a GGUF file (metadata parsed, tensor data left on disk until dequantized)."""
    return GGUFReader(str(path))


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def gguf_architecture(reader: GGUFReader) -> str:
    """``general.architecture``; raises ValueError when tokenmill cannot run it."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHITECTURES)})")
    return arch


def gguf_to_hf_config(reader: GGUFReader) -> PretrainedConfig:
    """Build the transformers config from GGUF metadata (``{arch}.block_count`` etc.).

    Raises:
        ValueError: unsupported architecture or a required key missing.
        NotImplementedError: RoPE scaling that cannot be expressed (llama.cpp ``rope_freqs``, unknown types).
    """
    arch = gguf_architecture(reader)
    config_cls, hf_arch = _ARCHITECTURES[arch]

    def required(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise NotImplementedError("GGUF files with a rope_freqs tensor (llama3-style RoPE) are not supported")
    hidden_size = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden_size // num_heads))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise NotImplementedError(f"partial rotary embeddings (rope dim {rope_dim} < head_dim {head_dim})")
    vocab_size = _field(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        vocab_size = len(reader.get_field("tokenizer.ggml.tokens").data)
    context_length = int(required("context_length"))

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0))}
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type in ("linear", "yarn"):
        rope["rope_type"] = scaling_type
        rope["factor"] = float(required("rope.scaling.factor"))
        if scaling_type == "yarn":
            rope["original_max_position_embeddings"] = int(required("rope.scaling.original_context_length"))
    elif scaling_type != "none":
        raise NotImplementedError(f"GGUF rope scaling type {scaling_type!r} is not supported")

    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(required("feed_forward_length")),
        num_hidden_layers=int(required("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=context_length,
        rms_norm_eps=float(required("attention.layer_norm_rms_epsilon")),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    return config_cls(**kwargs)


def _hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ValueError when unknown."""
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def _unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of Q/K rows.

    llama.cpp stores each head's rows as (pairs, 2) where HF has (2, pairs), i.e. rows are
    interleaved halves. w: [num_heads * head_dim, ...] -> same shape in HF (rotate-half) order.
    """
    rows = w.shape[0]
    head_dim = rows // num_heads
    w = w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])  # (H, D/2, 2, ...)
    return w.transpose(1, 2).reshape(rows, *w.shape[3:])  # (H * D, ...) as (H, 2, D/2, ...)


# Tensors that tokenmill fuses into one projection: all kept quantized or all dequantized.
_FUSED_GROUPS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


def _kept_quantized(reader: GGUFReader) -> set[str]:
    """Names of the matrices whose blocks tokenmill runs as stored (a fused group only when all its members can)."""
    from tokenmill.quantization.formats import GGUF_QUANT_TYPES

    names = {t.name for t in reader.tensors
             if int(t.tensor_type) in GGUF_QUANT_TYPES and len(t.shape) == 2 and t.name.endswith(".weight")}
    for name in list(names):
        match = _BLOCK_RE.fullmatch(name)
        if match is None:
            continue
        layer, part, _ = match.groups()
        group = next((g for g in _FUSED_GROUPS if part in g), None)
        if group and not all(f"blk.{layer}.{p}.weight" in names for p in group):
            names.discard(name)
    return names


def iter_gguf_weights(reader: GGUFReader, config: PretrainedConfig,
                      quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every tensor in the file: a float tensor, dequantized, or with
    ``quantized`` a ``tokenmill.quantization.QuantizedTensor`` for the matrices in a supported block
    format (the file's bytes, rows permuted as the dense tensor's would be).

    Shapes come out in PyTorch order ([out_features, in_features] for matrices).
    """
    from tokenmill.quantization.formats import QuantizedTensor

    permute = gguf_architecture(reader) == "llama"
    keep = _kept_quantized(reader) if quantized else set()
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if tensor.name in keep:
            n, k = int(tensor.shape[1]), int(tensor.shape[0])
            data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(n, -1))  # (N, row bytes)
            if permute and ".self_attn.q_proj." in name:
                data = _unpermute_rows(data, config.num_attention_heads).contiguous()
            elif permute and ".self_attn.k_proj." in name:
                data = _unpermute_rows(data, config.num_key_value_heads).contiguous()
            yield name, QuantizedTensor(int(tensor.tensor_type), (n, k), data)
            continue
        array = dequantize(tensor.data, tensor.tensor_type)
        if not array.flags.writeable:  # F32 tensors come back as read-only views of the memory map
            array = np.array(array)
        weight = torch.from_numpy(array)
        expected = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        weight = weight.reshape(expected)
        if permute and ".self_attn.q_proj." in name:
            weight = _unpermute_rows(weight, config.num_attention_heads)
        elif permute and ".self_attn.k_proj." in name:
            weight = _unpermute_rows(weight, config.num_key_value_heads)
        yield name, weight


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """The tokenizer (with chat template) that transformers reconstructs from the GGUF metadata."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
