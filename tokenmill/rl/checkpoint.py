"""Reading a new checkpoint for the served model and checking it against the model's parameters.

All or nothing: the config, every tensor name, shape and dtype are checked before anything is
copied, and a refusal (``WeightUpdateError``, a ValueError naming the request field) lists what
is wrong. Reading runs off the engine thread; only ``copy_into`` writes the served parameters
(engine thread, between steps). Names are Hugging Face checkpoint names, as ``load_weights``
takes them: q/k/v_proj land in row ranges of ``qkv_proj``, gate/up_proj in ``gate_up_proj``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tokenmill.models.llama import _STACKED, head_dim_of
from tokenmill.models.loader import checkpoint_files
from tokenmill.models.registry import get_model_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Checkpoint dtypes a parameter may be filled from (cast to the parameter's dtype, as at load time).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}
_MAX_LISTED = 5  # examples per kind of problem in an error message


class WeightUpdateError(ValueError):
    """New weights that cannot replace the served ones; the served weights are untouched.

    Args:
        message: what is wrong (names the tensors, shapes, dtypes or config keys at fault).
        param: the request field at fault (``model_path``, ``serialized_named_tensors``, ...).
    """

    def __init__(self, message: str, param: str = "model_path") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: parameter ``param_name``, rows ``start : start + size`` of a
    fused parameter (None: the whole parameter); ``shape`` is what the checkpoint tensor must have."""

    param_name: str
    shape: tuple[int, ...]
    start: int | None = None
    size: int | None = None


def weight_targets(model: nn.Module) -> dict[str, Target]:
    """Checkpoint name -> Target for every tensor a full checkpoint of ``model`` holds (fused
    parameters expanded to their q/k/v and gate/up sources; a tied LM head appears once, as
    ``model.embed_tokens.weight``). Call it while the parameters have their real shapes."""
    fused_sources: dict[str, list[tuple[str, int]]] = {}
    for proj, (fused, shard) in _STACKED.items():
        fused_sources.setdefault(fused, []).append((proj, shard))
    targets: dict[str, Target] = {}
    for name, param in model.named_parameters():
        module_path, _, param_name = name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        if leaf in fused_sources:
            module = model.get_submodule(module_path)
            for proj, shard in fused_sources[leaf]:
                start, size = module.offsets[shard], module.output_sizes[shard]
                targets[f"{parent}.{proj}.{param_name}"] = Target(name, (size, *param.shape[1:]), start, size)
        else:
            targets[name] = Target(name, tuple(param.shape))
    return targets


def is_ignored(name: str, tie_word_embeddings: bool) -> bool:
    """Checkpoint tensors ``load_weights`` skips: RoPE ``inv_freq`` buffers, a tied model's ``lm_head.weight``."""
    return "rotary_emb.inv_freq" in name or (tie_word_embeddings and name == "lm_head.weight")


def check_dense(model: nn.Module) -> None:
    """Refuse models whose weights are not plain floating-point parameters (quantized linears).

    Raises:
        WeightUpdateError: a quantized module or a non-float parameter, naming it.
    """
    for name, module in model.named_modules():
        quant = getattr(module, "quant", None)  # a GGUFWeight: blocks kept quantized (--quantization gguf|int8)
        if quant is not None or type(module).__module__.startswith("tokenmill.quantization"):
            kind = quant.describe() if hasattr(quant, "describe") else type(module).__name__
            raise WeightUpdateError(
                f"the served model keeps quantized weights ({name}: {kind}); weight updates copy dense tensors: "
                "start the server with --quantization none")
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            raise WeightUpdateError(f"the served model has a non-float parameter {name} ({param.dtype}); weight "
                                    "updates copy dense tensors: start the server with --quantization none")


