"""Reads a GGUF file into Hugging Face terms: a transformers config, HF-named float tensors, a tokenizer.

Tensors are dequantized with ``gguf.quants.dequantize`` (the model then runs dense in bf16/fp32), or,
with ``quantized=True``, the matrices in a format of ``tokenmill.quantization`` (``GGUF_QUANT_TYPES``)
come out as ``QuantizedTensor``s over the file's blocks, memory-mapped in place (``iter_mapped_weights``:
one copy-on-write mapping per tensor, so a tensor that is used as stored costs no copy and one that a
consumer repacks releases its pages with its last reference); llama.cpp's Q/K row permutation is undone
for the ``llama`` architecture (whole rows, so blocks are moved as they are; a copy). Supported GGUF
architectures: llama (incl. Mistral exported as llama, and Llama 3.x's ``rope_freqs`` RoPE factors),
qwen2, qwen3, phi3 (fused ``attn_qkv`` and ``ffn_up`` = gate | up, loaded into the fused projections as
they are; longrope's ``rope_factors_long`` / ``rope_factors_short`` into the config), gemma2 and gemma3 (llama.cpp stores Gemma's RMSNorm weights as ``1 + weight``; 1 is subtracted
here so the model sees transformers' convention). Mixture of experts (docs/moe.md): llama with
``llama.expert_count`` (Mixtral), qwen2moe, qwen3moe and olmoe; the experts' stacked 3-D tensors
(``blk.N.ffn_{gate,up,down}_exps``, or ``ffn_gate_up_exps``) come out as one [out, in] tensor per expert (a
view of the stack's rows, so quantized experts stay in their blocks), shared experts from ``ffn_*_shexp`` and
``ffn_gate_inp_shexp``. deepseek2 (DeepSeek-V2/V3 with latent attention, ``gguf_deepseek2``): its config from
the ``deepseek2.*`` keys, and ``kv_b_proj`` joined from ``attn_k_b`` / ``attn_v_b`` (dense). What the engine
cannot run (architecture, tensor type or name, RoPE variant, tokenizer) raises ``UnsupportedModelError`` naming the file and the metadata key or tensor.
"""
from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TYPE_CHECKING

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from tokenmill.models.errors import UnsupportedModelError
from tokenmill.models.gguf_deepseek2 import (DEEPSEEK2_BLOCK_NAMES, DEEPSEEK2_DENSE_ONLY, DEEPSEEK2_PARAMETERS,
                                             LatentHalves, deepseek2_config_class)
from tokenmill.models.gguf_metadata import GGUFMetadata, GGUFTensorInfo, read_gguf_metadata
from tokenmill.models.gguf_tokenizer import apply_llama_cpp_split

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

__all__ = ["GGUFMetadata", "GGUFTensorInfo", "gguf_to_hf_config", "iter_gguf_weights", "iter_mapped_weights",
           "load_gguf_tokenizer", "open_gguf", "read_gguf_metadata", "read_tensor_index"]

# GGUF general.architecture -> (transformers config class name, HF architecture name). Names, not classes:
# importing any concrete config class costs transformers' activations and torch.distributed.tensor (about 0.65 s
# on a Xeon, 2 s on a Zen 1 EPYC), which a cached load does without (gguf_cache.cached_config).
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "deepseek2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),  # or V3: gguf_deepseek2.deepseek2_config_class
}
# llama.cpp's router weight rule per MoE architecture where the file has no ``{arch}.expert_weights_norm``
# (its llm_build_* functions): Mixtral (llama) and qwen3moe renormalize the top-k weights, qwen2moe and olmoe not.
_MOE_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}
# HF model_type of a config built from GGUF -> its GGUF architecture, where the tensor names or values differ
_GGUF_ARCH_OF_MODEL_TYPE = {"phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3", "deepseek_v2": "deepseek2",
                            "deepseek_v3": "deepseek2"}

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
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q | k | v in one tensor
    # mixture of experts: router, shared expert and its sigmoid gate (the routed experts: _EXPERT_STACKS)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# stacked expert tensors [num_experts, out, in] -> the projection(s) each expert's rows hold (gate_up: gate | up)
_EXPERT_STACKS = {"ffn_gate_exps": ("gate_proj",), "ffn_up_exps": ("up_proj",), "ffn_down_exps": ("down_proj",),
                  "ffn_gate_up_exps": ("gate_proj", "up_proj")}
