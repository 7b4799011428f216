"""PEFT LoRA adapters: read a ``save_pretrained`` directory, refuse what the engine cannot serve, and map
each projection's A/B onto the fused modules (``qkv_proj`` slices q | k | v, ``gate_up_proj`` slices
gate | up; ``o_proj`` and ``down_proj`` are one slice each).

Loading and validation only (CPU tensors); never imports the engine, the server or the models: the
base model's shapes come in as a ``BaseModelShapes``.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from tokenmill.lora_request import LoRARequest

# PEFT target module -> (fused module under model.layers.{i}, slice index within it).
PEFT_TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
FUSED_MODULES: tuple[str, ...] = tuple(dict.fromkeys(fused for fused, _ in PEFT_TARGETS.values()))
_EMBEDDING_MODULES = ("embed_tokens", "lm_head")
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<param>weight|bias)")
_LAYER_MODULE = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<proj>\w+)")

# adapter_config.json settings that change what the adapter computes, with why they are refused when set.
_UNSUPPORTED_SETTINGS: tuple[tuple[str, str], ...] = (
    ("use_dora", "DoRA (use_dora) is not supported"),
    ("modules_to_save", "modules_to_save (full copies of base-model modules) is not supported"),
    ("trainable_token_indices", "embedding adapters (trainable_token_indices) are not supported"),
    ("lora_bias", "LoRA biases (lora_bias) are not supported"),
    ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers) is not supported"),
    ("layer_replication", "layer_replication is not supported"),
    ("target_parameters", "target_parameters (adapters on raw parameters) is not supported"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens) is not supported"),
    ("arrow_config", "Arrow routing (arrow_config) is not supported"),
    ("use_qalora", "QA-LoRA (use_qalora) is not supported"),
    ("use_bdlora", "BD-LoRA (use_bdlora) is not supported"),
    ("monteclora_config", "MonteCLoRA (monteclora_config) is not supported"),
    ("kasa_config", "KaSA (kasa_config) is not supported"),
    ("velora_config", "VeLoRA (velora_config) is not supported"),
)


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the reason."""

    def __init__(self, lora_name: str, reason: str) -> None:
        self.lora_name = lora_name
        self.reason = reason
        super().__init__(f"LoRA adapter {lora_name!r} refused: {reason}")


@dataclass(frozen=True)
class FusedModuleShape:
    """One fused projection of the base model: ``in_features`` and its output slices as (offset, size)."""

    in_features: int
    output_slices: tuple[tuple[int, int], ...]

    @property
    def out_features(self) -> int:
        offset, size = self.output_slices[-1]
        return offset + size


@dataclass(frozen=True)
class BaseModelShapes:
    """What an adapter must fit: the decoder's layer count and each fused module's shape (same in every layer)."""

    num_layers: int
    modules: dict[str, FusedModuleShape]  # fused module name ("self_attn.qkv_proj") -> shape


