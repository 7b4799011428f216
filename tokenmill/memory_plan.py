"""Memory planning for ``tokenmill plan``: how much KV cache a memory budget leaves, without loading weights.

Model facts come from config.json + safetensors headers, or GGUF metadata + tensor shapes
(parameter counts are sums of tensor shapes; no tensor data is read). The budget is split as

    usable      = memory × memory_utilization
    weights     = num_params × bytes(dtype)              (dense in dtype; with --quantization gguf (the
                                                          default for GGUF) the quantized matrices count
                                                          their stored bytes, with int8 the decoder's
                                                          linear layers count 34 bytes per 32 weights;
                                                          tensor by tensor, plan_weights.py)
    reserve     = RUNTIME_OVERHEAD + activations
    activations = T × (4·hidden + 2·q + 2·kv + 3·mlp) × bytes(dtype)   one step's flat tensors
                + S × vocab × 4 × 3                      fp32 logits of the sampled rows + 2 sampler copies
                + heads × C × L × 4 + 2 × L × kv × bytes(dtype)   one prefill chunk's scores and gathered context
    kv budget   = usable − weights − reserve             (or the given kv_cache_memory)

with T = max_num_batched_tokens, S = min(max_num_seqs, T), L = max_model_len, C = min(T, L),
q = heads × head_dim, kv = kv_heads × head_dim, mlp = intermediate_size. The KV pool then holds
floor(kv budget / (block_size × kv_bytes_per_token)) blocks: the engine's own formula
(``runner.kv_cache_sizing``), so the block count equals ``ModelRunner.num_kv_blocks``.

Multi-head latent attention (DeepSeek-V2/V3, docs/moe.md): a token caches one latent vector per layer instead of
K and V, so kv_bytes_per_token = layers × (kv_lora_rank + qk_rope_head_dim) × bytes(kv dtype) (the runner's
one-plane pool), and activations count the absorbed query (heads × latent) as q and the latent as kv.

Mixture of experts (docs/moe.md): mlp is the widest layer's, max(intermediate_size on dense layers, k ×
moe_intermediate_size + shared experts' width on MoE layers), plus T × 2·k·hidden (the grouped expert step's
(token, rank) rows and output slots). The plan also gives the active parameters (all but the unchosen experts) and
the weight bytes a batch-1 decode step reads (``active_weight_bytes``: the bandwidth roofline's numerator).

Hybrid (linear-attention) models (docs/hybrid_models.md): only the full-attention layers count in
kv_bytes_per_token; each linear layer keeps a fixed state per sequence instead
(``kv_cache.state_slots.state_bytes_per_sequence``). The engine allocates max_num_seqs live state slots
and, with prefix caching, max_num_seqs state checkpoints beside the KV pool, or with ``state_cache_memory``
as many sequences' state as that budget holds (live slots first, at most max_num_seqs, the rest
checkpoints; ``kv_cache.state_slots.state_pool_sizes``, the engine's own formula), so the kv budget from
``memory`` is usable − weights − reserve − state pools; activations add
T × (2·qk + 2·v) × 4 (the linear layers' float32 q, k, v and output, qk = value heads × head_k_dim).
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from tokenmill.config import ConfigError, check_int, check_number
from tokenmill.csrc_build import cpu_has_native_bf16
from tokenmill.engine_args import EngineArgs
from tokenmill.kv_cache.state_slots import state_bytes_per_sequence, state_pool_sizes
from tokenmill.plan_weights import MoESizes, TensorInfo, WeightCensus, census
from tokenmill.runner.kv_cache_sizing import GIB, kv_bytes_per_token, latent_kv_dim, num_blocks_for_budget

MIB = 1024**2
# Torch/Python runtime, tokenizer, server and allocator slack (an idle process with torch and
# transformers imported is ~300 MiB resident on CPU).
RUNTIME_OVERHEAD_BYTES = 512 * MIB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "int8": 1}
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8_e4m3", "fp8")
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3", "fp8")  # one byte per element + a float16 scale per token and KV head
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model (read without loading weights)."""

    path: str
    file_format: str  # "safetensors" or "gguf"
    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    num_params: int
    checkpoint_bytes: int  # tensor data as stored (quantized for GGUF)
    checkpoint_dtype: str | None  # what dtype="auto" follows; None for GGUF
    quantized_params: int = 0  # GGUF: parameters of the matrices --quantization gguf keeps in their blocks
    quantized_bytes: int = 0  # ... and their stored bytes
    # Hybrid models: the linear-attention layers (no KV; a fixed state per sequence), 0 for attention-only ones.
    num_linear_layers: int = 0
    linear_conv_dim: int = 0
    linear_conv_kernel: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # Multi-head latent attention: the latent width (kv_lora_rank + qk_rope_head_dim) cached per token and layer.
    kv_latent_dim: int = 0
    # Mixture of experts (0 for dense models): routed experts, experts per token, MoE layers (the others keep a
    # dense MLP of intermediate_size), each routed expert's and the shared experts' intermediate widths.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_moe_layers: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # Parameters a token uses: all but the unchosen routed experts (num_params for a dense model; 0: not read).
    num_active_params: int = 0
    # The weights tensor by tensor (plan_weights.py): as held, and as one batch-1 decode step reads them.
    weights: WeightCensus | None = None
    decode_weights: WeightCensus | None = None

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K/V in the paged pool (a hybrid model's full-attention layers)."""
        return self.num_layers - self.num_linear_layers

    def state_bytes_per_sequence(self, dtype_bytes: int) -> int:
        """Linear-layer state of one sequence (0 for attention-only models); conv state in ``dtype_bytes``."""
        return state_bytes_per_sequence(self.num_linear_layers, self.linear_conv_dim, self.linear_conv_kernel,
                                        self.linear_num_value_heads, self.linear_key_head_dim,
                                        self.linear_value_head_dim, dtype_bytes)


def _safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON); no tensor data."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def _checkpoint_dtype(config, headers: list[dict]) -> str | None:
    """The checkpoint dtype as the loader decides it: config ``dtype``/``torch_dtype``, else the first tensor's."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is not None:
        return str(dtype).removeprefix("torch.")
    first = sorted(headers[0])[0] if headers and headers[0] else None
    return _SAFETENSORS_DTYPES.get(headers[0][first]["dtype"]) if first else None


def _moe_fields(model_class, config) -> tuple[dict, MoESizes | None]:
    """ModelShape's MoE fields and the census' MoE sizes, by the engine class's own rules (none for dense)."""
    from tokenmill.models.sparse_moe import MoECausalLM

    if not issubclass(model_class, MoECausalLM):
        return {}, None
    moe, sparse = model_class.moe_config(config), model_class.moe_layers(config)
    if not any(sparse):
        return {}, None
    sizes = MoESizes(moe.router.num_experts, moe.router.top_k, moe.router_float32)
    return dict(num_experts=sizes.num_experts, num_experts_per_tok=sizes.num_experts_per_tok,
                num_moe_layers=sum(sparse), moe_intermediate_size=moe.moe_intermediate_size,
                shared_expert_intermediate_size=moe.shared_expert_intermediate_size), sizes


