"""llama.cpp's ``deepseek2`` GGUF architecture (DeepSeek-V2 / V2-Lite / V2.5 / V3 / R1) in Hugging Face terms.

Reads the ``deepseek2.*`` metadata into a ``DeepseekV2Config`` or ``DeepseekV3Config`` and joins the absorbed-MLA
tensors llama.cpp's converter writes (``attn_k_b`` per head, transposed, and ``attn_v_b``) back into the
checkpoint's ``kv_b_proj``. Used by ``gguf_loader``; reads no file itself (metadata through ``field``).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TYPE_CHECKING

import torch

from tokenmill.models.errors import UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# llama.cpp's deepseek2 block tensors -> HF module names (the rest as in gguf_loader._BLOCK_NAMES). attn_k_b and
# attn_v_b are both halves of kv_b_proj (LatentHalves joins them); older converters wrote attn_kv_b as it is.
DEEPSEEK2_BLOCK_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.kv_b_proj",
    "attn_v_b": "self_attn.kv_b_proj",
}
# block tensors whose HF name is a parameter of its own, not a module's .weight / .bias (V3's correction bias)
DEEPSEEK2_PARAMETERS = {"exp_probs_b": "mlp.gate.e_score_correction_bias"}
# kv_b_proj is a LatentProjection (dense, used only absorbed): never kept in blocks
DEEPSEEK2_DENSE_ONLY = frozenset({"attn_kv_b", "attn_k_b", "attn_v_b"})

# gguf.ExpertGatingFuncType
_SOFTMAX, _SIGMOID = 1, 2


def deepseek2_config_class(field: Callable[[str], Any], source: Path, kwargs: dict[str, Any],
                           tensor_names: set[str]) -> type[PretrainedConfig]:
    """Complete ``kwargs`` (the fields every GGUF architecture shares, read by ``gguf_to_hf_config``) for a
    ``deepseek2`` file and return the config class to build: ``DeepseekV3Config`` when
    ``deepseek2.expert_gating_func`` is sigmoid (V3 / R1: the converter writes it from ``scoring_func``), else
    ``DeepseekV2Config`` (softmax; absent in V2 files, as llama.cpp reads it).

    ``field(key)``: the value of ``deepseek2.{key}`` or None. Sizes: ``attention.key_length_mla`` (qk_nope +
    qk_rope) and ``value_length_mla`` (v_head_dim), since ``key_length`` / ``value_length`` hold the absorbed
    sizes (kv_lora_rank + qk_rope, kv_lora_rank); files from converters before the absorbed layout (with
    ``attn_kv_b``) have only ``key_length`` / ``value_length``, the per-head sizes. ``rope.dimension_count`` is
    qk_rope_head_dim; ``head_count_kv`` (1: llama.cpp's MQA view of the latent) is not the config's. MoE:
    ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``, ``expert_shared_count``,
    ``leading_dense_block_count`` (first_k_dense_replace), ``expert_weights_scale`` (routed_scaling_factor),
    ``expert_weights_norm`` (norm_topk_prob), ``expert_group_count`` / ``expert_group_used_count`` (n_group /
    topk_group; V2 with more than one group routes ``group_limited_greedy``, the file does not say topk_method).
    YaRN: ``rope.scaling.yarn_beta_fast`` / ``yarn_beta_slow`` and ``yarn_log_multiplier`` (0.1 × mscale_all_dim,
    the softmax-scale correction); llama.cpp leaves the cos/sin unscaled for deepseek2, so mscale = mscale_all_dim
    (transformers' attention factor 1). The rope dims are (x0, x1) pairs (llama.cpp's normal rope; the converter
    does not permute them): V3 gets ``rope_interleave`` True.

    Raises:
        UnsupportedModelError: a required key missing, a gating function other than softmax / sigmoid, a
            correction bias (``exp_probs_b``) with softmax gating, sizes that do not add up, or a YaRN
            ``attn_factor`` other than 1.
    """
    def required(key: str) -> Any:
        value = field(key)
        if value is None:
            raise UnsupportedModelError(f"{source}: metadata key deepseek2.{key} is missing")
        return value

    heads = int(kwargs["num_attention_heads"])
    rope_dim = int(required("rope.dimension_count"))
    kv_lora_rank = int(required("attention.kv_lora_rank"))
    qk_head_dim, v_head_dim = field("attention.key_length_mla"), field("attention.value_length_mla")
    if qk_head_dim is None or v_head_dim is None:
        qk_head_dim, v_head_dim = required("attention.key_length"), required("attention.value_length")
    qk_head_dim, v_head_dim = int(qk_head_dim), int(v_head_dim)
    if qk_head_dim <= rope_dim or rope_dim % 2:
        raise UnsupportedModelError(f"{source}: deepseek2 key length {qk_head_dim} and rope.dimension_count "
                                    f"{rope_dim} do not make an MLA head (the rope part even, below the key length)")
    q_lora_rank = None
    if "blk.0.attn_q_a.weight" in tensor_names:
        q_lora_rank = int(required("attention.q_lora_rank"))

    gating = field("expert_gating_func")
    if gating not in (None, _SOFTMAX, _SIGMOID):
        raise UnsupportedModelError(f"{source}: deepseek2.expert_gating_func {gating} is not supported "
                                    "(1 softmax: DeepSeek-V2, 2 sigmoid: DeepSeek-V3)")
    v3 = gating == _SIGMOID
    if not v3 and any(name.endswith(".exp_probs_b.bias") for name in tensor_names):
        raise UnsupportedModelError(f"{source}: tensor exp_probs_b (a router correction bias) with softmax gating "
                                    "is not supported (DeepSeek-V3's sigmoid gating uses it)")

    num_experts = int(field("expert_count") or 0)
    layers = int(kwargs["num_hidden_layers"])
    moe: dict[str, Any] = dict(n_routed_experts=num_experts, n_shared_experts=0, first_k_dense_replace=layers,
                               moe_intermediate_size=int(kwargs["intermediate_size"]), num_experts_per_tok=None)
    if num_experts:
        groups, topk_groups = int(field("expert_group_count") or 1), int(field("expert_group_used_count") or 1)
        moe = dict(n_routed_experts=num_experts, num_experts_per_tok=int(required("expert_used_count")),
                   n_shared_experts=int(field("expert_shared_count") or 0),
                   moe_intermediate_size=int(field("expert_feed_forward_length") or kwargs["intermediate_size"]),
                   first_k_dense_replace=int(field("leading_dense_block_count") or 0),
                   routed_scaling_factor=float(field("expert_weights_scale") or 1.0),
                   norm_topk_prob=bool(field("expert_weights_norm") or False), n_group=groups, topk_group=topk_groups)
        if not v3:  # V3 has no topk_method (always noaux_tc)
            moe["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    kwargs.update(moe, num_key_value_heads=heads, head_dim=rope_dim, kv_lora_rank=kv_lora_rank,
                  q_lora_rank=q_lora_rank, qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk_head_dim - rope_dim,
                  v_head_dim=v_head_dim, attention_bias="blk.0.attn_kv_a_mqa.bias" in tensor_names)
    _yarn_fields(field, source, kwargs["rope_parameters"])
    import transformers

    if v3:
        kwargs.update(architectures=["DeepseekV3ForCausalLM"], rope_interleave=True)
        return transformers.DeepseekV3Config
    return transformers.DeepseekV2Config


def _yarn_fields(field: Callable[[str], Any], source: Path, rope: dict[str, Any]) -> None:
    """DeepSeek's YaRN fields into ``rope`` (already of rope_type yarn with factor and original context, or not
    YaRN: left alone); see ``deepseek2_config_class``."""
    if rope.get("rope_type") != "yarn":
        return
    attn_factor = field("rope.scaling.attn_factor")
    if attn_factor is not None and abs(float(attn_factor) - 1.0) > 1e-6:
        raise UnsupportedModelError(f"{source}: deepseek2.rope.scaling.attn_factor {attn_factor} is not supported "
                                    "(only 1)")
    for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if field(key) is not None:
            rope[name] = float(field(key))
    log_multiplier = float(field("rope.scaling.yarn_log_multiplier") or 0.0)
    if log_multiplier > 0:
        # stored as float32: 7 significant digits give back the config's value
        rope["mscale"] = rope["mscale_all_dim"] = float(f"{log_multiplier / 0.1:.6g}")
    else:  # no softmax-scale correction, and cos/sin unscaled as llama.cpp runs deepseek2
        rope["attention_factor"] = 1.0


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """The checkpoint's ``kv_b_proj.weight`` [heads * (qk_nope + v), kv_lora_rank] (per head its k_nope rows, then
    its v rows) from llama.cpp's ``attn_k_b`` [heads, kv_lora_rank, qk_nope] (each head's k rows transposed) and
    ``attn_v_b`` [heads, v, kv_lora_rank] (PyTorch order). A copy, float.

    Raises:
        UnsupportedModelError: shapes that do not fit together.
    """
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise UnsupportedModelError(f"deepseek2 attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} do not "
                                    "fit together ([heads, kv_lora_rank, qk_nope] and [heads, v, kv_lora_rank])")
    heads, rank = v_b.shape[0], v_b.shape[2]
    joined = torch.cat((k_b.transpose(1, 2), v_b), dim=1)  # (H, qk_nope + v, r)
    return joined.reshape(heads * joined.shape[1], rank)


class LatentHalves:
    """Collects each layer's ``attn_k_b`` and ``attn_v_b`` (in either order) until both are in, then gives the
    joined ``kv_b_proj.weight`` (``join_kv_b``)."""

    def __init__(self) -> None:
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    @staticmethod
    def holds(part: str) -> bool:
        """Whether a block tensor part (``attn_k_b``) is one of the halves."""
        return part in ("attn_k_b", "attn_v_b")

    def add(self, hf_name: str, part: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """Keep one half (``hf_name``: the layer's kv_b_proj weight name); the joined weight once both are in."""
        halves = self._pending.setdefault(hf_name, {})
        halves[part] = tensor
        if len(halves) < 2:
            return None
        del self._pending[hf_name]
        return join_kv_b(halves["attn_k_b"], halves["attn_v_b"])

    def check_complete(self, source: Path) -> None:
        """Raises UnsupportedModelError when a layer had only one of the two halves."""
        if self._pending:
            name, halves = next(iter(self._pending.items()))
            raise UnsupportedModelError(f"{source}: {name} has {next(iter(halves))} but not its other half "
                                        "(attn_k_b and attn_v_b come together)")
