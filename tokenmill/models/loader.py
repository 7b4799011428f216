"""load_model: turns a local path (HF safetensors directory or .gguf file) or None (the embedded default) into a LoadedModel.

Never downloads: anything that is not an existing local path is rejected with a ValueError.
The model is built with uninitialised storage directly in the target dtype (and, for CUDA,
directly on the device), then filled by ``load_weights``; it ends on the requested device in eval mode.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from tokenmill.csrc_build import NATIVE_BF16_FLAGS_TEXT, cpu_has_native_bf16
from tokenmill.huge_pages import release_freed_heap
from tokenmill.models.default_model import default_model_path
from tokenmill.models.llama import head_dim_of
from tokenmill.models.registry import get_model_class
from tokenmill.runner.kv_cache_sizing import latent_kv_dim

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A ready-to-run model and everything the engine needs around it."""

    model: nn.Module
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerFast
    generation_config: dict[str, Any]
    eos_token_ids: set[int]
    model_path: str
    dtype: torch.dtype
    load_seconds: float = field(default=0.0)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    quantization: str = "none"  # "gguf", "int8" or "none" (tokenmill.quantization)

    @property
    def num_layers(self) -> int:
        """Layers that hold paged KV: all of them, except the linear-attention layers of hybrid models."""
        layer_types = getattr(self.hf_config, "layer_types", None) or []
        return int(self.hf_config.num_hidden_layers) - sum(t == "linear_attention" for t in layer_types)

    @property
    def kv_latent_dim(self) -> int | None:
        """Multi-head latent attention (DeepSeek-V2/V3): the latent width ``kv_lora_rank + qk_rope_head_dim`` each
        token caches per layer; None for other models."""
        return latent_kv_dim(self.hf_config)

    @property
    def kv_planes(self) -> int:
        """Planes of the KV pool: 2 (K and V), or 1 (the latent, read as both) for latent attention."""
        return 1 if self.kv_latent_dim else 2

    @property
    def num_kv_heads(self) -> int:
        """KV heads of the KV cache (1 for latent attention: one latent shared by every query head)."""
        if self.kv_latent_dim:
            return 1
        return int(self.hf_config.num_key_value_heads or self.hf_config.num_attention_heads)

    @property
    def head_dim(self) -> int:
        """Width of one cached vector: the attention head_dim, or the latent width for latent attention."""
        return int(self.kv_latent_dim or head_dim_of(self.hf_config))

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def max_position_embeddings(self) -> int:
        return int(self.hf_config.max_position_embeddings)