# Architectures whose block tensors name something else (gguf-py's constants): phi3's ffn_up is the fused
# gate | up projection; Gemma's ffn_norm is the norm before the MLP, its attention-output and MLP-output
# norms are post_attention_norm and post_ffw_norm.
_GEMMA_BLOCK_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_BLOCK_NAMES = {"phi3": {"ffn_up": "mlp.gate_up_proj"}, "gemma2": _GEMMA_BLOCK_NAMES,
                     "gemma3": _GEMMA_BLOCK_NAMES, "deepseek2": DEEPSEEK2_BLOCK_NAMES}
# block tensors that are a parameter of their own (no .weight / .bias suffix in the HF name), per architecture
_ARCH_PARAMETERS = {"deepseek2": DEEPSEEK2_PARAMETERS}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


# Tensors in the file that are not weights: read into the config (``rope_freqs.weight``: Llama 3.x RoPE).
# ``rope_factors_{long,short}.weight``: Phi-3 longrope factors.
_NOT_WEIGHTS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})


class _Reader(GGUFReader):
    """``GGUFReader`` that names the tensor whose type id is unknown (the package only says the number)
    and remembers its file."""

    def __init__(self, path: Path) -> None:
        self.source = Path(path)
        super().__init__(str(path))

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        known = {int(t) for t in GGMLQuantizationType}
        for field in fields:
            _name_len, name_data, _n_dims, _dims, raw_dtype, _offset = field.parts
            if int(raw_dtype[0]) not in known or GGMLQuantizationType(int(raw_dtype[0])) not in GGML_QUANT_SIZES:
                name = bytes(name_data).decode("utf-8", "replace")
                raise UnsupportedModelError(f"{self.source}: tensor {name!r} has tensor type id {int(raw_dtype[0])}, "
                                            "which neither tokenmill nor the gguf package knows")
        super()._build_tensors(start_offs, fields)


def open_gguf(path: Path) -> GGUFReader:
    """Memory-map a GGUF file (metadata parsed, tensor data left on disk until dequantized).

    Raises:
        UnsupportedModelError: not a GGUF file the ``gguf`` package can read (bad magic, version,
            truncated), or a tensor of a type id it does not know (named).
    """
    try:
        return _Reader(Path(path))
    except UnsupportedModelError:
        raise
    except (ValueError, KeyError, IndexError, TypeError, OSError) as exc:
        raise UnsupportedModelError(f"{path}: not a GGUF file tokenmill can read "
                                    f"({type(exc).__name__}: {exc})") from exc


def _source(reader: GGUFReader | GGUFMetadata) -> Path:
    """The file a reader maps (for error messages)."""
    return getattr(reader, "source", None) or Path(reader.data.filename)


def _field(reader: GGUFReader | GGUFMetadata, key: str, default: Any = None) -> Any:
    if isinstance(reader, GGUFMetadata):
        return reader.fields.get(key, default)
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _tensor_infos(reader: GGUFReader | GGUFMetadata) -> list[GGUFTensorInfo]:
    """Every tensor of the file (``rope_freqs.weight`` included), in file order."""
    if isinstance(reader, GGUFMetadata):
        return reader.tensors
    return [GGUFTensorInfo(t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)), int(t.data_offset),
                           int(t.n_bytes)) for t in reader.tensors]