@dataclass(frozen=True)
class LoRASliceWeights:
    """One projection's adapter: delta = (x @ lora_a.T) @ lora_b.T * scale.

    lora_a: [r, in_features]; lora_b: [slice size, r] (float32 or the checkpoint's dtype, on the CPU).
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass(frozen=True)
class LoRAAdapter:
    """A validated adapter. ``weights`` maps (layer, fused module, slice) to that projection's A/B;
    ``rank`` is the largest rank over them. ``digest`` (hex sha256 of every slice's position, scale,
    dtype, shape and A/B bytes) names what the adapter computes, whatever its name, id or path: the
    prefix cache and the KV tiers key blocks by it, so KV kept on disk across restarts is found again
    for the same adapter and never for another one that took its id."""

    lora_request: LoRARequest
    rank: int
    weights: dict[tuple[int, str, int], LoRASliceWeights]
    digest: str = ""

    @property
    def num_bytes(self) -> int:
        return sum(w.lora_a.nbytes + w.lora_b.nbytes for w in self.weights.values())


def load_adapter(lora_request: LoRARequest, shapes: BaseModelShapes, max_lora_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA directory against the base model.

    Supports any subset of q/k/v/o/gate/up/down_proj, per-module ranks (``rank_pattern``) and alphas
    (``alpha_pattern``), ``use_rslora`` (scale alpha / sqrt(r) instead of alpha / r) and
    ``layers_to_transform`` (only some layers hold tensors).

    Raises:
        LoRAAdapterError (a ValueError) naming the adapter and the reason: a missing or unreadable
            directory, config or weights file; a setting listed in ``_UNSUPPORTED_SETTINGS`` (DoRA...);
            an embedding or LM-head adapter; a target module or layer the base model lacks; shapes of
            another base model; a rank above ``max_lora_rank``.
    """
    name = lora_request.lora_name

    def refuse(reason: str) -> LoRAAdapterError:
        return LoRAAdapterError(name, reason)

    path = Path(lora_request.lora_path).expanduser()
    if not path.is_dir():
        raise refuse(f"{str(path)!r} is not a directory (expected a peft save_pretrained directory)")
    config = _read_config(path, refuse)
    tensors = _read_tensors(path, refuse)
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, ab = _parse_key(key, refuse)
        by_module.setdefault(module, {})[ab] = tensor
    if not by_module:
        raise refuse("its weights file holds no lora_A/lora_B tensors")

    lora_alpha = config.get("lora_alpha", 8)
    alpha_pattern = config.get("alpha_pattern") or {}
    use_rslora = bool(config.get("use_rslora", False))
    weights: dict[tuple[int, str, int], LoRASliceWeights] = {}
    for module, pair in sorted(by_module.items()):
        if ".experts." in module or ".shared_expert" in module or module.endswith(".gate"):
            raise refuse(f"it targets {module!r}, a mixture-of-experts router or expert projection; adapters on "
                         "MoE layers are not supported (attention projections q/k/v/o_proj only)")
        match = _LAYER_MODULE.fullmatch(module)
        proj = match["proj"] if match else module.rpartition(".")[2]
        if match is None or proj not in PEFT_TARGETS or f"{match['parent']}.{proj}" != _peft_path(proj):
            raise refuse(f"it targets module {module!r}, which the base model does not have (supported: "
                         f"{', '.join(PEFT_TARGETS)})")
        layer = int(match["layer"])
        if layer >= shapes.num_layers:
            raise refuse(f"it targets layer {layer} but the base model has {shapes.num_layers} layers "
                         "(an adapter for another base model?)")
        if set(pair) != {"A", "B"}:
            raise refuse(f"{module} has lora_{''.join(pair)} but not both lora_A and lora_B")
        fused, shard = PEFT_TARGETS[proj]
        if fused not in shapes.modules:  # e.g. mlp.gate_up_proj of a mixture-of-experts model
            raise refuse(f"it targets {module!r}, but the base model's {fused.partition('.')[0]} is not a dense "
                         f"projection in every layer (mixture of experts): only "
                         f"{', '.join(p for p, (f, _) in PEFT_TARGETS.items() if f in shapes.modules)} can be adapted")
        shape = shapes.modules[fused]
        lora_a, lora_b = pair["A"], pair["B"]
        rank = int(lora_a.shape[0]) if lora_a.dim() == 2 else -1
        size = shape.output_slices[shard][1]
        if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[1] != shape.in_features \
                or lora_b.shape != (size, rank):
            raise refuse(
                f"{module}: lora_A is {list(lora_a.shape)} and lora_B {list(lora_b.shape)}, the base model needs "
                f"[r, {shape.in_features}] and [{size}, r] (an adapter for another base model?)"
            )
        if rank > max_lora_rank:
            raise refuse(f"{module} has rank {rank}, above max_lora_rank {max_lora_rank}")
        if rank == 0:
            raise refuse(f"{module} has rank 0")
        alpha = _pattern_value(alpha_pattern, module, lora_alpha)
        scale = alpha / (math.sqrt(rank) if use_rslora else rank)
        weights[(layer, fused, shard)] = LoRASliceWeights(lora_a.contiguous(), lora_b.contiguous(), float(scale))
    return LoRAAdapter(lora_request, max(w.rank for w in weights.values()), weights, adapter_digest(weights))


