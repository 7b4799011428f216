"""A per-machine cache of what a GGUF file turns into: its dequantized, HF-named tensors (one
safetensors file), its quantized ones (the blocks as uint8 rows, their formats in the file's metadata),
its config (``config.json``) and its tokenizer (``save_pretrained``), so a second load of the same
file skips parsing the GGUF metadata, dequantizing in numpy and rebuilding the tokenizer (seconds each).

Keyed by the file's resolved path, size and modification time, under
``$TOKENMILL_CACHE_DIR/gguf`` (default ``~/.cache/tokenmill/gguf``). Entries are written to a
temporary directory and renamed into place, so a reader never sees half an entry; a directory that
cannot be written only costs the speed-up (logged once).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where weights are read or written: the router reads tokenizers without it
    import torch

logger = logging.getLogger(__name__)

# Bump when what the loader yields for a GGUF file changes (names, layouts, dequantization).
CACHE_VERSION = 1  # the quantized entry and the config were added beside the version-1 files
_WEIGHTS = "model.safetensors"
_QUANTIZED = "quantized.safetensors"
_CONFIG = "config"
_TOKENIZER = "tokenizer"


def cache_root() -> Path:
    """``$TOKENMILL_CACHE_DIR/gguf``, default ``~/.cache/tokenmill/gguf``."""
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")
    return Path(root) / "gguf"


def entry_dir(path: Path) -> Path:
    """The cache entry of one GGUF file version (path, size and mtime in the key)."""
    stat = path.stat()
    key = f"{CACHE_VERSION}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return cache_root() / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def cached_weights(path: Path, produce: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for a GGUF file: from the cache when present, else from ``produce()``
    (then stored for next time). The tensors are exactly those ``produce`` yields."""
    from safetensors.torch import load_file, save_file

    entry = entry_dir(path)
    weights = entry / _WEIGHTS
    if weights.is_file():
        yield from load_file(str(weights)).items()
        return
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in produce():
        tensors[name] = tensor
        yield name, tensor
    _store(entry, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / _WEIGHTS)), _WEIGHTS)


def cached_quantized_weights(path: Path,
                             produce: Callable[[], Iterator[tuple[str, object]]]) -> Iterator[tuple[str, object]]:
    """Like ``cached_weights`` for a loader that yields ``tokenmill.quantization.QuantizedTensor``s
    beside float tensors: both come back exactly (formats and logical shapes kept in the metadata)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tokenmill.quantization.formats import QuantizedTensor

    weights = entry_dir(path) / _QUANTIZED
    if weights.is_file():
        with safe_open(str(weights), framework="pt") as f:
            meta = f.metadata() or {}
            for name in f.keys():
                tensor = f.get_tensor(name)
                if name in meta:
                    qtype, n, k = (int(v) for v in meta[name].split(","))
                    yield name, QuantizedTensor(qtype, (n, k), tensor)
                else:
                    yield name, tensor
        return
    tensors, meta = {}, {}
    for name, tensor in produce():
        if isinstance(tensor, QuantizedTensor):
            tensors[name] = tensor.data
            meta[name] = f"{tensor.qtype},{tensor.shape[0]},{tensor.shape[1]}"
        else:
            tensors[name] = tensor
        yield name, tensor
    _store(entry_dir(path), lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()},
                                                  str(tmp / _QUANTIZED), metadata=meta), _QUANTIZED)


def cached_config(path: Path, produce: Callable[[], object]):
    """The GGUF file's transformers config: reloaded from the cache when present, else ``produce()``
    (then saved for next time)."""
    from transformers import AutoConfig

    saved = entry_dir(path) / _CONFIG
    if (saved / "config.json").is_file():
        return AutoConfig.from_pretrained(str(saved))
    config = produce()
    _store(entry_dir(path), lambda tmp: config.save_pretrained(str(tmp / _CONFIG)), _CONFIG)
    return config


def cached_tokenizer(path: Path, produce: Callable[[], object]):
    """The GGUF file's tokenizer: reloaded from the cache when present, else ``produce()`` (then
    saved with ``save_pretrained`` for next time)."""
    from transformers import AutoTokenizer

    saved = entry_dir(path) / _TOKENIZER
    if saved.is_dir():
        return AutoTokenizer.from_pretrained(str(saved))
    tokenizer = produce()
    _store(entry_dir(path), lambda tmp: tokenizer.save_pretrained(str(tmp / _TOKENIZER)), _TOKENIZER)
    return tokenizer


def _store(entry: Path, write: Callable[[Path], object], name: str) -> None:
    """Write ``name`` into ``entry`` through a temporary directory and an atomic rename."""
    try:
        entry.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry, prefix=".tmp-"))
        try:
            write(tmp)
            os.replace(tmp / name, entry / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        logger.warning("GGUF cache: could not write %s (%s); the next load parses the file again", entry / name, exc)
