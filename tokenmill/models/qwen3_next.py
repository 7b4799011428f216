"""Hybrid Gated DeltaNet decoders: Qwen3-Next (dense) and the Qwen3.5 text decoder, on the flat layout.

``config.layer_types`` says which layers are Gated DeltaNet (``linear_attn``: short causal conv, the gated
delta rule of tokenmill.linear_attention with its decay and beta, gated RMSNorm, out_proj) and which are
gated full attention (``self_attn``: q_proj also yields a per-channel sigmoid output gate; RMSNorm on q
and k; RoPE on the first ``partial_rotary_factor`` of each head). Norms are zero-centred (x * (1 + w)).
Module names follow the checkpoint keys except the fused ``qkv_proj`` / ``gate_up_proj`` / ``in_proj``.
The full-attention layers use the paged KV cache; the linear layers read and write their state slot
(``AttentionMetadata.linear_state``, see docs/hybrid_models.md) and copy it into the prefix cache's state
checkpoints where the step crosses one. In deterministic mode (``batch_invariant``) the modules of
``BATCH_INVARIANT_MODULES`` compute every token with the fixed-order kernels of
``tokenmill.linear_attention.invariant_ops`` (the delta rule token by token).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import copy
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention import Attention, AttentionMetadata
from tokenmill.attention.layer import KVCache
from tokenmill.layers import Linear, MergedLinear, RotaryEmbedding, VocabEmbedding
from tokenmill.linear_attention import fla_ops, invariant_ops
from tokenmill.linear_attention.gated_delta_rule import chunk_gated_delta_rule, decode_step
from tokenmill.models.llama import DecoderVariant, LlamaMLP

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LINEAR = "linear_attention"
FULL = "full_attention"


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from one: y = x / rms(x) * (1 + w), in float32.

    forward(x [..., dim]) -> same shape and dtype.
    """

    batch_invariant = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.batch_invariant:
            xf = xf * invariant_ops.row_inv_norm(xf, self.eps, mean=True)
        else:
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the delta-rule output, then times silu(z): forward(x [N, D], z [N, D]) -> [N, D]."""

    batch_invariant = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.batch_invariant:
            out = self.weight * (xf * invariant_ops.row_inv_norm(xf, self.eps, mean=True)).to(x.dtype)
            return (out * invariant_ops.sigmoid(z, silu=True)).to(x.dtype)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(x.dtype)
        return (out * F.silu(z.float())).to(x.dtype)


def _l2norm(x: torch.Tensor, batch_invariant: bool, eps: float = 1e-6) -> torch.Tensor:
    if batch_invariant:
        return x * invariant_ops.row_inv_norm(x, eps, mean=False)
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _rope_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate-half RoPE on the first ``rotary_dim`` channels of each head: x [T, H, D]; cos/sin [T, 1, R/2]."""
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class GatedAttention(nn.Module):
    """Full attention with an output gate: forward(hidden [T, hidden], cos/sin [T, 1, R/2], kv_cache, metadata).

    q_proj's rows hold, per head, the query (head_dim) then its gate (head_dim); the attention output is
    multiplied by sigmoid(gate) before o_proj.
    """

    batch_invariant = False

    def __init__(self, config: PretrainedConfig, rotary_dim: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = rotary_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [2 * self.q_size, self.kv_size, self.kv_size], bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q_gate, k, v = self.qkv_proj(hidden_states).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim)  # (T, H, 2D)
        q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]  # (T, H, D) each
        q = _rope_partial(self.q_norm(q), cos, sin, self.rotary_dim)  # (T, H, D)
        k = _rope_partial(self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim)), cos, sin,
                          self.rotary_dim)  # (T, KVH, D)
        out = self.attn(q.reshape(num_tokens, self.q_size), k.reshape(num_tokens, self.kv_size), v.contiguous(),
                        kv_cache, attn_metadata)  # (T, H * D)
        gate = gate.reshape(num_tokens, self.q_size)
        out = out * (invariant_ops.sigmoid(gate).to(out.dtype) if self.batch_invariant else torch.sigmoid(gate))
        return self.o_proj(out)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer: forward(hidden [T, hidden], metadata with linear_state) -> [T, hidden].

    ``in_proj`` yields, in this order, q [Hk*Dk], k [Hk*Dk], v [Hv*Dv] (together the conv channels),
    z [Hv*Dv] (the output gate), b [Hv] (beta = sigmoid(b)) and a [Hv] (decay: g = -exp(A_log) *
    softplus(a + dt_bias)). q/k/v pass through a depthwise causal conv + SiLU whose last kernel-1
    inputs are the conv state; q and k are L2-normalised, q scaled by Dk^-0.5, each key head serving
    Hv / Hk consecutive value heads. ``linear_index`` picks this layer's rows of the state tensors.
    """

    batch_invariant = False

    def __init__(self, config: PretrainedConfig, linear_index: int) -> None:
        super().__init__()
        self.linear_index = linear_index
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads {self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads {self.num_k_heads}")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported for Gated DeltaNet layers (only 'silu')")
        self.in_proj = MergedLinear(config.hidden_size, self.split_sizes(config), bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.conv1d.weight.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, config.hidden_size, bias=False)

    def split_sizes(self, config: PretrainedConfig) -> list[int]:
        """Shards of ``in_proj`` as the checkpoint stores them (Qwen3.5: qkv | z | b | a)."""
        return [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]

    def forward(self, hidden_states: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        meta = attn_metadata.linear_state
        assert meta is not None, "a hybrid model needs AttentionMetadata.linear_state (LinearStateCache)"
        num_tokens = hidden_states.shape[0]
        invariant = self.batch_invariant
        mixed, z, b, a = self.in_proj(hidden_states).split(
            [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        li = self.linear_index
        rec_state = meta.recurrent_state[li]  # (S, Hv, Dk, Dv) float32
        ckpt_rec = meta.checkpoint_recurrent[li] if meta.checkpoint_recurrent is not None else None
        x = self._conv(mixed, meta)  # (T, C)
        q, k, v = x.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.num_v_heads // self.num_k_heads
        q = _l2norm(q.view(num_tokens, self.num_k_heads, self.head_k_dim), invariant) * self.head_k_dim**-0.5
        k = _l2norm(k.view(num_tokens, self.num_k_heads, self.head_k_dim), invariant)  # (T, Hk, Dk)
        v = v.view(num_tokens, self.num_v_heads, self.head_v_dim)  # (T, Hv, Dv)
        if invariant:
            g, beta = invariant_ops.gates(a, b, -self.A_log.float().exp(), self.dt_bias)  # (T, Hv) each
        else:
            beta = torch.sigmoid(b.float())  # (T, Hv)
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # (T, Hv)
        core = torch.empty_like(v)  # (T, Hv, Dv) float32
        if not invariant and fla_ops.wanted(rec_state):  # CUDA: fla-core's kernels (key heads unexpanded)
            self._fla_rule(q, k, v, g, beta, meta, rec_state, ckpt_rec, core)
        else:
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)  # (T, Hv, Dk)
            self._torch_rule(q, k, v, g, beta, meta, rec_state, ckpt_rec, core)
        for r, entries in meta.saves.items():  # one-token requests reaching a checkpoint: the state after it
            if meta.query_start_loc[r + 1] - meta.query_start_loc[r] == 1:
                ckpt_rec[entries[0][1]] = rec_state[meta.slot_ids[r]]
        core = core.to(hidden_states.dtype).view(num_tokens * self.num_v_heads, self.head_v_dim)
        out = self.norm(core, z.reshape(num_tokens * self.num_v_heads, self.head_v_dim))
        return self.out_proj(out.view(num_tokens, self.value_dim))

    def _fla_rule(self, q, k, v, g, beta, meta, rec_state: torch.Tensor, ckpt_rec, core: torch.Tensor) -> None:
        """The delta rule of every request through fla-core (``linear_attention.fla_ops``): one fused recurrent
        call for the one-token requests (graph-safe: fixed shapes, slots read and written on the device), one
        varlen chunked call per round for the multi-token ones. q, k: [T, Hk, Dk]; v, core: [T, Hv, Dv]."""
        if len(meta.decode_reqs):
            tok, slots = meta.decode_token_idx, meta.slot_ids[meta.decode_reqs]
            core[tok] = fla_ops.recurrent_step(q[tok], k[tok], v[tok], g[tok], beta[tok], rec_state, slots)
        if meta.prefill_reqs:
            fla_ops.prefill(q, k, v, g, beta, meta, rec_state, ckpt_rec, core)

    def _torch_rule(self, q, k, v, g, beta, meta, rec_state: torch.Tensor, ckpt_rec, core: torch.Tensor) -> None:
        """The delta rule of every request in torch / the C kernel (CPU; the specification, and CUDA's fallback
        without fla). q, k: [T, Hv, Dk] (expanded); v, core: [T, Hv, Dv]."""
        invariant = self.batch_invariant
        if len(meta.decode_reqs):
            tok, slots = meta.decode_token_idx, meta.slot_ids[meta.decode_reqs]
            if invariant or (rec_state.device.type == "cpu" and invariant_ops.available()):
                # one C call updating the slots in place (both modes; deterministic mode requires it)
                core[tok] = invariant_ops.recurrent_rule(q[tok], k[tok], v[tok], g[tok], beta[tok], rec_state, slots)
            else:  # torch: the specification's batched form, on a gathered copy
                state = rec_state[slots]  # (Bd, Hv, Dk, Dv)
                core[tok] = decode_step(q[tok], k[tok], v[tok], g[tok], beta[tok], state)
                rec_state[slots] = state
        for r in meta.prefill_reqs:
            start, end = int(meta.query_start_loc[r]), int(meta.query_start_loc[r + 1])
            slot = meta.slot_ids[r]
            state, pos = rec_state[slot], start
            for num, ckpt in [*meta.saves.get(r, ()), (end - start, None)]:  # split where a checkpoint is saved
                stop = start + num
                if stop > pos:
                    core[pos:stop], state = self._delta_rule(q[pos:stop], k[pos:stop], v[pos:stop], g[pos:stop],
                                                             beta[pos:stop], state,
                                                             int(meta.num_computed[r]) + pos - start)
                if ckpt is not None:
                    ckpt_rec[ckpt] = state
                pos = stop
            rec_state[slot] = state

    def _delta_rule(self, q, k, v, g, beta, state: torch.Tensor, position: int):
        """One request's tokens from ``state`` [Hv, Dk, Dv] (absolute ``position`` of the first): (o, new state).
        Default mode: the chunked rule, chunks aligned to absolute positions; deterministic mode: token by token."""
        if self.batch_invariant:
            state = state.clone().unsqueeze(0)  # (1, Hv, Dk, Dv) contiguous, updated in place
            return invariant_ops.recurrent_rule(q, k, v, g, beta, state), state[0]
        return chunk_gated_delta_rule(q, k, v, g, beta, state, position=position)

    def _taps(self, window: torch.Tensor, prefill: bool) -> torch.Tensor:
        """Deterministic mode's conv: sum over the K taps in order, one elementwise op at a time.
        window [..., C, K] (decode) or [C, L, K] (prefill) -> [..., C] / [C, L]."""
        weight = self.conv1d.weight[:, 0, :]  # (C, K)
        column = (lambda j: weight[:, j, None]) if prefill else (lambda j: weight[:, j])
        out = window[..., 0] * column(0)
        for j in range(1, self.kernel):
            out = out + window[..., j] * column(j)
        return out

    def _conv(self, mixed: torch.Tensor, meta) -> torch.Tensor:
        """Depthwise causal conv + SiLU of ``mixed`` [T, C], each request continuing from its conv state
        (updated in place to its last kernel - 1 inputs; saved into the checkpoints this step reaches). Returns [T, C]."""
        conv_state = meta.conv_state[self.linear_index]  # (S, C, K-1)
        ckpt = meta.checkpoint_conv[self.linear_index] if meta.checkpoint_conv is not None else None
        weight = self.conv1d.weight[:, 0, :]  # (C, K)
        out = torch.empty_like(mixed)
        if len(meta.decode_reqs):
            tok, slots = meta.decode_token_idx, meta.slot_ids[meta.decode_reqs]
            window = torch.cat((conv_state[slots], mixed[tok].unsqueeze(-1)), dim=-1)  # (Bd, C, K)
            out[tok] = self._taps(window, prefill=False) if self.batch_invariant else (window * weight).sum(-1)
            conv_state[slots] = window[:, :, 1:]
        for r in meta.prefill_reqs:
            start, end = int(meta.query_start_loc[r]), int(meta.query_start_loc[r + 1])
            slot = meta.slot_ids[r]
            seq = torch.cat((conv_state[slot], mixed[start:end].t()), dim=-1)  # (C, K-1+L)
            if self.batch_invariant:
                out[start:end] = self._taps(seq.unfold(1, self.kernel, 1), prefill=True).t()  # (C, L, K) -> (L, C)
            else:
                out[start:end] = F.conv1d(seq.unsqueeze(0), self.conv1d.weight, groups=self.conv_dim)[0].t()
            for num, slot_ckpt in meta.saves.get(r, ()):  # the last kernel - 1 inputs after the first num tokens
                ckpt[slot_ckpt] = seq[:, num : num + self.kernel - 1]
            conv_state[slot] = seq[:, seq.shape[1] - (self.kernel - 1):]
        for r, entries in meta.saves.items():
            if meta.query_start_loc[r + 1] - meta.query_start_loc[r] == 1:
                ckpt[entries[0][1]] = conv_state[meta.slot_ids[r]]
        if self.batch_invariant:
            return invariant_ops.sigmoid(out, silu=True).to(out.dtype)
        return F.silu(out)


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next stores q|k|v|z in one ``in_proj_qkvz`` and b|a in ``in_proj_ba``, grouped per key head;
    ``load_weights`` regroups the rows into this class's plain order."""

    def split_sizes(self, config: PretrainedConfig) -> list[int]:
        return [self.conv_dim + self.value_dim, 2 * self.num_v_heads]

    def regroup(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Checkpoint rows (per key head: q, k, r*v, r*z / r*b, r*a) -> plain (all q, all k, ...)."""
        rep = self.num_v_heads // self.num_k_heads
        grouped = tensor.view(self.num_k_heads, -1, tensor.shape[-1])  # (Hk, rows per group, hidden)
        if name == "in_proj_qkvz":
            sizes = [self.head_k_dim, self.head_k_dim, rep * self.head_v_dim, rep * self.head_v_dim]
        else:
            sizes = [rep, rep]
        return torch.cat([part.reshape(-1, tensor.shape[-1]) for part in grouped.split(sizes, dim=1)], dim=0)


class HybridDecoderLayer(nn.Module):
    """Pre-norm block whose token mixer is ``linear_attn`` or ``self_attn`` (config.layer_types)."""

    def __init__(self, config: PretrainedConfig, layer_type: str, linear_index: int, rotary_dim: int,
                 delta_net_cls: type[GatedDeltaNet]) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == LINEAR:
            self.linear_attn = delta_net_cls(config, linear_index)
        else:
            self.self_attn = GatedAttention(config, rotary_dim)
        self.mlp = LlamaMLP(config, DecoderVariant())
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, cos, sin, kv_cache: KVCache | None, attn_metadata) -> torch.Tensor:
        h = self.input_layernorm(hidden_states)
        if self.layer_type == LINEAR:
            h = self.linear_attn(h, attn_metadata)
        else:
            h = self.self_attn(h, cos, sin, kv_cache, attn_metadata)
        h = h + hidden_states
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridModel(nn.Module):
    """Embedding, hybrid layers, final norm: forward(input_ids [T], positions [T], kv_caches, metadata) -> [T, hidden].

    ``kv_caches`` holds one entry per full-attention layer, in layer order.
    """

    def __init__(self, config: PretrainedConfig, delta_net_cls: type[GatedDeltaNet]) -> None:
        super().__init__()
        params = dict(config.rope_parameters or {})
        if params.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.rope_type {params.get('rope_type')!r} is not supported for hybrid "
                             "models (only 'default')")
        rotary_dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
        rope_config = copy.copy(config)
        rope_config.rope_parameters = {"rope_type": "default", "rope_theta": params.get("rope_theta", 10000.0)}
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layer_types = list(config.layer_types)
        linear_index = [sum(t == LINEAR for t in self.layer_types[:i]) for i in range(len(self.layer_types))]
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, t, linear_index[i], rotary_dim, delta_net_cls)
            for i, t in enumerate(self.layer_types)
        )
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(rope_config, rotary_dim)

    def forward(self, input_ids, positions, kv_caches: list[KVCache], attn_metadata) -> torch.Tensor:
        num_full = sum(t != LINEAR for t in self.layer_types)
        assert len(kv_caches) == num_full, f"{len(kv_caches)} kv caches for {num_full} full-attention layers"
        hidden_states = self.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary_emb(positions, hidden_states.dtype)  # (T, 1, R/2)
        caches = iter(kv_caches)
        for layer in self.layers:
            kv_cache = None if layer.layer_type == LINEAR else next(caches)
            hidden_states = layer(hidden_states, cos, sin, kv_cache, attn_metadata)
        return self.norm(hidden_states)


# checkpoint projection name -> (fused module name, shard index); the Gated DeltaNet rows of Qwen3.5
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1), "in_proj_b": ("in_proj", 2),
    "in_proj_a": ("in_proj", 3),
    "in_proj_qkvz": ("in_proj", 0), "in_proj_ba": ("in_proj", 1),  # Qwen3-Next (regrouped first)
}


# The hybrid model's own modules with a deterministic path (the engine hook switches them; docs/deterministic.md).
BATCH_INVARIANT_MODULES = (ZeroCenteredRMSNorm, GatedRMSNorm, GatedAttention, GatedDeltaNet)


class Qwen3_5ForCausalLM(nn.Module):
    """Qwen3.5 text decoder (dense): hybrid Gated DeltaNet + gated full attention.

    forward(input_ids [T], positions [T], kv_caches (one per full-attention layer), attn_metadata with
    ``linear_state``) -> [T, hidden]; compute_logits(hidden [N, hidden]) -> [N, vocab] float32.
    Qwen3.5's multimodal RoPE reduces to plain RoPE for text (all three position streams equal).

    Raises:
        ValueError: a config field this implementation cannot serve (named in the message).
    """

    is_hybrid = True
    delta_net_cls: type[GatedDeltaNet] = GatedDeltaNet

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.model = HybridModel(config, self.delta_net_cls)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) != config.num_hidden_layers or not set(types) <= {LINEAR, FULL}:
            raise ValueError(f"layer_types must list {config.num_hidden_layers} entries of {LINEAR!r} / {FULL!r}, "
                             f"got {types}")

    def linear_state_shapes(self) -> tuple[int, int, int, int, int, int]:
        """(num_linear_layers, conv_dim, conv_kernel, num_v_heads, head_k_dim, head_v_dim) for the state pool."""
        layers = [layer.linear_attn for layer in self.model.layers if layer.layer_type == LINEAR]
        first = layers[0]
        return len(layers), first.conv_dim, first.kernel, first.num_v_heads, first.head_k_dim, first.head_v_dim

    def forward(self, input_ids, positions, kv_caches: list[KVCache], attn_metadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head.forward_float32(hidden_states)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the model (fused projections get their shards).

        Raises:
            ValueError: an unknown tensor name, a shape mismatch, or tensors missing from the checkpoint.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        fused_shards = {}  # fused param name -> shards expected
        for name, module in self.named_modules():
            if isinstance(module, MergedLinear):
                fused_shards[f"{name}.weight"] = len(module.output_sizes)
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            if name.startswith("mtp.") or name.startswith("model.visual."):
                continue  # multi-token-prediction head and vision tower: not part of the text decoder
            module_path, _, param_name = name.rpartition(".")
            parent, _, proj = module_path.rpartition(".")
            if proj in _STACKED:
                fused, shard = _STACKED[proj]
                target = f"{parent}.{fused}"
                if f"{target}.{param_name}" not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
                if proj in ("in_proj_qkvz", "in_proj_ba"):
                    tensor = self.get_submodule(parent).regroup(proj, tensor)
                self.get_submodule(target).load_shard(param_name, shard, tensor)
                loaded.add(f"{target}.{param_name}#{shard}")
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
            param.copy_(tensor)
            loaded.add(name)
        expected = set()
        for name, _ in self.named_parameters():
            if name in fused_shards:
                expected.update(f"{name}#{i}" for i in range(fused_shards[name]))
            else:
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next, dense configs only: the Qwen3.5 layout with grouped in_proj_qkvz / in_proj_ba rows.

    Raises:
        ValueError: a mixture-of-experts config (``num_experts`` > 0 on any layer outside ``mlp_only_layers``).
    """

    delta_net_cls = Qwen3NextGatedDeltaNet

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        super().check_config(config)
        num_experts = int(getattr(config, "num_experts", 0) or 0)
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        mlp_only = set(getattr(config, "mlp_only_layers", None) or [])
        sparse = [i for i in range(config.num_hidden_layers) if i not in mlp_only and (i + 1) % step == 0]
        if num_experts > 0 and sparse:
            raise ValueError(f"num_experts={num_experts}: mixture-of-experts Qwen3-Next layers (e.g. layer "
                             f"{sparse[0]}) are not supported yet; only dense configs (num_experts=0) load")
