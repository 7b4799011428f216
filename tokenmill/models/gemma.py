"""Gemma 2 and Gemma 3 (text) decoders on the flat [num_tokens, hidden] layout.

What differs from Llama (``tokenmill.models.llama``, whose fused projections and ``load_weights`` they reuse):
the embedding is scaled by sqrt(hidden_size); every RMSNorm multiplies by ``1 + weight`` in float32
(``GemmaRMSNorm``); each layer norms the attention output (``post_attention_layernorm``) and wraps the MLP in
``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``; the MLP is GELU-tanh gated; attention scales
by ``query_pre_attn_scalar ** -0.5``; the final logits are soft-capped (``cap * tanh(logits / cap)``) when
``final_logit_softcapping`` is set. Gemma 2 also soft-caps attention scores (``attn_logit_softcapping``,
``Attention.logit_softcap``: every CPU path, not CUDA); Gemma 3 adds q/k RMSNorms over head_dim and gives its
sliding-window layers their own RoPE base (``rope_parameters["sliding_attention"]``, rope_local_base_freq).

The ``sliding_attention`` layers of ``config.layer_types`` attend through ``config.sliding_window``
(``Attention.sliding_window``: the query at position p sees keys p - window < j <= p, as transformers' masks),
the ``full_attention`` layers to the whole sequence; any context length is served.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.attention import Attention, AttentionMetadata
from tokenmill.attention.layer import KVCache
from tokenmill.layers import GeluTanhAndMul, GemmaRMSNorm, Linear, MergedLinear, RotaryEmbedding, VocabEmbedding
from tokenmill.layers.rotary_embedding import rope_parameters
from tokenmill.models.llama import DecoderVariant, LlamaAttention, LlamaForCausalLM, head_dim_of
from tokenmill.models.sliding_window import SlidingLayers

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class GemmaAttention(LlamaAttention):
    """LlamaAttention with Gemma's scale (``query_pre_attn_scalar ** -0.5``), optional score soft-capping
    (Gemma 2) and optional Gemma-style q/k norms over head_dim (Gemma 3).

    forward(hidden [T, hidden], cos/sin [T, 1, D/2], kv_cache, metadata) -> [T, hidden].
    """

    def __init__(self, config: PretrainedConfig, qk_norm: bool, sliding_window: int | None = None) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, DecoderVariant(qkv_bias=bias, o_bias=bias, qk_norm=qk_norm), sliding_window)
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        scalar = getattr(config, "query_pre_attn_scalar", None) or self.head_dim
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=float(scalar) ** -0.5,
                              logit_softcap=getattr(config, "attn_logit_softcapping", None),
                              sliding_window=sliding_window)


class GemmaMLP(nn.Module):
    """GELU-tanh gated MLP: forward(x [T, hidden]) -> [T, hidden], gate and up in one GEMM."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_python_tanh"):
            raise NotImplementedError(f"hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
        intermediate = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [intermediate, intermediate])
        self.down_proj = Linear(intermediate, config.hidden_size)
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # (T, 2I) -> (T, I) -> (T, hidden)


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm block: h += post_attn_norm(attn(input_norm(h))); h += post_ffw_norm(mlp(pre_ffw_norm(h))).

    Shapes stay [T, hidden].
    """

    def __init__(self, config: PretrainedConfig, qk_norm: bool, sliding_window: int | None = None) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(config, qk_norm, sliding_window)
        self.mlp = GemmaMLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(hidden_states), cos, sin, kv_cache, attn_metadata)  # (T, hidden)
        hidden_states = hidden_states + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(h)


def _rope_config(config: PretrainedConfig, params: dict, head_dim: int) -> PretrainedConfig:
    """A flat config carrying one layer type's RoPE dict (what ``RotaryEmbedding`` reads)."""
    import transformers

    return transformers.LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                                    head_dim=head_dim, max_position_embeddings=config.max_position_embeddings,
                                    rope_parameters=dict(params))


class GemmaModel(nn.Module):
    """Scaled embedding, Gemma decoder layers, final norm.

    forward(input_ids [T], positions [T], kv_caches (one per layer), metadata) -> [T, hidden].
    Layers of type ``sliding_attention`` read ``rotary_emb_local`` when the config gives that layer type its own
    RoPE dict (Gemma 3), every other layer ``rotary_emb``. ``sliding_windows``: each layer's window (empty: none).
    """

    def __init__(self, config: PretrainedConfig, qk_norm: bool, sliding_windows: tuple[int | None, ...] = ()) -> None:
        super().__init__()
        windows = sliding_windows or (None,) * config.num_hidden_layers
        assert len(windows) == config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, qk_norm, window) for window in windows)
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        head_dim = head_dim_of(config)
        params = rope_parameters(config)
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        if "full_attention" in params or "sliding_attention" in params:  # Gemma 3: one RoPE dict per layer type
            self.rotary_emb = RotaryEmbedding(_rope_config(config, params["full_attention"], head_dim), head_dim)
            self.rotary_emb_local = RotaryEmbedding(_rope_config(config, params["sliding_attention"], head_dim),
                                                    head_dim)
        else:
            self.rotary_emb = RotaryEmbedding(config, head_dim)
            self.rotary_emb_local = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        assert len(kv_caches) == len(self.layers), f"{len(kv_caches)} kv caches for {len(self.layers)} layers"
        hidden_states = self.embed_tokens(input_ids)  # (T, hidden)
        # transformers multiplies by sqrt(hidden) rounded to the activation dtype
        hidden_states = hidden_states * torch.tensor(self.hidden_size**0.5, dtype=hidden_states.dtype)
        rope = {"full_attention": self.rotary_emb(positions, hidden_states.dtype)}  # (T, 1, D/2) cos, sin
        rope["sliding_attention"] = (rope["full_attention"] if self.rotary_emb_local is None
                                     else self.rotary_emb_local(positions, hidden_states.dtype))
        for layer, layer_type, kv_cache in zip(self.layers, self.layer_types, kv_caches):
            cos, sin = rope.get(layer_type, rope["full_attention"])
            hidden_states = layer(hidden_states, cos, sin, kv_cache, attn_metadata)
        return self.norm(hidden_states)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 causal LM (checkpoint names as transformers' ``Gemma2ForCausalLM``; embeddings tied by default).

    forward(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> [N, vocab] float32, soft-capped when ``final_logit_softcapping`` is set.
    """

    qk_norm = False
    sliding_window_layers: SlidingLayers = "layer_types"

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def build_decoder(self, config: PretrainedConfig) -> nn.Module:
        return GemmaModel(config, self.qk_norm, self.sliding_windows(config))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)  # (N, vocab) float32
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text causal LM (``Gemma3ForCausalLM``, config ``Gemma3TextConfig``): Gemma 2 plus
    ``self_attn.q_norm`` / ``self_attn.k_norm`` (Gemma RMSNorm over head_dim, before RoPE), a local RoPE base for
    the sliding-window layers, and (usually) no attention soft-capping.
    """

    qk_norm = True
