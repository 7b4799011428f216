"""Llama-family decoder (Llama, Mistral; Qwen2/Qwen3 reuse it) on the flat [num_tokens, hidden] layout.

Module names follow the Hugging Face checkpoint keys (``model.layers.{i}.self_attn.o_proj`` ...),
except two fused projections: ``qkv_proj`` (q | k | v, one GEMM) and ``gate_up_proj``
(gate | up, one GEMM); ``load_weights`` routes the checkpoint's separate tensors into them.
No padding, no per-token Python; the paged KV cache is written and read by ``Attention``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.attention import Attention, AttentionMetadata
from tokenmill.attention.layer import KVCache
from tokenmill.layers import (
    Linear,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    VocabEmbedding,
    apply_rotary_emb,
)
from tokenmill.models.sliding_window import SlidingLayers, layer_sliding_windows
from tokenmill.quantization.formats import QuantizedTensor

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class DecoderVariant:
    """What distinguishes the Llama-like families.

    qkv_bias/o_bias/mlp_bias: which projections carry a bias; qk_norm: RMSNorm over head_dim on
    q and k before RoPE (Qwen3); qk_norm_whole: instead, one RMSNorm over the whole q projection and one over
    the whole k projection (OLMoE's ``q_norm`` [heads * head_dim], ``k_norm`` [kv_heads * head_dim]).
    """

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_norm_whole: bool = False


def head_dim_of(config: PretrainedConfig) -> int:
    """Explicit ``head_dim`` when the config has one (Qwen3, Mistral), else hidden_size // num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# checkpoint projection name -> (fused module name, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    """forward(hidden [T, hidden], cos/sin [T, 1, D/2], kv_cache, metadata) -> [T, hidden].

    ``use_triton`` (set by the CUDA runner): RoPE in the fused Triton kernel. ``sliding_window``: this layer's
    window (``Attention.sliding_window``; None: full causal attention).
    """

    use_triton = False

    def __init__(self, config: PretrainedConfig, variant: DecoderVariant, sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=variant.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=variant.o_bias)
        self.qk_norm_whole = variant.qk_norm_whole
        if variant.qk_norm_whole:
            self.q_norm = RMSNorm(self.q_size, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, eps=config.rms_norm_eps)
        elif variant.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5,
                              sliding_window=sliding_window)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # (T, (H + 2 * KVH) * D)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # views
        if self.qk_norm_whole:
            q = self.q_norm(q).view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
            k = self.k_norm(k).view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
            q = apply_rotary_emb(q, cos, sin, self.head_dim, self.use_triton)  # (T, H, D)
            k = apply_rotary_emb(k, cos, sin, self.head_dim, self.use_triton)  # (T, KVH, D)
        elif self.q_norm is not None:
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))  # (T, H, D)
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))  # (T, KVH, D)
            q = apply_rotary_emb(q, cos, sin, self.head_dim, self.use_triton)  # (T, H, D)
            k = apply_rotary_emb(k, cos, sin, self.head_dim, self.use_triton)  # (T, KVH, D)
        else:  # rotate q and k in one pass: they are adjacent in the fused projection
            qk = apply_rotary_emb(  # (T, H + KVH, D)
                qkv[:, : self.q_size + self.kv_size], cos, sin, self.head_dim, self.use_triton
            )
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.attn(q.reshape(num_tokens, self.q_size), k.reshape(num_tokens, self.kv_size), v, kv_cache, attn_metadata)
        return self.o_proj(out)  # (T, hidden)


class LlamaMLP(nn.Module):
    """SiLU-gated MLP: forward(x [T, hidden]) -> [T, hidden], gate and up in one GEMM."""

    def __init__(self, config: PretrainedConfig, variant: DecoderVariant) -> None:
        super().__init__()
        intermediate = config.intermediate_size
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act {act!r} is not supported (only 'silu')")
        self.gate_up_proj = MergedLinear(config.hidden_size, [intermediate, intermediate], bias=variant.mlp_bias)
        self.down_proj = Linear(intermediate, config.hidden_size, bias=variant.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # (T, 2I) -> (T, I) -> (T, hidden)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)). Shapes stay [T, hidden].

    ``mlp``: the feed-forward module (default a ``LlamaMLP``; MoE models pass a ``tokenmill.moe.SparseMoeBlock``).
    ``attn``: the attention module (default a ``LlamaAttention``; DeepSeek passes its latent attention), called
    as ``attn(hidden, cos, sin, kv_cache, metadata)``.
    """

    def __init__(self, config: PretrainedConfig, variant: DecoderVariant, sliding_window: int | None = None,
                 mlp: nn.Module | None = None, attn: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = attn if attn is not None else LlamaAttention(config, variant, sliding_window)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, variant)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        residual = hidden_states
        h = self.self_attn(self.input_layernorm(hidden_states), cos, sin, kv_cache, attn_metadata)
        h.add_(residual)  # h is a fresh o_proj output: safe to update in place
        residual = h
        out = self.mlp(self.post_attention_layernorm(h))
        out.add_(residual)
        return out


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm: forward(input_ids [T], positions [T], ...) -> [T, hidden].

    ``lean_decode`` (set by the CPU runner, ``tokenmill.runner.lean_decode``): runs a decode or mixed step's
    layers in one C call, or returns None and the layers below run; None (the default) costs nothing.
    ``sliding_windows``: each layer's window (``models.sliding_window``; empty: none anywhere). ``mlp_factory``:
    layer index -> that layer's feed-forward module, or None for the default ``LlamaMLP`` (MoE models).
    ``attn_factory``: layer index -> that layer's attention module (DeepSeek's latent attention), None for the
    default ``LlamaAttention``. ``rope_dim``: the width RoPE rotates (default the head_dim).
    """

    lean_decode = None

    def __init__(self, config: PretrainedConfig, variant: DecoderVariant,
                 sliding_windows: tuple[int | None, ...] = (),
                 mlp_factory: Callable[[int], nn.Module | None] | None = None,
                 attn_factory: Callable[[int], nn.Module] | None = None, rope_dim: int | None = None) -> None:
        super().__init__()
        windows = sliding_windows or (None,) * config.num_hidden_layers
        assert len(windows) == config.num_hidden_layers
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, variant, window, mlp_factory(i) if mlp_factory is not None else None,
                              attn_factory(i) if attn_factory is not None else None)
            for i, window in enumerate(windows))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, rope_dim or head_dim_of(config))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        assert len(kv_caches) == len(self.layers), f"{len(kv_caches)} kv caches for {len(self.layers)} layers"
        if self.lean_decode is not None:
            out = self.lean_decode(self, input_ids, positions, kv_caches, attn_metadata)
            if out is not None:
                return out
        hidden_states = self.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary_emb(positions, hidden_states.dtype)  # (T, 1, D/2) each, shared by all layers
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states = layer(hidden_states, cos, sin, kv_cache, attn_metadata)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    """Llama causal LM over the flat token batch (see the module docstring for the layout).

    forward(input_ids [T] int64, positions [T] int64, kv_caches (one per layer), attn_metadata)
    -> hidden states [T, hidden]; compute_logits(hidden [N, hidden]) -> [N, vocab] float32.
    Parameters are uninitialised until ``load_weights`` fills them. ``sliding_window_layers`` says which layers
    take ``config.sliding_window``, as transformers' class for the architecture does (Llama: none).
    """

    sliding_window_layers: SlidingLayers = "none"

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_decoder(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # True where the checkpoint itself stores the fused ``qkv_proj`` / ``gate_up_proj`` (Phi-3).
    checkpoint_fuses_projections = False
    # checkpoint projection name -> (fused module name, shard index) that ``load_weights`` routes
    stacked_projections: dict[str, tuple[str, int]] = _STACKED

    def build_decoder(self, config: PretrainedConfig) -> nn.Module:
        """The ``model`` submodule (embedding, layers, final norm); Gemma builds its own."""
        return LlamaModel(config, self.decoder_variant(config), self.sliding_windows(config))

    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full causal attention)."""
        return layer_sliding_windows(config, cls.sliding_window_layers)

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        """Llama reads its bias flags from the config."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderVariant(
            qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(getattr(config, "mlp_bias", False))
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (never rounded to bf16); call it only on the rows that are sampled."""
        return self.lm_head.forward_float32(hidden_states)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the model (casting to each parameter's dtype).

        q/k/v_proj go into ``qkv_proj`` and gate/up_proj into ``gate_up_proj``; ``lm_head.weight``
        is skipped when embeddings are tied; ``rotary_emb.inv_freq`` buffers are ignored.

        Raises:
            ValueError: an unknown tensor name, a shape mismatch, or parameters left unloaded.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = set(self._expected_checkpoint_names())  # before quantized tensors replace parameters
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            module_path, _, param_name = name.rpartition(".")
            parent, _, proj = module_path.rpartition(".")
            if proj in self.stacked_projections:
                fused, shard = self.stacked_projections[proj]
                target = f"{parent}.{fused}"
                if f"{target}.{param_name}" not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
                self.get_submodule(target).load_shard(param_name, shard, tensor)
                loaded.add(name)
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
            if isinstance(tensor, QuantizedTensor):  # kept in its GGUF block format (tokenmill.quantization)
                self.get_submodule(module_path).load_quantized(tensor)
            else:
                param.copy_(tensor)
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
        if self.tie_word_embeddings and self.model.embed_tokens.quant is not None:
            self.lm_head.load_quantized(self.model.embed_tokens.quant)  # the same blocks, not a copy

    def _expected_checkpoint_names(self) -> list[str]:
        """Every checkpoint tensor name load_weights needs (fused params expanded to their sources)."""
        if self.checkpoint_fuses_projections:
            return [name for name, _ in self.named_parameters()]
        inverse: dict[str, list[str]] = {}
        for proj, (fused, _) in self.stacked_projections.items():
            inverse.setdefault(fused, []).append(proj)
        names = []
        for name, _ in self.named_parameters():  # tied lm_head appears once, as embed_tokens
            module_path, _, param_name = name.rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            if leaf in inverse:
                names.extend(f"{parent}.{proj}.{param_name}" for proj in inverse[leaf])
            else:
                names.append(name)
        return names


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama architecture with an explicit head_dim and no biases; ``sliding_window``, when set
    (Mistral 7B v0.1: 4096), applies to every layer.
    """

    sliding_window_layers: SlidingLayers = "all"

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        return DecoderVariant()
