"""DeepSeek-V2 / V3: multi-head latent attention (MLA) over a paged latent cache, with DeepSeek's MoE layers.

MLA (DeepSeek-V2 paper, arXiv:2405.04434, section 2.1): per token the layer projects the hidden state to a latent
``c_kv`` (``kv_lora_rank`` wide, RMS-normalized by ``kv_a_layernorm``) and one shared RoPE key ``k_pe``
(``qk_rope_head_dim``), both from ``kv_a_proj_with_mqa``; ``kv_b_proj`` would expand ``c_kv`` into every head's
``k_nope`` (``qk_nope_head_dim``) and value (``v_head_dim``). The KV cache holds only ``[c_kv | roped k_pe]``
per token and layer (one plane of ``kv_lora_rank + qk_rope_head_dim``; runner/kv_pool.py). Attention runs
absorbed: each head's ``q_nope`` is multiplied by its slice W_UK of ``kv_b_proj`` into the latent space and
joined with its roped ``q_pe``, so the scores are the dot products with the cached vectors (MQA: one KV head for
every query head); the weighted sum of the cached vectors, first ``kv_lora_rank`` values, times each head's W_UV
gives the head's value output, then ``o_proj``. The paged attention paths (C decode / prefill kernels, the torch
reference, deterministic per-token) serve it unchanged, the latent read as both key and value (``Attention``
with ``latent_cache``). Mathematically equal to transformers' expanded attention; the products run in another
order (float32 rounding).

RoPE on the rope parts only, with the config's ``rope_parameters`` (DeepSeek's YaRN included: the cos/sin carry
YaRN's attention factor, and the softmax scale (``qk_nope + qk_rope``)^-0.5 is multiplied by mscale(factor,
``mscale_all_dim``)², as transformers does). The rope dims are pairs (x0, x1), (x2, x3) ... (DeepSeek-V2's complex
rotation; DeepSeek-V3 with ``rope_interleave``, its default), here taken apart into evens | odds and rotated
rotate-half style, which gives the same dot products as transformers; V3 with ``rope_interleave`` false rotates
halves directly.

MoE layers (tokenmill/moe): V2 softmax routing, plain (``topk_method`` greedy) or ``group_limited_greedy`` groups
scored by their best expert, times ``routed_scaling_factor`` (not renormalized: transformers' DeepseekV2 router
ignores ``norm_topk_prob``); V3 sigmoid scores with ``e_score_correction_bias``, groups by their two best,
renormalized when ``norm_topk_prob``, times ``routed_scaling_factor``. ``n_shared_experts`` experts of
``moe_intermediate_size`` as one ungated shared expert. Layers below ``first_k_dense_replace`` (and those off
``moe_layer_freq``) keep a dense MLP of ``intermediate_size``. Checkpoint ``mlp.shared_experts`` loads into
``mlp.shared_expert``. CPU only (the CUDA runner refuses latent attention); no int8/fp8 KV cache.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import math
from collections.abc import Callable

import torch
from torch import nn

from tokenmill.attention import Attention, AttentionMetadata
from tokenmill.attention.layer import KVCache
from tokenmill.layers import Linear, RMSNorm, apply_rotary_emb
from tokenmill.layers import batch_invariant
from tokenmill.layers.gemm_shapes import bounded_bmm
from tokenmill.layers.rotary_embedding import rope_parameters
from tokenmill.models.errors import UnsupportedModelError
from tokenmill.models.llama import DecoderVariant
from tokenmill.models.sparse_moe import MoECausalLM, check_silu
from tokenmill.moe import MoEConfig, RouterConfig, sparse_layer_mask

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# transformers' DeepseekV2/V3 RMSNorm default: q_a_layernorm and kv_a_layernorm do not take the config's eps
_LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude correction: 0.1 · mscale · ln(factor) + 1, or 1 for factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config: PretrainedConfig) -> float:
    """(qk_nope_head_dim + qk_rope_head_dim)^-0.5, times mscale(factor, ``mscale_all_dim``)² under a RoPE scaling
    that sets ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = (int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)) ** -0.5
    params = rope_parameters(config)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2
    return scale