def resolve_dtype(dtype: str, checkpoint_dtype: torch.dtype | None, device: torch.device | None = None) -> torch.dtype:
    """Map the user's dtype string to a torch dtype.

    "auto" runs every checkpoint on a CUDA device in bfloat16. On CPU it keeps float32 checkpoints in
    float32, and runs the rest (bf16, fp16, GGUF quantized, unknown) in bfloat16 only where the CPU
    has bf16 arithmetic (``csrc_build.cpu_has_native_bf16``): elsewhere bf16 is emulated and
    torch's bf16 GEMMs are several times slower than float32 ones, so float32 is chosen (logged).

    Raises:
        ValueError: dtype not one of "auto", "float32", "bfloat16".
    """
    if dtype == "auto":
        if device is not None and device.type != "cpu":
            return torch.bfloat16
        if checkpoint_dtype == torch.float32:
            return torch.float32
        if not cpu_has_native_bf16():
            logger.info("dtype auto: float32, because this CPU has no bf16 arithmetic (%s) and emulated bf16 "
                        "is slower; pass --dtype bfloat16 to halve weight memory anyway", NATIVE_BF16_FLAGS_TEXT)
            return torch.float32
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of 'auto', 'float32', 'bfloat16'; got {dtype!r}")
    return _DTYPES[dtype]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build parameters directly in ``dtype`` (no float32 allocation followed by a cast)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _build_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Parameters in ``dtype``, allocated on ``device`` (CPU-computed buffers are moved by ``_finish``)."""
    model_cls = get_model_class(config)
    placement = contextlib.nullcontext() if device.type == "cpu" else device
    with _default_dtype(dtype), placement:
        return model_cls(config)


def _finish(model: nn.Module, device: torch.device) -> nn.Module:
    """Eval mode; on an accelerator, move the buffers built on CPU (RoPE cache) to the device."""
    if device.type != "cpu":
        model = model.to(device)
    return model.eval()


def _checkpoint_dtype(config: PretrainedConfig, files: list[Path]) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    with safe_open(str(files[0]), framework="pt") as f:  # no dtype in config.json: look at a tensor header
        first = next(iter(f.keys()), None)
        if first is None:
            return None
        return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(f.get_slice(first).get_dtype())


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _eos_token_ids(generation_config: dict[str, Any], tokenizer: PreTrainedTokenizerFast) -> set[int]:
    eos = generation_config.get("eos_token_id")
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return {int(i) for i in ids}


def checkpoint_files(path: Path) -> list[Path]:
    """The sorted ``*.safetensors`` files of a Hugging Face model directory.

    Raises:
        ValueError: no config.json, or no safetensors file in ``path``.
    """
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; expected a Hugging Face model directory or a .gguf file")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files (only safetensors checkpoints are supported)")
    return files


def _load_hf_dir(path: Path, dtype: str, device: torch.device, quantization: str | None = None) -> LoadedModel:
    # imported here: the Auto* classes build transformers' whole model index (0.6 s on a Zen 1 EPYC), which a
    # cached GGUF start does not need
    from transformers import AutoConfig, AutoTokenizer

    quantization = resolve_quantization(quantization, "safetensors", device)
    files = checkpoint_files(path)
    config = AutoConfig.from_pretrained(str(path))
    get_model_class(config)  # fail on unsupported architectures before touching weights
    torch_dtype = resolve_dtype(dtype, _checkpoint_dtype(config, files), device)
    model = _build_model(config, torch_dtype, device)
    model.load_weights(_iter_safetensors(files))
    if quantization == "int8":
        from tokenmill.quantization.int8 import quantize_linears_int8

        quantize_linears_int8(model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    gen_path = path / "generation_config.json"
    generation_config = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return LoadedModel(
        model=_finish(model, device),
        hf_config=config,
        tokenizer=tokenizer,
        generation_config=generation_config,
        eos_token_ids=_eos_token_ids(generation_config, tokenizer),
        model_path=str(path),
        dtype=torch_dtype,
        device=device,
        quantization=quantization,
    )


def resolve_quantization(quantization: str | None, file_format: str, device: torch.device) -> str:
    """The weight format a model runs in: None means "gguf" for a GGUF file on CPU (its own blocks, when
    the C kernels can be built here; else "none" with a warning) and "none" otherwise.

    Raises:
        ValueError: an unknown value, "gguf" for a safetensors checkpoint, "int8" for a GGUF file, a
            quantized format on a non-CPU device, or "gguf" asked for where the kernels cannot be built.
    """
    from tokenmill.quantization import QUANTIZATION_METHODS

    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {quantization!r}")
    if quantization is None:
        if file_format != "gguf" or device.type != "cpu":
            return "none"
        from tokenmill.quantization import qgemm

        if not qgemm.available():
            logger.warning("quantization: the GGUF kernels cannot be built here, so the weights are dequantized "
                           "(quantization='none')")
            return "none"
        return "gguf"
    if quantization != "none" and device.type != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on the CPU only; pass quantization='none' on {device}")
    if quantization == "gguf":
        if file_format != "gguf":
            raise ValueError("quantization 'gguf' needs a .gguf model file; use 'int8' or 'none' for a safetensors "
                             "checkpoint")
        from tokenmill.quantization import qgemm

        if not qgemm.available():
            raise ValueError("quantization 'gguf' needs the C kernels, which cannot be built here (no C compiler, "
                             "or TOKENMILL_DISABLE_CPU_KERNELS=1); pass quantization='none'")
    if quantization == "int8" and file_format != "safetensors":
        raise ValueError("quantization 'int8' is for safetensors checkpoints; a GGUF file runs its own blocks "
                         "('gguf') or dequantized ('none')")
    return quantization


def _load_gguf(path: Path, dtype: str, device: torch.device, quantization: str | None = None) -> LoadedModel:
    """Config and tensor index first (from the GGUF cache, else parsed and checked: what the engine cannot
    run fails here, before any weight is read), then the weights while the tokenizer is rebuilt beside them.
    Quantized blocks are mapped from the file in place (``gguf_loader.iter_mapped_weights``)."""
    from tokenmill.models import gguf_cache, gguf_loader  # needs the `gguf` package, only for GGUF files
    from tokenmill.quantization import tile_cache
    from tokenmill.quantization.gguf_weight import tiled_formats

    torch_dtype = resolve_dtype(dtype, None, device)
    quantization = resolve_quantization(quantization, "gguf", device)
    reader = None  # the header (read_gguf_metadata, ~0.1 s): only when the cache lacks something

    def get_reader():
        nonlocal reader
        if reader is None:
            reader = gguf_loader.read_gguf_metadata(path)
        return reader

    config = gguf_cache.cached_config(path, lambda: gguf_loader.gguf_to_hf_config(get_reader()))
    index = gguf_cache.cached_tensor_index(path, lambda: gguf_loader.read_tensor_index(get_reader()))
    reader = None  # the header's mapping goes: each tensor gets its own below
    # transformers rebuilds the tokenizer by re-reading the file's metadata (seconds of Python);
    # overlap that with the weights, which spend their time in numpy/torch kernels and page faults.
    with ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer_future = pool.submit(gguf_cache.cached_tokenizer, path,
                                       lambda: gguf_loader.load_gguf_tokenizer(path))
        model = _build_model(config, torch_dtype, device)
        if quantization == "gguf":  # the file's blocks as they are, no dequantization, no copy
            blocks = gguf_loader.iter_mapped_weights(path, index, config, dense=False)
            dense = lambda: gguf_loader.iter_mapped_weights(path, index, config, quantized=False)  # noqa: E731
            if gguf_loader.needs_dequantization(index):  # block formats without a kernel: dequantized once
                weights = itertools.chain(blocks, gguf_cache.cached_weights(path, dense, "dense.safetensors"))
            else:
                weights = itertools.chain(blocks, dense())
            # the tiled layout of the blocks: repacked on the first load, then mapped from the cache entry
            with tile_cache.active(gguf_cache.tile_directory(path), tiled_formats()):
                model.load_weights(weights)
        else:
            model.load_weights(gguf_cache.cached_weights(
                path, lambda: gguf_loader.iter_mapped_weights(path, index, config, kept=set())))
        tokenizer = tokenizer_future.result()
    return LoadedModel(
        model=_finish(model, device),
        hf_config=config,
        tokenizer=tokenizer,
        generation_config={},
        eos_token_ids=_eos_token_ids({}, tokenizer),
        model_path=str(path),
        dtype=torch_dtype,
        device=device,
        quantization=quantization,
    )


def _looks_like_a_path(model: str) -> bool:
    """True for a model argument that can only be a file system path (not a hub id like ``org/name``): an
    absolute or home- or dot-relative path, or a name ending in .gguf / .safetensors."""
    return model.startswith(("/", "~", "./", "../")) or model.endswith((".gguf", ".safetensors"))


def load_model(
    model: str | None, dtype: str = "auto", device: torch.device | str = "cpu", quantization: str | None = None,
) -> LoadedModel:
    """Load a model from a local path; ``None`` means the embedded SmolLM2-135M-Instruct GGUF.

    Args:
        model: None, a directory with config.json + *.safetensors (+ tokenizer files,
            generation_config.json), a path to a .gguf file, or a directory holding exactly one
            .gguf file (and no config.json).
        dtype: "auto" (``resolve_dtype``: float32 for float32 checkpoints; bfloat16 for the rest on
            CUDA and on CPUs with bf16 arithmetic, float32 on other CPUs), "float32" or "bfloat16".
        device: where the weights live ("cpu", or a CUDA device, where "auto" means bfloat16).
        quantization: "gguf" (a GGUF file's quantized matrices run as stored; the default for GGUF
            files on CPU), "int8" (weight-only int8 with per-channel scales, safetensors checkpoints),
            "none" (dense weights in ``dtype``) or None for the default (``resolve_quantization``).
            ``dtype`` still chooses the activations' type.
    Raises:
        ValueError: a bad dtype, a path that does not exist (tokenmill never downloads), a
            directory without config.json/safetensors, an unsupported architecture.
        UnsupportedModelError (a ValueError): a GGUF file holding what tokenmill cannot run (architecture,
            tensor type or name, RoPE variant, tokenizer), named with the file and the key or tensor.
        NotImplementedError: model features tokenmill cannot run (e.g. an unsupported RoPE variant).
        FileNotFoundError: model is None and the default-model package is not installed.
    """
    start = time.perf_counter()
    if dtype not in ("auto", *_DTYPES):
        raise ValueError(f"dtype must be one of 'auto', 'float32', 'bfloat16'; got {dtype!r}")
    device = torch.device(device)
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        gguf_files = sorted(path.glob("*.gguf"))
        if len(gguf_files) == 1:  # a directory holding just one GGUF file means that file
            path = gguf_files[0]
        elif gguf_files:
            names = ", ".join(f.name for f in gguf_files[:8]) + (", ..." if len(gguf_files) > 8 else "")
            raise ValueError(f"{path} holds {len(gguf_files)} GGUF files and no config.json: pass one of them "
                             f"as the model ({names})")
    if path.is_dir():
        loaded = _load_hf_dir(path, dtype, device, quantization)
    elif path.is_file() and path.suffix == ".gguf":
        loaded = _load_gguf(path, dtype, device, quantization)
    elif path.is_file():
        raise ValueError(f"model file {str(path)!r} is not a .gguf file; pass a .gguf file or a model directory")
    elif _looks_like_a_path(str(model)):
        raise ValueError(f"model path {str(path)!r} does not exist")
    else:
        raise ValueError(
            f"model {model!r} is not a local path. tokenmill never downloads models: pass a local directory "
            "holding config.json + *.safetensors (+ tokenizer files), or a .gguf file path. For a Hugging Face "
            f"hub model, download it first (e.g. `huggingface-cli download {model} --local-dir ./{Path(str(model)).name}`) "
            "and pass that directory."
        )
    if device.type == "cpu":
        release_freed_heap()  # the load's freed temporaries back to the system
    loaded.load_seconds = time.perf_counter() - start
    return loaded