def adapter_digest(weights: dict[tuple[int, str, int], LoRASliceWeights]) -> str:
    """Hex sha256 of an adapter's content: each slice's (layer, module, slice), scale, and A/B dtype, shape and bytes."""
    digest = hashlib.sha256()
    for key in sorted(weights):
        w = weights[key]
        digest.update(repr((key, w.scale)).encode())
        for tensor in (w.lora_a, w.lora_b):
            digest.update(repr((str(tensor.dtype), tuple(tensor.shape))).encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


def _peft_path(proj: str) -> str:
    """'q_proj' -> 'self_attn.q_proj': where PEFT finds the projection in a Llama-like layer."""
    return f"{PEFT_TARGETS[proj][0].partition('.')[0]}.{proj}"


def _read_config(path: Path, refuse) -> dict:
    config_path = path / "adapter_config.json"
    if not config_path.is_file():
        raise refuse(f"{str(path)!r} has no adapter_config.json")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise refuse(f"adapter_config.json cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise refuse("adapter_config.json is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise refuse(f"peft_type is {peft_type!r}, not LORA")
    for setting, reason in _UNSUPPORTED_SETTINGS:
        if config.get(setting):
            raise refuse(reason)
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise refuse(f"bias={bias!r} trains base-model biases, which is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a regex string or "all-linear" is judged by the tensors instead
        for target in targets:
            leaf = str(target).rpartition(".")[2]
            if leaf in _EMBEDDING_MODULES:
                raise refuse(f"embedding and LM-head adapters (target module {target!r}) are not supported")
            if leaf not in PEFT_TARGETS:
                raise refuse(f"target module {target!r} is not a module of the base model (supported: "
                             f"{', '.join(PEFT_TARGETS)})")
    for field in ("r", "lora_alpha"):
        value = config.get(field, 8)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise refuse(f"{field} must be a positive number, got {value!r}")
    return config


def _read_tensors(path: Path, refuse) -> dict[str, torch.Tensor]:
    safetensors_path, bin_path = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if safetensors_path.is_file():
            return load_file(str(safetensors_path), device="cpu")
        if bin_path.is_file():
            tensors = torch.load(str(bin_path), map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                raise refuse("adapter_model.bin does not hold a dict of tensors")
            return tensors
    except LoRAAdapterError:
        raise
    except Exception as exc:  # a corrupt file: safetensors and torch raise many types
        raise refuse(f"its weights cannot be read: {str(exc).splitlines()[0][:200]}") from None
    raise refuse(f"{str(path)!r} has neither adapter_model.safetensors nor adapter_model.bin")


def _parse_key(key: str, refuse) -> tuple[str, str]:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' -> ('model.layers.0.self_attn.q_proj', 'A')."""
    if "lora_magnitude_vector" in key:
        raise refuse("DoRA (lora_magnitude_vector) is not supported")
    if "lora_embedding_" in key:
        raise refuse("embedding adapters (lora_embedding_A/B) are not supported")
    match = _KEY.fullmatch(key)
    if match is None:
        raise refuse(f"unexpected tensor {key!r} (only lora_A/lora_B weights of linear projections are served)")
    if match["param"] == "bias":
        raise refuse("LoRA biases (lora_bias) are not supported")
    module = match["module"]
    if module.rpartition(".")[2] in _EMBEDDING_MODULES:
        raise refuse(f"embedding and LM-head adapters ({module}) are not supported")
    return module, match["ab"]


def _pattern_value(pattern: dict, module: str, default):
    """The value of the first ``pattern`` key (a regex) matching the end of ``module`` at a dot boundary, else ``default``."""
    for key, value in pattern.items():
        if re.search(rf"(?:^|\.)(?:{key})$", module):
            return value
    return default