def check_tensor_specs(
    targets: dict[str, Target], specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]], tie_word_embeddings: bool,
    partial: bool, param: str = "model_path",
) -> None:
    """Check (name, shape, dtype) of every new tensor against ``targets``.

    ``partial``: only the tensors given are replaced (``update_weights_from_tensor``); otherwise
    every target must be given. Raises WeightUpdateError listing unknown, duplicated, missing,
    misshaped and non-float tensors (up to 5 of each).
    """
    seen: set[str] = set()
    unknown, duplicated, shapes, dtypes = [], [], [], []
    for name, shape, dtype in specs:
        if is_ignored(name, tie_word_embeddings):
            continue
        if name in seen:
            duplicated.append(name)
            continue
        seen.add(name)
        target = targets.get(name)
        if target is None:
            unknown.append(name)
            continue
        if tuple(shape) != target.shape:
            shapes.append(f"{name} has shape {list(shape)}, the model needs {list(target.shape)}")
        if dtype not in FLOAT_DTYPES:
            dtypes.append(f"{name} is {str(dtype).removeprefix('torch.')}")
    missing = [] if partial else sorted(set(targets) - seen)
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors missing ({', '.join(missing[:_MAX_LISTED])})")
    if unknown:
        problems.append(f"{len(unknown)} tensors the model does not have ({', '.join(unknown[:_MAX_LISTED])})")
    if duplicated:
        problems.append(f"tensors given twice ({', '.join(duplicated[:_MAX_LISTED])})")
    if shapes:
        problems.append(f"{len(shapes)} shape mismatches ({'; '.join(shapes[:_MAX_LISTED])})")
    if dtypes:
        problems.append(f"{len(dtypes)} tensors not float32/bfloat16/float16 ({'; '.join(dtypes[:_MAX_LISTED])})")
    if not partial and not seen and not problems:
        problems.append("no tensors")
    if problems:
        raise WeightUpdateError(f"{param}: the new weights do not match the served model: {'; '.join(problems)}; "
                                "nothing was changed", param)


def _config_facts(config: PretrainedConfig) -> dict[str, object]:
    rope = getattr(config, "rope_parameters", None) or {}
    return {
        "architecture": get_model_class(config).__name__,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads or config.num_attention_heads,
        "head_dim": head_dim_of(config),
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "rms_norm_eps": float(config.rms_norm_eps),
        "rope_theta": float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0) or 10000.0)),
        "rope_type": rope.get("rope_type", "default"),
    }


def check_config(served: PretrainedConfig, new: PretrainedConfig, param: str = "model_path") -> None:
    """The new checkpoint's architecture, sizes, norm epsilon and RoPE must equal the served model's.

    Raises:
        WeightUpdateError: naming each differing key with both values.
    """
    try:
        new_facts = _config_facts(new)
    except ValueError as exc:
        raise WeightUpdateError(f"{param}: {exc}", param) from None
    served_facts = _config_facts(served)
    diffs = [f"{k}: served {served_facts[k]!r}, new {new_facts[k]!r}" for k in served_facts
             if served_facts[k] != new_facts[k]]
    if diffs:
        raise WeightUpdateError(f"{param}: the checkpoint's config does not match the served model ({'; '.join(diffs)});"
                                " weights are updated in place, so the architecture and shapes must be the same", param)


def _safetensors_specs(files: list[Path]) -> list[tuple[str, tuple[int, ...], torch.dtype | str]]:
    specs = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor_slice = f.get_slice(name)
                dtype = tensor_slice.get_dtype()
                specs.append((name, tuple(tensor_slice.get_shape()), _SAFETENSORS_DTYPES.get(dtype, dtype)))
    return specs