class LatentProjection(nn.Module):
    """``kv_b_proj`` kept dense and used only absorbed: weight [heads * (qk_nope + v), kv_lora_rank], per head
    W_UK (its first qk_nope rows) then W_UV (its v rows), as the checkpoint stores it.

    Not a ``Linear`` on purpose: it is never applied to the latent (which would expand the cache), so int8
    quantization and LoRA, which act on ``Linear``s, leave it alone. Two ways to run the per-head products:
    - the batch-invariant C GEMM over all heads in one call (``bi_linear_heads``: each head's result has the bits
      of ``bi_linear`` on it alone), in deterministic mode and at the row counts where ``cpu_heads_table`` (set
      from the measured kernel plan, ``runner/cpu_kernels.py``; indexed by ``min(rows, len - 1)``) says so. The
      lean decode step always calls it, so the torch path gives the lean step's bits where the table picks it.
      ``expand_values`` reads W_UV in place, ``absorb_query`` a contiguous copy of W_UK^T [H, r, qk_nope];
    - torch's bmm elsewhere (many rows, where AMX tiles win; no plan; other devices), on contiguous copies of
      W_UK [H, qk_nope, r] and W_UV^T [H, r, v] (the strided views cost a copy inside every bmm).
    The copies (``_derived``) are made on first use and again when the weight is replaced or written in place (a
    weight update: its storage or ``_version`` changes); each holds as many bytes as its half of the weight.
    At batch 1 on DeepSeek-V2-Lite's shape the C kernel takes 0.10 ms a layer for both products, torch's bf16
    bmm 0.19 ms (2 threads); at 32 rows 0.9 against 0.3 ms.
    """

    cpu_heads_table: tuple[bool, ...] = ()

    def __init__(self, kv_lora_rank: int, num_heads: int, qk_nope_head_dim: int, v_head_dim: int) -> None:
        super().__init__()
        self.in_features, self.num_heads = kv_lora_rank, num_heads
        self.qk_nope_head_dim, self.v_head_dim = qk_nope_head_dim, v_head_dim
        self.out_features = num_heads * (qk_nope_head_dim + v_head_dim)
        self.weight = nn.Parameter(torch.empty(self.out_features, kv_lora_rank), requires_grad=False)
        self._derived_cache: dict[str, tuple[tuple, torch.Tensor]] = {}

    def _heads(self) -> torch.Tensor:
        return self.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.in_features)

    def uv_heads(self) -> torch.Tensor:
        """W_UV [H, v, r]: a view of the weight (each head a contiguous slab, head stride (qk_nope + v) * r)."""
        return self._heads()[:, self.qk_nope_head_dim :]

    def _derived(self, name: str) -> torch.Tensor:
        """A contiguous per-head copy of the weight: "uk_t" W_UK^T [H, r, nope], "uk" W_UK [H, nope, r], "uv_t"
        W_UV^T [H, r, v]; made again when the weight's storage or version changes."""
        key = (self.weight.data_ptr(), self.weight._version, self.weight.device, self.weight.dtype)
        cached = self._derived_cache.get(name)
        if cached is None or cached[0] != key:
            heads = self._heads().detach()
            uk, uv = heads[:, : self.qk_nope_head_dim], heads[:, self.qk_nope_head_dim :]
            tensor = {"uk_t": lambda: uk.transpose(1, 2), "uk": lambda: uk, "uv_t": lambda: uv.transpose(1, 2)}[name]()
            cached = self._derived_cache[name] = (key, tensor.contiguous())
        return cached[1]

    def uk_t(self) -> torch.Tensor:
        """W_UK^T [H, r, qk_nope], contiguous (what ``bi_linear_heads`` reads; the lean step points at it)."""
        return self._derived("uk_t")

    def drop_derived_weights(self) -> None:
        """Free the copies (RL sleep frees the weights; they are made again on the next use)."""
        self._derived_cache = {}

    def _c_kernel(self, x: torch.Tensor, invariant: bool) -> bool:
        """Whether the C kernel runs ``x`` [T, H, *]: deterministic mode (then required), or the plan's choice
        at T rows."""
        if invariant:
            if not batch_invariant.available():
                raise RuntimeError("deterministic mode needs the batch-invariant C kernels")
            return True
        table = self.cpu_heads_table
        return (bool(table) and table[min(x.shape[0], len(table) - 1)] and x.device.type == "cpu"
                and x.dtype in (torch.float32, torch.bfloat16) and self.weight.dtype == x.dtype
                and batch_invariant.available())

    def absorb_query(self, q_nope: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """q_nope [T, H, qk_nope] -> [T, H, kv_lora_rank]: each head's q_nope · W_UK (so q_nope · k_nope =
        result · c_kv). ``invariant``: deterministic mode (the C kernel)."""
        x = q_nope.transpose(0, 1)  # (H, T, nope)
        if self._c_kernel(q_nope, invariant):
            return batch_invariant.bi_linear_heads(x, self.uk_t()).transpose(0, 1)  # (H, T, r) -> (T, H, r)
        return bounded_bmm(x, self._derived("uk")).transpose(0, 1)

    def expand_values(self, out_latent: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """Attention output in latent space [T, H, kv_lora_rank] -> [T, H, v_head_dim] (times each head's W_UV)."""
        x = out_latent.transpose(0, 1)  # (H, T, r)
        if self._c_kernel(out_latent, invariant):
            return batch_invariant.bi_linear_heads(x, self.uv_heads()).transpose(0, 1)  # (T, H, v)
        return bounded_bmm(x, self._derived("uv_t")).transpose(0, 1)


class LatentAttention(nn.Module):
    """Multi-head latent attention: forward(hidden [T, hidden], cos/sin [T, 1, rope/2], kv_cache (the layer's
    latent plane, twice), metadata) -> [T, hidden]. Module names follow the checkpoint (module docstring).

    ``rope_interleave``: the rope dims are (x0, x1) pairs (V2; V3's default) rather than two halves.
    """

    def __init__(self, config: PretrainedConfig, rope_interleave: bool) -> None:
        super().__init__()
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        self.num_heads = heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        self.v_head_dim, self.kv_lora_rank = int(config.v_head_dim), int(config.kv_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise UnsupportedModelError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even")
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.rope_interleave = rope_interleave
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank is None:  # V2-Lite: q straight from the hidden state
            self.q_proj = Linear(hidden, heads * self.qk_head_dim)
        else:
            self.q_a_proj = Linear(hidden, int(self.q_lora_rank), bias=bias)
            self.q_a_layernorm = RMSNorm(int(self.q_lora_rank), eps=_LATENT_NORM_EPS)
            self.q_b_proj = Linear(int(self.q_lora_rank), heads * self.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=_LATENT_NORM_EPS)
        self.kv_b_proj = LatentProjection(self.kv_lora_rank, heads, self.qk_nope_head_dim, self.v_head_dim)
        self.o_proj = Linear(heads * self.v_head_dim, hidden, bias=bias)
        self.latent_dim = self.kv_lora_rank + self.qk_rope_head_dim
        self.attn = Attention(heads, 1, self.latent_dim, scale=softmax_scale(config), latent_cache=True)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, n, rope] -> roped [T, n, rope]; interleaved pairs come out as evens | odds (dot products kept)."""
        if self.rope_interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)  # (T, n, rope), contiguous
        return apply_rotary_emb(x.contiguous(), cos, sin, self.qk_rope_head_dim)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        invariant = self.o_proj.batch_invariant  # deterministic mode (set on every Linear)
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)  # (T, H * qk_head_dim)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)  # (T, H, nope), (T, H, rope)
        latent = self.kv_a_proj_with_mqa(hidden_states)  # (T, r + rope)
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())  # (T, r)
        k_pe = self._rope(k_pe.view(num_tokens, 1, self.qk_rope_head_dim), cos, sin)  # (T, 1, rope)
        q_pe = self._rope(q_pe, cos, sin)  # (T, H, rope)
        query = torch.cat((self.kv_b_proj.absorb_query(q_nope, invariant), q_pe), dim=-1)  # (T, H, r + rope)
        cached = torch.cat((c_kv.unsqueeze(1), k_pe), dim=-1)  # (T, 1, r + rope): what the cache keeps
        out = self.attn(query.reshape(num_tokens, -1), cached.reshape(num_tokens, -1), cached.reshape(num_tokens, -1),
                        kv_cache, attn_metadata)  # (T, H * (r + rope))
        out = out.view(num_tokens, self.num_heads, self.latent_dim)[..., : self.kv_lora_rank]  # (T, H, r)
        values = self.kv_b_proj.expand_values(out, invariant)  # (T, H, v)
        return self.o_proj(values.reshape(num_tokens, self.num_heads * self.v_head_dim))  # (T, hidden)


def _num_experts(config: PretrainedConfig) -> int:
    return int(getattr(config, "n_routed_experts", None) or 0)


class DeepseekV2ForCausalLM(MoECausalLM):
    """DeepSeek-V2 / V2-Lite / V2.5 (module docstring): latent attention, ``q_proj`` direct (``q_lora_rank``
    None, V2-Lite) or low rank (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``); softmax routing."""

    checkpoint_renames = ((".mlp.shared_experts.", ".mlp.shared_expert."),)
    # only the MLPs' gate / up fuse: q_proj is the latent attention's own projection
    stacked_projections = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        return DecoderVariant(mlp_bias=bool(getattr(config, "mlp_bias", False)))

    @classmethod
    def rope_interleave(cls, config: PretrainedConfig) -> bool:
        """Whether the rope dims are (x0, x1) pairs: always for V2 (transformers rotates them as complex numbers)."""
        return True

    @classmethod
    def rope_dim(cls, config: PretrainedConfig) -> int | None:
        return int(config.qk_rope_head_dim)

    def attention_factory(self, config: PretrainedConfig) -> Callable[[int], nn.Module]:
        if not getattr(config, "kv_lora_rank", None):
            raise UnsupportedModelError(f"{type(self).__name__} without kv_lora_rank (no latent attention) is not "
                                        "supported")
        interleave = self.rope_interleave(config)
        return lambda layer: LatentAttention(config, interleave)

    @classmethod
    def moe_layers(cls, config: PretrainedConfig) -> tuple[bool, ...]:
        return sparse_layer_mask(config.num_hidden_layers, _num_experts(config),
                                 first_k_dense_replace=int(getattr(config, "first_k_dense_replace", 0) or 0),
                                 moe_layer_freq=int(getattr(config, "moe_layer_freq", 1) or 1))

    @classmethod
    def _groups(cls, config: PretrainedConfig) -> tuple[int, int]:
        return int(getattr(config, "n_group", None) or 1), int(getattr(config, "topk_group", None) or 1)

    @classmethod
    def router_config(cls, config: PretrainedConfig) -> RouterConfig:
        """Softmax, then plain or group-limited greedy top-k, times ``routed_scaling_factor``.

        Raises:
            UnsupportedModelError: a ``topk_method`` other than greedy / group_limited_greedy.
        """
        method = getattr(config, "topk_method", None) or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModelError(f"DeepSeek-V2 topk_method {method!r} is not supported (greedy, "
                                        "group_limited_greedy)")
        groups, topk_groups = cls._groups(config) if method == "group_limited_greedy" else (1, 1)
        return RouterConfig(num_experts=_num_experts(config), top_k=int(config.num_experts_per_tok),
                            num_groups=groups, topk_groups=topk_groups, group_scoring="max",
                            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0))

    @classmethod
    def moe_config(cls, config: PretrainedConfig) -> MoEConfig:
        check_silu(config)
        if not _num_experts(config):  # every layer dense: the router config is never used
            return MoEConfig(RouterConfig(1, 1), int(config.hidden_size), 1)
        shared = int(config.moe_intermediate_size) * int(getattr(config, "n_shared_experts", 0) or 0)
        return MoEConfig(cls.router_config(config), int(config.hidden_size), int(config.moe_intermediate_size),
                         shared_expert_intermediate_size=shared, router_float32=True)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 (and Kimi K2-style configs): V2's latent attention (``rope_interleave``, default True,
    says whether the rope dims are pairs) and sigmoid routing with ``e_score_correction_bias`` (noaux_tc)."""

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        return DecoderVariant()

    @classmethod
    def rope_interleave(cls, config: PretrainedConfig) -> bool:
        value = getattr(config, "rope_interleave", None)
        return True if value is None else bool(value)

    @classmethod
    def router_config(cls, config: PretrainedConfig) -> RouterConfig:
        """Sigmoid scores, choice on score + correction bias within the best groups (sum of their two best),
        weights renormalized when ``norm_topk_prob``, times ``routed_scaling_factor``."""
        groups, topk_groups = cls._groups(config)
        return RouterConfig(num_experts=_num_experts(config), top_k=int(config.num_experts_per_tok),
                            scoring="sigmoid", norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
                            num_groups=groups, topk_groups=topk_groups, group_scoring="top2_sum",
                            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
                            correction_bias=True)