def gguf_architecture(reader: GGUFReader | GGUFMetadata) -> str:
    """``general.architecture``; raises UnsupportedModelError (a ValueError) when tokenmill cannot run it."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(f"{_source(reader)}: general.architecture {arch!r} is not supported "
                                    f"(supported: {', '.join(sorted(_ARCHITECTURES))})")
    return arch


def _rope_freq_factors(reader: GGUFReader | GGUFMetadata, rope_dim: int, name: str = "rope_freqs.weight") -> list[float]:
    """RoPE factors stored as a tensor (F32 [rope_dim / 2]): llama.cpp divides each inverse frequency
    ``base^(-2i/d)`` by its factor. ``name``: Llama 3.x's ``rope_freqs.weight`` (1 for high frequencies, the
    scaling factor for low ones, smoothed between), or Phi-3's longrope ``rope_factors_long.weight`` /
    ``rope_factors_short.weight``.

    Raises:
        UnsupportedModelError: another type or length, or factors that are not finite and positive.
    """
    info = next(t for t in _tensor_infos(reader) if t.name == name)
    where = f"{_source(reader)}: tensor {name!r}"
    qtype = GGMLQuantizationType(info.qtype)
    if qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        raise UnsupportedModelError(f"{where} has type {qtype.name}; only F32/F16 RoPE factors are supported")
    raw = np.fromfile(_source(reader), dtype=np.uint8, count=info.nbytes, offset=info.offset)
    factors = np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(-1)
    if factors.shape != (rope_dim // 2,):
        raise UnsupportedModelError(f"{where} has {factors.size} factors; the RoPE dimension {rope_dim} needs "
                                    f"{rope_dim // 2}")
    if not (np.isfinite(factors).all() and (factors > 0).all()):
        raise UnsupportedModelError(f"{where} holds factors that are not finite and positive")
    return [float(f) for f in factors]


def gguf_to_hf_config(reader: GGUFReader | GGUFMetadata) -> PretrainedConfig:
    """Build the transformers config from GGUF metadata (``{arch}.block_count`` etc.).

    A ``rope_freqs.weight`` tensor (Llama 3.x) becomes the config's ``rope_freq_factors`` (a list of
    rope_dim / 2 floats, saved in config.json), which ``layers.rotary_embedding.compute_inv_freq`` divides
    the inverse frequencies by, as llama.cpp does.

    Raises:
        UnsupportedModelError (a ValueError): an unsupported architecture, a required key missing, a RoPE
            variant tokenmill cannot run (an unknown ``{arch}.rope.scaling.type``, partial rotary
            embeddings, ``rope_freqs`` beside a scaling type, bad ``rope_freqs``); the message names the file
            and the key or tensor.
    """
    import transformers  # here, not at the top: a cached load never builds a config (importing costs ~1 s)

    arch = gguf_architecture(reader)
    class_name, hf_arch = _ARCHITECTURES[arch]
    config_cls: type[PretrainedConfig] = getattr(transformers, class_name)
    source = _source(reader)

    def required(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise UnsupportedModelError(f"{source}: metadata key {arch}.{key} is missing")
        return value

    tensor_names = {t.name for t in _tensor_infos(reader)}
    hidden_size = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden_size // num_heads))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim and arch != "deepseek2":  # deepseek2: key_length is the absorbed MLA query's
        raise UnsupportedModelError(f"{source}: {arch}.rope.dimension_count {rope_dim} < head dim {head_dim} "
                                    "(partial rotary embeddings) is not supported")
    vocab_size = _field(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        vocab_size = len(_field(reader, "tokenizer.ggml.tokens") or [])
    context_length = int(required("context_length"))

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0))}
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type in ("linear", "yarn"):
        rope["rope_type"] = scaling_type
        rope["factor"] = float(required("rope.scaling.factor"))
        if scaling_type == "yarn":
            rope["original_max_position_embeddings"] = int(required("rope.scaling.original_context_length"))
    elif scaling_type != "none":
        raise UnsupportedModelError(f"{source}: {arch}.rope.scaling.type {scaling_type!r} is not supported "
                                    "(supported: none, linear, yarn)")
    rope_freq_factors = None
    if "rope_freqs.weight" in tensor_names:
        if scaling_type != "none":
            raise UnsupportedModelError(f"{source}: tensor 'rope_freqs.weight' together with {arch}.rope.scaling.type "
                                        f"{scaling_type!r} is not supported")
        rope_freq_factors = _rope_freq_factors(reader, rope_dim)

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
    if arch == "qwen2moe":
        kwargs["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch == "deepseek2":
        config_cls = deepseek2_config_class(lambda key: _field(reader, f"{arch}.{key}"), source, kwargs, tensor_names)
    elif int(_field(reader, f"{arch}.expert_count", 0) or 0) > 0:
        if arch == "llama":
            config_cls, kwargs["architectures"] = transformers.MixtralConfig, ["MixtralForCausalLM"]
            kwargs.pop("attention_bias")
            kwargs["sliding_window"] = None
        elif arch not in _MOE_NORM_TOPK:
            raise UnsupportedModelError(f"{source}: {arch}.expert_count is set, but tokenmill runs experts only for "
                                        f"{', '.join(sorted(_MOE_NORM_TOPK))}")
        _moe_fields(reader, arch, kwargs, tensor_names)
    elif arch in ("qwen2moe", "qwen3moe", "olmoe"):
        raise UnsupportedModelError(f"{source}: metadata key {arch}.expert_count is missing")
    if rope_freq_factors is not None:
        kwargs["rope_freq_factors"] = rope_freq_factors
    if arch == "phi3":
        _phi3_fields(reader, kwargs, tensor_names)
    elif arch in ("gemma2", "gemma3"):
        _gemma_fields(reader, arch, kwargs)
    return config_cls(**kwargs)


def _moe_fields(reader: GGUFReader | GGUFMetadata, arch: str, kwargs: dict[str, Any], tensor_names: set[str]) -> None:
    """The MoE config fields from ``{arch}.expert_count``, ``expert_used_count``, ``expert_feed_forward_length``
    (else ``feed_forward_length``), ``expert_shared_feed_forward_length`` and ``expert_weights_norm`` (else
    llama.cpp's rule for the architecture, ``_MOE_NORM_TOPK``). Layers without a ``ffn_gate_inp`` tensor keep a
    dense MLP (Qwen's ``mlp_only_layers``).

    Raises:
        UnsupportedModelError: ``expert_used_count`` missing, or a gating function other than softmax.
    """
    source = _source(reader)
    num_experts = int(_field(reader, f"{arch}.expert_count"))
    top_k = _field(reader, f"{arch}.expert_used_count")
    if top_k is None:
        raise UnsupportedModelError(f"{source}: metadata key {arch}.expert_used_count is missing")
    gating = _field(reader, f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # gguf.ExpertGatingFuncType.SOFTMAX
        raise UnsupportedModelError(f"{source}: {arch}.expert_gating_func {gating} is not supported (softmax only)")
    expert_ff = int(_field(reader, f"{arch}.expert_feed_forward_length", kwargs["intermediate_size"]))
    norm = _field(reader, f"{arch}.expert_weights_norm")
    norm_topk_prob = _MOE_NORM_TOPK[arch] if norm is None else bool(norm)
    if arch == "llama":
        kwargs.update(num_local_experts=num_experts, num_experts_per_tok=int(top_k), intermediate_size=expert_ff)
        if not norm_topk_prob:
            raise UnsupportedModelError(f"{source}: llama.expert_weights_norm false is not supported for Mixtral")
        return
    kwargs.update(num_experts=num_experts, num_experts_per_tok=int(top_k), norm_topk_prob=norm_topk_prob)
    if arch == "olmoe":
        kwargs["intermediate_size"] = expert_ff
        return
    kwargs["moe_intermediate_size"] = expert_ff
    kwargs["mlp_only_layers"] = [i for i in range(kwargs["num_hidden_layers"])
                                 if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    kwargs["decoder_sparse_step"] = 1
    if arch == "qwen2moe":
        kwargs["shared_expert_intermediate_size"] = int(_field(reader, f"{arch}.expert_shared_feed_forward_length", 0))


def _phi3_fields(reader: GGUFReader | GGUFMetadata, kwargs: dict[str, Any], tensor_names: set[str]) -> None:
    """Phi-3's extra config fields: ``original_max_position_embeddings`` and ``sliding_window`` (0: none).

    longrope RoPE (Phi-3 128k, Phi-3.5) is stored as llama.cpp's converter writes it: ``rope_factors_long`` and
    ``rope_factors_short`` tensors ([rope_dim / 2] each) and ``phi3.rope.scaling.attn_factor`` (the cos/sin
    scaling; absent: transformers' default from the context lengths). It becomes transformers' longrope
    ``rope_parameters`` (``long_factor``, ``short_factor``, ``original_max_position_embeddings``,
    ``attention_factor``).

    Raises:
        UnsupportedModelError: one of the two factor tensors without the other, or bad factors.
    """
    source = _source(reader)
    original = int(_field(reader, "phi3.rope.scaling.original_context_length", kwargs["max_position_embeddings"]))
    kwargs["original_max_position_embeddings"] = original
    present = [name for name in ("rope_factors_long.weight", "rope_factors_short.weight") if name in tensor_names]
    if len(present) == 1:
        raise UnsupportedModelError(f"{source}: tensor {present[0]!r} without its longrope partner "
                                    "(rope_factors_long and rope_factors_short come together)")
    if present:
        rope = kwargs["rope_parameters"]
        if rope["rope_type"] != "default":
            raise UnsupportedModelError(f"{source}: longrope factor tensors together with phi3.rope.scaling.type "
                                        f"{rope['rope_type']!r} are not supported")
        rope_dim = kwargs["head_dim"]
        rope.update(rope_type="longrope", original_max_position_embeddings=original,
                    long_factor=_rope_freq_factors(reader, rope_dim, "rope_factors_long.weight"),
                    short_factor=_rope_freq_factors(reader, rope_dim, "rope_factors_short.weight"))
        attn_factor = _field(reader, "phi3.rope.scaling.attn_factor")
        if attn_factor is not None:
            rope["attention_factor"] = float(attn_factor)
    window = int(_field(reader, "phi3.attention.sliding_window", 0) or 0)
    kwargs["sliding_window"] = window or None


def _gemma_fields(reader: GGUFReader | GGUFMetadata, arch: str, kwargs: dict[str, Any]) -> None:
    """Gemma 2 / Gemma 3's extra config fields, read as llama.cpp reads them.

    Soft-capping from ``{arch}.attn_logit_softcapping`` / ``{arch}.final_logit_softcapping``; the window from
    ``{arch}.attention.sliding_window`` (absent: every layer global). Sliding layers: gemma2 alternates
    (layer 0 sliding), gemma3 follows ``{arch}.attention.sliding_window_pattern`` (an int n: every n-th layer
    global; or one bool per layer), default 6 as in llama.cpp. The GGUF has no query_pre_attn_scalar: like
    llama.cpp, the 27B models (46 / 62 layers) scale by hidden_size / num_heads, the others by head_dim. Gemma 3's
    local layers use ``{arch}.rope.freq_base_swa`` (default 10000, as llama.cpp) and no RoPE scaling.
    """
    layers, heads = kwargs["num_hidden_layers"], kwargs["num_attention_heads"]
    kwargs["attn_logit_softcapping"] = _field(reader, f"{arch}.attn_logit_softcapping")
    kwargs["final_logit_softcapping"] = _field(reader, f"{arch}.final_logit_softcapping")
    is_27b = layers == (46 if arch == "gemma2" else 62)
    kwargs["query_pre_attn_scalar"] = kwargs["hidden_size"] // heads if is_27b else kwargs["head_dim"]
    kwargs["hidden_activation"] = "gelu_pytorch_tanh"
    window = _field(reader, f"{arch}.attention.sliding_window")
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if not window:
        kwargs["sliding_window"] = None
        sliding = [False] * layers
    elif isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
    if window:
        kwargs["sliding_window"] = int(window)
    kwargs["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    if arch == "gemma3":
        global_rope = kwargs["rope_parameters"]
        local_theta = float(_field(reader, f"{arch}.rope.freq_base_swa", 10000.0))
        kwargs["rope_parameters"] = {"full_attention": global_rope,
                                     "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (``arch``: the GGUF architecture,
    for the names it uses differently); ValueError when unknown."""
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match:
        layer, part, kind = match.groups()
        names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
        if part in _ARCH_PARAMETERS.get(arch, {}):
            return f"model.layers.{layer}.{_ARCH_PARAMETERS[arch][part]}"
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
        if part in _EXPERT_STACKS and kind == "weight":  # one name per expert: _expert_names
            return f"model.layers.{layer}.mlp.experts.{{expert}}.{_EXPERT_STACKS[part][0]}.{kind}"
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
_FUSED_GROUPS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("ffn_gate_exps", "ffn_up_exps"),
                 ("ffn_gate_shexp", "ffn_up_shexp"))


def _expert_stack(gguf_name: str) -> tuple[str, tuple[str, ...]] | None:
    """(layer, projections) for a stacked expert tensor (``blk.3.ffn_up_exps.weight``), else None."""
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match[2] not in _EXPERT_STACKS or match[3] != "weight":
        return None
    return match[1], _EXPERT_STACKS[match[2]]


def _is_matrix(info: GGUFTensorInfo) -> bool:
    """A 2-D weight, or a stack of expert matrices (3-D, split per expert at load)."""
    return len(info.shape) == 2 or (len(info.shape) == 3 and _expert_stack(info.name) is not None)


def _per_expert(info: GGUFTensorInfo, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, expert's rows) for each expert of a stack: ``tensor`` [E, N, ...] (floats or block bytes);
    ``ffn_gate_up_exps`` rows split into their gate and up halves. Views, no copy."""
    layer, projections = _expert_stack(info.name)
    rows = tensor.shape[1] // len(projections)
    for expert in range(tensor.shape[0]):
        for i, proj in enumerate(projections):
            yield f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight", tensor[expert, i * rows:(i + 1) * rows]


@functools.cache
def _dequantizable(qtype: int) -> bool:
    """Whether ``gguf.quants.dequantize`` turns this type into floats (probed on one zero block)."""
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    try:
        dequantize(np.zeros(type_size, dtype=np.uint8), GGMLQuantizationType(qtype))
    except NotImplementedError:
        return False
    return qtype not in (GGMLQuantizationType.F64, GGMLQuantizationType.I8, GGMLQuantizationType.I16,
                         GGMLQuantizationType.I32, GGMLQuantizationType.I64)


def read_tensor_index(reader: GGUFReader | GGUFMetadata) -> list[GGUFTensorInfo]:
    """Every weight tensor of the file with where its bytes are (``rope_freqs.weight`` left out: it goes
    into the config), checked to be one the engine can run: a name tokenmill maps and a type it runs
    natively (``tokenmill.quantization.formats.GGUF_QUANT_TYPES``, 2-D) or can dequantize.

    Raises:
        UnsupportedModelError: a tensor named, with what about it tokenmill cannot run.
    """
    from tokenmill.quantization.formats import GGUF_QUANT_TYPES

    source, arch = _source(reader), gguf_architecture(reader)
    index = []
    for t in _tensor_infos(reader):
        if t.name in _NOT_WEIGHTS:
            continue
        try:
            _hf_name(t.name, arch)
        except ValueError:
            raise UnsupportedModelError(f"{source}: tensor {t.name!r} is not part of a {arch} model tokenmill "
                                        "runs") from None
        native = t.qtype in GGUF_QUANT_TYPES and _is_matrix(t)
        if not native and not _dequantizable(t.qtype):
            raise UnsupportedModelError(f"{source}: tensor {t.name!r} has type {GGMLQuantizationType(t.qtype).name}, "
                                        "which tokenmill cannot run or dequantize")
        index.append(t)
    return index


def kept_quantized_names(index: list[GGUFTensorInfo]) -> set[str]:
    """Names of the matrices whose blocks tokenmill runs as stored (a fused group only when all its members can)."""
    from tokenmill.quantization.formats import GGUF_QUANT_TYPES

    names = {t.name for t in index if t.qtype in GGUF_QUANT_TYPES and _is_matrix(t) and t.name.endswith(".weight")}
    present = {t.name for t in index}
    for name in list(names):
        match = _BLOCK_RE.fullmatch(name)
        if match is None:
            continue
        layer, part, _ = match.groups()
        if part in DEEPSEEK2_DENSE_ONLY:  # kv_b_proj: a dense LatentProjection, no block kernels
            names.discard(name)
            continue
        group = next((g for g in _FUSED_GROUPS if part in g), None)
        # a member the file does not have (phi3's ffn_up is already gate | up, with no ffn_gate) does not count
        if group and not all(f"blk.{layer}.{p}.weight" in names for p in group
                             if f"blk.{layer}.{p}.weight" in present):
            names.discard(name)
    return names


def needs_dequantization(index: list[GGUFTensorInfo]) -> bool:
    """Whether the tensors not kept quantized include block formats (slow to dequantize in numpy, worth a
    cache) rather than only F32/F16/BF16 ones (norms, read in place)."""
    kept = kept_quantized_names(index)
    floats = {int(GGMLQuantizationType.F32), int(GGMLQuantizationType.F16), int(GGMLQuantizationType.BF16)}
    return any(t.qtype not in floats for t in index if t.name not in kept)


def _map(path: Path, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor's bytes (uint8 [nbytes]) as their own copy-on-write memory map: writable for numpy and
    torch (so no read-only warnings) yet never written back to the file; unmapped with the last reference."""
    return np.memmap(path, dtype=np.uint8, mode="c", offset=info.offset, shape=(info.nbytes,))


def _permuted_heads(hf_name: str, config: PretrainedConfig, permute: bool) -> int | None:
    """The head count whose Q/K rows llama.cpp interleaved for this tensor, or None."""
    if permute and ".self_attn.q_proj." in hf_name:
        return int(config.num_attention_heads)
    if permute and ".self_attn.k_proj." in hf_name:
        return int(config.num_key_value_heads)
    return None


def iter_mapped_weights(path: Path, index: list[GGUFTensorInfo], config: PretrainedConfig,
                        quantized: bool = True, dense: bool = True,
                        kept: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) straight from the file's memory map (no metadata parse: ``index`` says where).

    ``kept``: the tensors to keep in their block format (default ``kept_quantized_names(index)``; an empty
    set dequantizes everything). ``quantized``: yield those as ``QuantizedTensor``s whose ``data``
    [N, row bytes] is a view of their own mapping (no copy; Q/K of a llama file are unpermuted, a copy),
    kept alive by the tensor and released with it. ``dense``: yield the other tensors as float32 (F32 ones
    are views of their mapping, the rest dequantized copies), in PyTorch order. ``config``: for Q/K head counts.
    """
    from tokenmill.quantization.formats import QuantizedTensor

    # the GGUF llama architecture becomes a LlamaConfig (Mistral included) or, with experts, a MixtralConfig
    permute = config.model_type in ("llama", "mixtral")
    arch = _GGUF_ARCH_OF_MODEL_TYPE.get(config.model_type, "llama")  # for the names some architectures use
    norm_offset = arch in ("gemma2", "gemma3")  # llama.cpp stored 1 + weight
    keep = kept_quantized_names(index) if kept is None else kept
    latent_halves = LatentHalves()  # deepseek2's attn_k_b + attn_v_b -> kv_b_proj
    for info in index:
        name = _hf_name(info.name, arch)
        heads = _permuted_heads(name, config, permute)
        if info.name in keep:
            if not quantized:
                continue
            n, k = info.shape[-2:]
            if len(info.shape) == 3:  # (E, N, row bytes): each expert's rows, in place
                stack = torch.from_numpy(_map(path, info).reshape(info.shape[0], n, -1))
                for expert_name, data in _per_expert(info, stack):
                    yield expert_name, QuantizedTensor(info.qtype, (data.shape[0], k), data)
                continue
            data = torch.from_numpy(_map(path, info).reshape(n, -1))  # (N, row bytes), in place
            if heads is not None:
                data = _unpermute_rows(data, heads).contiguous()
            yield name, QuantizedTensor(info.qtype, (n, k), data)
            continue
        if not dense:
            continue
        qtype = GGMLQuantizationType(info.qtype)
        raw = _map(path, info)
        if qtype == GGMLQuantizationType.F32:
            array = raw.view(np.float32)
        else:
            block, type_size = GGML_QUANT_SIZES[qtype]
            array = dequantize(raw.reshape(-1, info.shape[-1] // block * type_size), qtype)
        weight = torch.from_numpy(array).reshape(info.shape)
        part = info.name.split(".")[2] if info.name.startswith("blk.") else ""
        if LatentHalves.holds(part):  # (H, r, qk_nope) or (H, v, r): yielded joined, once both are in
            joined = latent_halves.add(name, part, weight)
            if joined is not None:
                yield name, joined
            continue
        if len(info.shape) == 3:  # (E, N, K) expert stack
            yield from _per_expert(info, weight)
            continue
        if name.endswith("shared_expert_gate.weight"):
            weight = weight.reshape(1, -1)  # llama.cpp keeps the gate's one row as a vector [hidden]
        if heads is not None:
            weight = _unpermute_rows(weight, heads)
        if norm_offset and name.endswith("norm.weight"):
            weight = weight - 1.0  # exact for stored values in [0.5, 2]: 1 + (stored - 1) gives back stored
        yield name, weight
    latent_halves.check_complete(path)


def iter_gguf_weights(reader: GGUFReader | GGUFMetadata, config: PretrainedConfig,
                      quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every weight in the file: a float tensor, dequantized, or with
    ``quantized`` a ``tokenmill.quantization.QuantizedTensor`` for the matrices in a supported block
    format (the file's bytes, mapped in place, rows permuted as the dense tensor's would be; see
    ``iter_mapped_weights``).

    Shapes come out in PyTorch order ([out_features, in_features] for matrices).

    Raises:
        UnsupportedModelError: a tensor tokenmill cannot run (``read_tensor_index``).
    """
    index = read_tensor_index(reader)
    yield from iter_mapped_weights(_source(reader), index, config, kept=None if quantized else set())


def _admit_tokenizer_architectures() -> None:
    """Let transformers' GGUF reader read the tokenizer of a file whose architecture it has no config mapping for
    (olmoe): it refuses such files before reading any key, though its tokenizer fields (``tokenizer.ggml.*``) do
    not depend on the architecture. Adds tokenmill's architectures to its list of supported ones, and to its
    fast config readers (``GGUF_CONFIG_ARCHS``, see ``_tokenizer_config``) (idempotent)."""
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    supported = hf_gguf.GGUF_SUPPORTED_ARCHITECTURES
    for arch in _ARCHITECTURES:
        if arch not in supported and arch.replace("moe", "_moe") not in supported:
            supported.append(arch)


def _tokenizer_config(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """The config ``AutoTokenizer.from_pretrained(gguf_file=...)`` builds to choose the tokenizer class: only its
    ``model_type`` matters there, named as transformers' full GGUF reader names it (the file's architecture;
    "mistral" for a llama file whose ``general.name`` is "mistral"; qwen2moe / qwen3moe as qwen2_moe / qwen3_moe,
    gemma3 / gemma4 as their text models)."""
    arch = metadata["general.architecture"]
    if "llama" in arch and metadata.get("general.name") == "mistral":
        return {"model_type": "mistral"}
    return {"model_type": {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text",
                           "gemma4": "gemma4_text"}.get(arch, arch)}


_FAST_CONFIG_LOCK = threading.Lock()


@contextlib.contextmanager
def _fast_tokenizer_config(arch: str) -> Iterator[None]:
    """While the block runs, ``_tokenizer_config`` is transformers' fast GGUF config reader for ``arch``
    (``GGUF_CONFIG_ARCHS``), unless it has its own: else ``AutoTokenizer`` parses every metadata field with gguf's
    GGUFReader just to pick the tokenizer class (7 of the 10 s a Llama-3 tokenizer took to build; 0.7 s
    without). Taken out again afterwards: transformers' own GGUF model loading reads the full config through it."""
    from transformers.integrations.gguf import gguf_config_mapping

    archs = gguf_config_mapping.GGUF_CONFIG_ARCHS
    with _FAST_CONFIG_LOCK:
        added = arch not in archs
        if added:
            archs[arch] = _tokenizer_config
        try:
            yield
        finally:
            if added:
                archs.pop(arch, None)


_TOKENIZER_WITHOUT_MODEL_TYPE = frozenset({"deepseek2"})


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """The tokenizer (with chat template) that transformers reconstructs from the GGUF metadata, splitting text
    as llama.cpp does for the file's ``tokenizer.ggml.pre`` (``gguf_tokenizer.apply_llama_cpp_split``), so the
    ids are the ones llama.cpp would feed the model.

    Raises:
        UnsupportedModelError: transformers cannot build it (no ``tokenizer.ggml.*`` metadata, or a
            ``tokenizer.ggml.model`` it does not convert); the message names the file and the key.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    _admit_tokenizer_architectures()
    try:
        # transformers has no model type for some llama.cpp architectures (deepseek2): the fast class reads the
        # tokenizer.ggml.* fields without one
        arch = _field(read_gguf_metadata(path), "general.architecture")
        no_model_type = arch in _TOKENIZER_WITHOUT_MODEL_TYPE
        with _fast_tokenizer_config(arch):
            tokenizer = (PreTrainedTokenizerFast if no_model_type else AutoTokenizer).from_pretrained(
                str(path.parent), gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 - transformers raises KeyError/ValueError/... for what it cannot convert
        try:
            model = _field(read_gguf_metadata(path), "tokenizer.ggml.model")
        except ValueError:
            model = None
        what = "no tokenizer.ggml.model" if model is None else f"tokenizer.ggml.model {model!r}"
        raise UnsupportedModelError(f"{path}: the tokenizer ({what}) cannot be built: {type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    metadata = read_gguf_metadata(path)
    apply_llama_cpp_split(tokenizer, _field(metadata, "tokenizer.ggml.model"), _field(metadata, "tokenizer.ggml.pre"))
    return tokenizer