def resolve_checkpoint(path: str, param: str = "model_path") -> tuple[str, Path]:
    """("safetensors", directory) or ("gguf", file) for a path as ``load_model`` takes it.

    Raises:
        WeightUpdateError: a path that does not exist or holds neither.
    """
    if not isinstance(path, str) or not path:
        raise WeightUpdateError(f"{param} must be a non-empty path string", param)
    resolved = Path(path).expanduser()
    if resolved.is_dir() and not (resolved / "config.json").is_file():
        ggufs = sorted(resolved.glob("*.gguf"))
        if len(ggufs) == 1:
            resolved = ggufs[0]
    if resolved.is_dir():
        return "safetensors", resolved
    if resolved.is_file() and resolved.suffix == ".gguf":
        return "gguf", resolved
    why = "does not exist" if not resolved.exists() else "is neither a model directory nor a .gguf file"
    raise WeightUpdateError(f"{param} {path!r} {why}; give a directory with config.json + *.safetensors "
                            "or a .gguf file of the served architecture", param)


def read_checkpoint(
    path: str, served_config: PretrainedConfig, targets: dict[str, Target], param: str = "model_path",
    use_gguf_cache: bool = False,
) -> dict[str, torch.Tensor]:
    """Read and check a full checkpoint (safetensors directory or GGUF file) for the served model.

    Returns checkpoint name -> CPU tensor (ignored names left out). A safetensors directory is
    checked from its headers before any tensor data is read; a GGUF file is dequantized first.
    ``use_gguf_cache``: go through the per-machine GGUF cache (for the file the engine loaded).
    Blocking; run it off the event loop and off the engine thread.

    Raises:
        WeightUpdateError: a missing path, a different config, or any tensor name/shape/dtype mismatch.
    """
    kind, resolved = resolve_checkpoint(path, param)
    tie = bool(getattr(served_config, "tie_word_embeddings", False))
    if kind == "safetensors":
        from transformers import AutoConfig  # here: it builds transformers' model index, which a start does not need

        try:
            files = checkpoint_files(resolved)
            config = AutoConfig.from_pretrained(str(resolved))
        except (ValueError, OSError) as exc:
            raise WeightUpdateError(f"{param}: {exc}", param) from None
        check_config(served_config, config, param)
        check_tensor_specs(targets, _safetensors_specs(files), tie, partial=False, param=param)
        tensors = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if not is_ignored(name, tie):
                        tensors[name] = f.get_tensor(name)
        return tensors
    from tokenmill.models import gguf_cache, gguf_loader  # needs the `gguf` package, only for GGUF files

    reader = None  # parsing a GGUF's metadata takes seconds: with the cache, only when it lacks something

    def get_reader():
        nonlocal reader
        if reader is None:
            reader = gguf_loader.open_gguf(resolved)
        return reader

    try:
        if use_gguf_cache:
            config = gguf_cache.cached_config(resolved, lambda: gguf_loader.gguf_to_hf_config(get_reader()))
        else:
            config = gguf_loader.gguf_to_hf_config(get_reader())
    except (ValueError, NotImplementedError, OSError) as exc:
        raise WeightUpdateError(f"{param}: {exc}", param) from None
    check_config(served_config, config, param)
    produce = lambda: gguf_loader.iter_gguf_weights(get_reader(), config)  # noqa: E731
    weights = gguf_cache.cached_weights(resolved, produce) if use_gguf_cache else produce()
    try:
        tensors = {name: t for name, t in weights if not is_ignored(name, tie)}
    except ValueError as exc:  # an unexpected GGUF tensor name
        raise WeightUpdateError(f"{param}: {exc}", param) from None
    check_tensor_specs(targets, ((n, tuple(t.shape), t.dtype) for n, t in tensors.items()), tie, False, param)
    return tensors


def copy_into(model: nn.Module, targets: dict[str, Target], tensors: dict[str, torch.Tensor]) -> None:
    """Copy checked tensors into the served parameters (cast to their dtype, moved to their device).
    Engine thread only, between steps; parameters keep their storage (CUDA graphs stay valid)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in tensors.items():
            target = targets[name]
            param = params[target.param_name]
            dest = param if target.start is None else param.narrow(0, target.start, target.size)
            dest.copy_(tensor)