def _shape_from_config(config, path: Path, file_format: str, tensors: list[TensorInfo],
                       checkpoint_dtype: str | None) -> ModelShape:
    from tokenmill.models.llama import head_dim_of
    from tokenmill.models.registry import get_model_class

    model_class = get_model_class(config)  # unsupported architectures fail here, as in the engine
    moe_fields, moe = _moe_fields(model_class, config)
    held, decode, active = census(tensors, int8_allowed=file_format == "safetensors", moe=moe,
                                  tied=bool(getattr(config, "tie_word_embeddings", False)),
                                  vocab_size=int(config.vocab_size))
    kept = [t for t in tensors if t.gguf_kept]
    linear: dict = {}
    head_dim = int(head_dim_of(config))
    latent = latent_kv_dim(config)
    if latent:  # DeepSeek's latent attention: head_dim is the q/k head (nope + rope); one latent vector cached
        linear = dict(kv_latent_dim=latent)
        head_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
    layer_types = list(getattr(config, "layer_types", None) or [])
    if "linear_attention" in layer_types:  # hybrid Gated DeltaNet model (tokenmill/models/qwen3_next.py)
        hk, hv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        dk, dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
        linear = dict(num_linear_layers=layer_types.count("linear_attention"), linear_conv_dim=2 * hk * dk + hv * dv,
                      linear_conv_kernel=int(config.linear_conv_kernel_dim), linear_num_value_heads=hv,
                      linear_key_head_dim=dk, linear_value_head_dim=dv)
    return ModelShape(
        path=str(path), file_format=file_format, architecture=config.architectures[0],
        num_layers=int(config.num_hidden_layers), hidden_size=int(config.hidden_size),
        num_attention_heads=int(config.num_attention_heads),
        num_kv_heads=1 if latent else int(config.num_key_value_heads or config.num_attention_heads),
        head_dim=head_dim, intermediate_size=int(config.intermediate_size),
        vocab_size=int(config.vocab_size), max_position_embeddings=int(config.max_position_embeddings),
        num_params=held.params, checkpoint_bytes=sum(t.nbytes for t in tensors), checkpoint_dtype=checkpoint_dtype,
        quantized_params=sum(math.prod(t.shape) for t in kept), quantized_bytes=sum(t.nbytes for t in kept),
        num_active_params=active, weights=held, decode_weights=decode, **linear, **moe_fields,
    )


def read_model_shape(model: str | None) -> ModelShape:
    """Read a model's shape from a local HF directory, a .gguf file, or the embedded default (None).

    Parameter counts skip what the engine does not load: ``rotary_emb.inv_freq`` buffers and a
    stored ``lm_head.weight`` when embeddings are tied.

    Raises:
        ValueError: a path that does not exist, lacks config.json/safetensors, or an unsupported architecture.
    """
    from tokenmill.models.default_model import default_model_path

    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        from tokenmill.models.gguf_loader import (gguf_to_hf_config, kept_quantized_names, read_gguf_metadata,
                                                  read_tensor_index)

        header = read_gguf_metadata(path)
        config = gguf_to_hf_config(header)
        index = read_tensor_index(header)  # the weights (rope_freqs.weight is config, not a parameter)
        kept = kept_quantized_names(index)
        tensors = [TensorInfo(t.name, tuple(t.shape), t.nbytes, t.name in kept) for t in index]
        return _shape_from_config(config, path, "gguf", tensors, None)
    if not path.is_dir():
        raise ValueError(f"model {model!r} is not a local model directory or .gguf file")
    from transformers import AutoConfig

    from tokenmill.models.loader import checkpoint_files

    files = checkpoint_files(path)
    config = AutoConfig.from_pretrained(str(path))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    headers = [_safetensors_header(f) for f in files]
    tensors = [TensorInfo(name, tuple(info["shape"]), info["data_offsets"][1] - info["data_offsets"][0])
               for header in headers for name, info in header.items()
               if not (name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"))]
    return _shape_from_config(config, path, "safetensors", tensors, _checkpoint_dtype(config, headers))


@dataclass(frozen=True)
class PlanConfig:
    """The planner's inputs: ``memory`` (GiB) and ``memory_utilization``, then the engine options the plan
    depends on, by their ``EngineArgs`` names and with its defaults (``tokenmill plan`` adds their flags).

    ``kv_cache_memory`` set: plan that KV budget directly (``memory`` only checks the fit); None (the plan's
    default, unlike the engine's): the KV budget is what ``memory`` leaves. ``kv_cache_dtype`` also takes
    float32 and bfloat16 here, for planning.
    """

    memory: float
    memory_utilization: float = 0.9
    dtype: str = EngineArgs.dtype
    kv_cache_dtype: str = EngineArgs.kv_cache_dtype
    max_model_len: int | None = EngineArgs.max_model_len
    block_size: int = EngineArgs.block_size
    max_num_batched_tokens: int = EngineArgs.max_num_batched_tokens
    max_num_seqs: int = EngineArgs.max_num_seqs
    kv_cache_memory: float | None = None
    quantization: str | None = EngineArgs.quantization
    enable_prefix_caching: bool = EngineArgs.enable_prefix_caching  # hybrid models: adds max_num_seqs checkpoints
    state_cache_memory: float | None = EngineArgs.state_cache_memory  # hybrid models: GiB for the state pool

    def __post_init__(self) -> None:
        if self.quantization not in (None, "gguf", "int8", "none"):
            raise ValueError(f"quantization must be one of 'gguf', 'int8', 'none'; got {self.quantization!r}")
        check_number("memory", self.memory, 0, inclusive=False)
        check_number("memory_utilization", self.memory_utilization, 0, inclusive=False, maximum=1)
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be one of 'auto', 'float32', 'bfloat16'; got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}; got {self.kv_cache_dtype!r}")
        for name in ("max_model_len", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            check_int(name, getattr(self, name), optional=name == "max_model_len")
        check_number("kv_cache_memory", self.kv_cache_memory, 0, inclusive=False, optional=True)
        check_number("state_cache_memory", self.state_cache_memory, 0, inclusive=False, optional=True)


@dataclass(frozen=True)
class MemoryPlan:
    """The planner's answer; byte counts are exact integers."""

    model: ModelShape
    config: PlanConfig
    dtype: str
    kv_cache_dtype: str
    max_model_len: int
    weight_bytes: int
    runtime_overhead_bytes: int
    activation_bytes: int
    usable_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int
    num_kv_blocks: int
    kv_cache_memory_flag: float  # a short --kv-cache-memory value giving exactly num_kv_blocks
    state_bytes_per_sequence: int = 0  # hybrid models: linear-layer state of one sequence
    num_state_slots: int = 0  # live state slots (max_num_seqs, or what state_cache_memory holds) for hybrid models
    num_state_checkpoints: int = 0  # prefix-cache state checkpoints (likewise) for hybrid models
    active_weight_bytes: int = 0  # weight bytes a batch-1 decode step reads per token (active_weight_bytes())

    @property
    def reserve_bytes(self) -> int:
        return self.runtime_overhead_bytes + self.activation_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.config.block_size * self.kv_bytes_per_token

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_kv_blocks * self.bytes_per_block

    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.config.block_size

    @property
    def blocks_per_sequence(self) -> int:
        return -(-self.max_model_len // self.config.block_size)

    @property
    def num_full_length_sequences(self) -> int:
        """Sequences of max_model_len tokens that fit at once (whole blocks each) in the KV pool."""
        return self.num_kv_blocks // self.blocks_per_sequence

    @property
    def state_pool_bytes(self) -> int:
        """Hybrid models: live state slots plus state checkpoints (0 for attention-only models)."""
        return (self.num_state_slots + self.num_state_checkpoints) * self.state_bytes_per_sequence

    @property
    def num_sequences_both_pools(self) -> int:
        """Full-length sequences that can run at once: the KV pool's count, capped by the state slots of a
        hybrid model (the scheduler admits a request only when both pools hold it)."""
        kv = self.num_full_length_sequences
        return min(kv, self.num_state_slots) if self.num_state_slots else kv

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.reserve_bytes + self.kv_pool_bytes + self.state_pool_bytes


def mlp_width(shape: ModelShape) -> int:
    """The widest per-token MLP intermediate of any layer: intermediate_size on dense layers, k ×
    moe_intermediate_size + the shared experts' width on MoE layers (what the grouped expert step holds)."""
    moe = shape.num_experts_per_tok * shape.moe_intermediate_size + shape.shared_expert_intermediate_size
    dense = shape.intermediate_size if shape.num_moe_layers < shape.num_layers else 0
    return max(dense, moe) if shape.num_moe_layers else shape.intermediate_size


def activation_bytes(shape: ModelShape, dtype_bytes: int, max_num_batched_tokens: int, max_num_seqs: int,
                     max_model_len: int) -> int:
    """The activation reserve of one engine step (see the module docstring for the formula)."""
    t, length = max_num_batched_tokens, max_model_len
    sampled, chunk = min(max_num_seqs, t), min(t, length)
    q = shape.num_attention_heads * (shape.kv_latent_dim or shape.head_dim)  # latent attention: absorbed query
    kv = shape.kv_latent_dim or shape.num_kv_heads * shape.head_dim
    step = t * (4 * shape.hidden_size + 2 * q + 2 * kv + 3 * mlp_width(shape)) * dtype_bytes
    if shape.num_moe_layers:  # the grouped expert step's (token, rank) input rows and output slots
        step += t * 2 * shape.num_experts_per_tok * shape.hidden_size * dtype_bytes
    logits = sampled * shape.vocab_size * 4 * 3
    prefill = shape.num_attention_heads * chunk * length * 4 + 2 * length * kv * dtype_bytes
    if shape.num_linear_layers:  # the linear layers' float32 q and k (per value head), v and output
        qk = shape.linear_num_value_heads * shape.linear_key_head_dim
        step += t * (2 * qk + 2 * shape.linear_num_value_heads * shape.linear_value_head_dim) * 4
    return step + logits + prefill


def kv_cache_memory_flag(num_blocks: int, bytes_per_block: int, budget_bytes: int) -> float:
    """The shortest decimal GiB value for which the engine's sizing gives exactly ``num_blocks`` (and ≤ budget)."""
    lo = num_blocks * bytes_per_block
    hi = min(budget_bytes, lo + bytes_per_block - 1)
    for digits in range(1, 16):
        value = math.ceil(lo / GIB * 10**digits) / 10**digits
        if lo <= int(value * GIB) <= hi:
            return value
    return lo / GIB


def run_dtype(shape: ModelShape, dtype: str) -> str:
    """The dtype the engine runs in on this CPU: "auto" keeps float32 checkpoints in float32 and runs the
    rest in bfloat16 where the CPU has bf16 arithmetic, float32 elsewhere (as models/loader.py does)."""
    if dtype != "auto":
        return dtype
    return "float32" if shape.checkpoint_dtype == "float32" or not cpu_has_native_bf16() else "bfloat16"


def resolved_quantization(shape: ModelShape, quantization: str | None) -> str:
    """The weight format the engine holds ``shape`` in: None is "gguf" for a GGUF file, "none" otherwise.

    Raises:
        ValueError: "gguf" for a safetensors model or "int8" for a GGUF file (as the loader refuses them).
    """
    if quantization == "gguf" and shape.file_format != "gguf":
        raise ValueError("quantization 'gguf' needs a .gguf model file")
    if quantization == "int8" and shape.file_format != "safetensors":
        raise ValueError("quantization 'int8' is for safetensors checkpoints")
    if quantization is None:
        return "gguf" if shape.file_format == "gguf" else "none"
    return quantization


def weight_bytes(shape: ModelShape, dtype: str, quantization: str | None) -> int:
    """Bytes of the weights as the engine holds them: dense in ``dtype`` (DeepSeek's routers in float32), but for
    ``quantization`` "gguf" (the default for a GGUF file) the kept matrices at their stored size, and for "int8"
    the decoder's linear layers with in_features a multiple of 32 (experts, routers and shared experts included;
    not the embedding, LM head or ``kv_b_proj``) at 34 bytes per 32 weights (plan_weights.py).

    Raises:
        ValueError: "gguf" for a safetensors model or "int8" for a GGUF file (as the loader refuses them).
    """
    quantization = resolved_quantization(shape, quantization)
    if shape.weights is None:  # a shape built by hand: everything dense
        return shape.num_params * DTYPE_BYTES[dtype]
    return shape.weights.nbytes(DTYPE_BYTES[dtype], quantization)


def active_weight_bytes(shape: ModelShape, dtype: str, quantization: str | None) -> int:
    """Weight bytes one batch-1 decode step reads per token, held as ``weight_bytes`` holds them: the active
    parameters (k routed experts per MoE layer, the rest whole) with the embedding table as one row unless the LM
    head is tied to it (plan_weights.py). The bandwidth roofline of decode is read bandwidth / this.

    Raises:
        ValueError: as ``weight_bytes``.
    """
    quantization = resolved_quantization(shape, quantization)
    if shape.decode_weights is None:
        return shape.num_params * DTYPE_BYTES[dtype]
    return shape.decode_weights.nbytes(DTYPE_BYTES[dtype], quantization)


def plan_memory(shape: ModelShape, config: PlanConfig) -> MemoryPlan:
    """Split ``config.memory`` into weights, reserve and KV pool for ``shape``.

    Raises:
        ValueError: max_model_len over the model's limit, or a budget that leaves no KV block
            (naming ``memory`` or ``kv_cache_memory``).
    """
    dtype = run_dtype(shape, config.dtype)
    kv_dtype = dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    max_model_len = config.max_model_len or shape.max_position_embeddings
    if max_model_len > shape.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                         f"{shape.max_position_embeddings}")
    weights = weight_bytes(shape, dtype, config.quantization)
    active_weights = active_weight_bytes(shape, dtype, config.quantization)
    activations = activation_bytes(shape, DTYPE_BYTES[dtype], config.max_num_batched_tokens, config.max_num_seqs,
                                   max_model_len)
    usable = int(config.memory * config.memory_utilization * GIB)
    if shape.kv_latent_dim:
        if kv_dtype in QUANTIZED_KV_DTYPES:
            raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype!r} is not supported with multi-head latent "
                             "attention (DeepSeek-V2/V3); use 'auto'")
        per_token = kv_bytes_per_token(shape.num_kv_layers, 1, shape.kv_latent_dim, DTYPE_BYTES[kv_dtype], num_planes=1)
    else:
        per_token = kv_bytes_per_token(shape.num_kv_layers, shape.num_kv_heads, shape.head_dim, DTYPE_BYTES[kv_dtype])
    if kv_dtype in QUANTIZED_KV_DTYPES:  # the runner's scales: float16 per token, KV head, K and V, layer
        per_token += 2 * shape.num_kv_layers * shape.num_kv_heads * 2
    state_per_seq = shape.state_bytes_per_sequence(DTYPE_BYTES[dtype])
    state_slots = checkpoints = 0
    if shape.num_linear_layers:
        state_budget = None if config.state_cache_memory is None else int(config.state_cache_memory * GIB)
        state_slots, checkpoints = state_pool_sizes(state_budget, state_per_seq, config.max_num_seqs,
                                                    config.enable_prefix_caching)
    state_pool = (state_slots + checkpoints) * state_per_seq
    if config.kv_cache_memory is not None:
        budget = int(config.kv_cache_memory * GIB)
    else:
        budget = usable - weights - RUNTIME_OVERHEAD_BYTES - activations - state_pool
        if budget < config.block_size * per_token:
            need = (weights + RUNTIME_OVERHEAD_BYTES + activations + state_pool + config.block_size * per_token) / GIB
            raise ConfigError(f"`memory` {config.memory} GiB x `memory_utilization` {config.memory_utilization} "
                              f"leaves no room for one KV block; weights + reserve + one block need {need:.3f} GiB")
    blocks = num_blocks_for_budget(budget, config.block_size, per_token)  # "memory" left room for one above
    return MemoryPlan(
        model=shape, config=config, dtype=dtype, kv_cache_dtype=kv_dtype, max_model_len=max_model_len,
        weight_bytes=weights, runtime_overhead_bytes=RUNTIME_OVERHEAD_BYTES, activation_bytes=activations,
        usable_bytes=usable, kv_budget_bytes=budget, kv_bytes_per_token=per_token, num_kv_blocks=blocks,
        kv_cache_memory_flag=kv_cache_memory_flag(blocks, config.block_size * per_token, budget),
        state_bytes_per_sequence=state_per_seq, num_state_slots=state_slots, num_state_checkpoints=checkpoints,
        active_weight_bytes=active_weights,
    )


def physical_memory_gib() -> float:
    """This machine's physical memory in GiB (the default ``--memory`` on CPU)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
