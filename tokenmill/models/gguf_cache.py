"""A per-machine cache of what a GGUF file turns into: its dequantized, HF-named tensors (safetensors:
all of them for the dense path, ``model.safetensors``; for the quantized path only the tensors in block
formats tokenmill does not run natively, ``dense.safetensors``), its tensor index (``tensors.json``: where
each tensor's bytes are, so the quantized blocks are mapped from the file without parsing its metadata),
its config (``config.json``) and its tokenizer (``save_pretrained``), so a second load of the same file
skips parsing the GGUF metadata, dequantizing in numpy and rebuilding the tokenizer (seconds each). The
quantized blocks themselves are never copied here: they are used in place from the memory-mapped file.

Keyed by the file's resolved path, size and modification time, under
``$TOKENMILL_CACHE_DIR/gguf`` (default ``~/.cache/tokenmill/gguf``). Entries are written to a
temporary directory and renamed into place, so a reader never sees half an entry; a directory that
cannot be written only costs the speed-up (logged once).

Each entry records its file (``source.json``: resolved path, size, modification time). When a new entry is
made, the entries whose file is gone or has changed since are removed, as are entries without the record
(written by an older tokenmill): a file moved, replaced or reinstalled (a new virtual environment holding the
embedded model) would otherwise leave a copy of its repacked tiles behind each time, without bound.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill import envs
from tokenmill.light_tokenizer import LIGHT_CLASSES, open_light_tokenizer

if TYPE_CHECKING:  # torch only where weights are read or written: the router reads tokenizers without it
    import torch

logger = logging.getLogger(__name__)

# Bump when what the loader yields for a GGUF file changes (names, layouts, dequantization).
CACHE_VERSION = 3  # 2: no quantized-blocks copy (mapped in place), a tensor index, rope_freqs in the config;
# 3: tokenizers split text as llama.cpp for tokenizer.ggml.pre, phi3 longrope factors in the config
_WEIGHTS = "model.safetensors"
_TENSORS = "tensors.json"
_CONFIG = "config"
_TOKENIZER = "tokenizer"
_PLAIN_ATTRIBUTES = "config-attributes.json"  # a plain config's attributes (PlainConfig)
_SOURCE = "source.json"  # the entry's file: resolved path, size, mtime (what the key hashes)
_NEW_PREFIX = ".new-"  # an entry being made (cache_root/.new-*), renamed into place with its source.json


def cache_root() -> Path:
    """``$TOKENMILL_CACHE_DIR/gguf``, default ``~/.cache/tokenmill/gguf``."""
    return envs.cache_dir() / "gguf"


def _source_record(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def entry_dir(path: Path) -> Path:
    """The cache entry of one GGUF file version (path, size and mtime in the key). Only names it: see
    ``claimed_entry`` for the directory a writer uses."""
    record = _source_record(path)
    key = f"{CACHE_VERSION}|{record['path']}|{record['size']}|{record['mtime_ns']}"
    return cache_root() / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def claimed_entry(path: Path) -> Path:
    """``entry_dir(path)``, made if absent: created whole with its ``source.json`` (a temporary directory renamed
    into place, so no entry is ever seen without its record), then the stale entries pruned (``prune_stale``).
    An entry of an older tokenmill that is still in use gets its record here.

    Raises:
        OSError: the cache directory cannot be written (callers log it and go on without the cache).
    """
    entry = entry_dir(path)
    if (entry / _SOURCE).is_file():
        return entry
    text = json.dumps(_source_record(path))
    if entry.is_dir():  # an older tokenmill's entry, still in use: record its file
        _write_into(entry, lambda tmp: (tmp / _SOURCE).write_text(text), _SOURCE)
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=_NEW_PREFIX))
    try:
        (tmp / _SOURCE).write_text(text)
        try:
            os.rename(tmp, entry)
        except OSError:  # another process made it first
            if not entry.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune_stale(keep=entry)
    return entry


def tile_directory(path: Path) -> Path:
    """Where the tile cache of GGUF file ``path`` lives: its claimed entry (``entry_dir(path)`` when the cache
    cannot be written; the tile cache then logs that and repacks in memory)."""
    try:
        return claimed_entry(path)
    except OSError:
        return entry_dir(path)


def prune_stale(keep: Path | None = None) -> list[Path]:
    """Remove the cache entries whose GGUF file is gone or has changed (size or modification time) since the entry
    was made, entries without a ``source.json`` (an older tokenmill's), and ``.new-*`` directories of makers that
    died over an hour ago. A process still serving from a removed entry keeps its mapped tiles (Linux frees them
    at the last unmap). Returns the directories removed."""
    removed = []
    try:
        children = list(cache_root().iterdir())
    except OSError:
        return removed
    for child in children:
        if child == keep or not child.is_dir():
            continue
        try:
            if child.name.startswith(_NEW_PREFIX):
                stale = time.time() - child.stat().st_mtime > 3600
            elif child.name.startswith("."):
                continue
            else:
                stale = _stale(child)
        except OSError:
            continue
        if stale:
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    if removed:
        logger.info("GGUF cache: removed %d entr%s of files gone or changed: %s", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(p.name for p in removed))
    return removed


def _stale(entry: Path) -> bool:
    try:
        record = json.loads((entry / _SOURCE).read_text())
        source = Path(record["path"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):  # no record (an older tokenmill's), or a damaged one
        return True
    try:
        stat = source.stat()
    except FileNotFoundError:
        return True
    return (stat.st_size, stat.st_mtime_ns) != (record.get("size"), record.get("mtime_ns"))


def cached_weights(path: Path, produce: Callable[[], Iterator[tuple[str, torch.Tensor]]],
                   file: str = _WEIGHTS) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for a GGUF file: from the cache entry's ``file`` when present, else from
    ``produce()`` (then stored for next time). The tensors are exactly those ``produce`` yields."""
    from safetensors.torch import load_file, save_file

    entry = entry_dir(path)
    weights = entry / file
    if weights.is_file():
        yield from load_file(str(weights)).items()
        return
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in produce():
        tensors[name] = tensor
        yield name, tensor
    _store(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / file)), file)


def cached_tensor_index(path: Path, produce: Callable[[], list]) -> list:
    """The GGUF file's tensor index (``gguf_metadata.GGUFTensorInfo``: name, type, shape, byte offset and
    size; what mapping the quantized blocks in place needs): reloaded from the cache when present (a small
    JSON file, no metadata parse), else ``produce()`` (then saved for next time)."""
    from tokenmill.models.gguf_metadata import GGUFTensorInfo

    saved = entry_dir(path) / _TENSORS
    if saved.is_file():
        try:
            return [GGUFTensorInfo(e["name"], e["qtype"], tuple(e["shape"]), e["offset"], e["nbytes"])
                    for e in json.loads(saved.read_text())]
        except (ValueError, KeyError, TypeError, OSError) as exc:
            _discard(saved, exc)
    index = produce()
    text = json.dumps([dataclasses.asdict(info) for info in index])
    _store(path, lambda tmp: (tmp / _TENSORS).write_text(text), _TENSORS)
    return index


# model types whose transformers config class adds nothing to PretrainedConfig that the models read: no
# attribute_map aliases, no properties, no to_dict or RoPE conversion of its own (tests/test_gguf_cache.py
# checks each against its class). A cached config of these is rebuilt as a plain config (``plain_config``).
PLAIN_CONFIG_TYPES = ("llama", "qwen2", "qwen3")


def plain_config(fields: dict):
    """``fields`` (a config's full ``to_dict()``, as ``save_pretrained`` writes it) as a ``PretrainedConfig``
    whose class carries only the model type: the same attributes as the model type's own class, without
    importing that class. Importing any concrete transformers config class imports transformers'
    activations and with them torch.distributed.tensor and sympy: about 0.65 s of a cached start on a Xeon,
    2 s on a Zen 1 EPYC.

    Raises:
        ValueError: ``fields["model_type"]`` is not one of ``PLAIN_CONFIG_TYPES``.
    """
    model_type = fields.get("model_type")
    if model_type not in PLAIN_CONFIG_TYPES:
        raise ValueError(f"no plain config for model type {model_type!r} (only {', '.join(PLAIN_CONFIG_TYPES)})")
    config = _plain_config_class(model_type)(**{k: v for k, v in fields.items() if k != "model_type"})
    # a field of these classes (default True); PretrainedConfig itself takes it for a generation setting and drops it
    config.use_cache = fields.get("use_cache", True)
    return config


def class_config(config):
    """``config`` as its transformers class builds it: a plain config converted back (for transformers code that
    looks the class up, e.g. ``AutoModelForCausalLM.from_config``); any other config returned as it is."""
    if isinstance(config, PlainConfig):
        return config.as_transformers()
    if not isinstance(config, _plain_config_base()):
        return config
    from transformers import AutoConfig

    fields = config.to_dict()
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


class PlainConfig:
    """A cached config of a ``PLAIN_CONFIG_TYPES`` model, built without importing transformers (whose import
    scans every model module: about 1 s of a cached start on a Zen 1 EPYC): the instance attributes of the
    config that transformers built at the first load, and its ``to_dict()``, both saved beside config.json
    (``config-attributes.json``). The models read attributes only; ``to_dict`` feeds the KV disk tier's
    fingerprint, so it equals the transformers config's.

    Args:
        model_type: the config's ``model_type`` (a class attribute in transformers, so not among ``attributes``).
        attributes: ``vars(config)``, every value JSON-representable.
        as_dict: ``config.to_dict()``.
    """

    __slots__ = ("__dict__", "_as_dict", "model_type")

    def __init__(self, model_type: str, attributes: dict, as_dict: dict) -> None:
        self.__dict__.update(attributes)
        self._as_dict = as_dict
        self.model_type = model_type

    def to_dict(self) -> dict:
        """The transformers config's ``to_dict()`` (a deep copy)."""
        return _label_ids(json.loads(json.dumps(self._as_dict)))

    def get_text_config(self, *args, **kwargs) -> PlainConfig:
        """This config (none of the plain types is composite), as transformers' method answers for them."""
        return self

    def as_transformers(self):
        """The config as its transformers class builds it (imports transformers)."""
        from transformers import AutoConfig

        fields = self.to_dict()
        return AutoConfig.for_model(fields.pop("model_type"), **fields)

    def __repr__(self) -> str:
        return f"PlainConfig({self.model_type!r}, {len(self.__dict__)} attributes)"


def _plain_attributes(config) -> dict | None:
    """What ``config-attributes.json`` holds for ``config`` (``model_type``, ``attributes``, ``to_dict``, and the
    installed ``transformers`` version that built them: another version's are not reused), or
    None when an attribute would not come back from JSON equal (then the config is not cached this way)."""
    attributes, as_dict = dict(vars(config)), config.to_dict()
    record = {"model_type": config.model_type, "attributes": attributes, "to_dict": as_dict,
              "transformers": _installed_transformers()}
    try:
        back = json.loads(json.dumps(record))
    except (TypeError, ValueError):
        return None
    same = _label_ids(back["attributes"]) == attributes and _label_ids(back["to_dict"]) == as_dict
    return back if same else None


def _label_ids(fields: dict) -> dict:
    """``fields`` with its ``id2label`` keys back to ints (JSON object keys are strings); in place."""
    id2label = fields.get("id2label")
    if isinstance(id2label, dict):
        fields["id2label"] = {int(k): v for k, v in id2label.items()}
    return fields


def _read_plain(entry: Path) -> PlainConfig | None:
    """The entry's ``config-attributes.json`` as a :class:`PlainConfig`, or None where it is absent.

    Raises:
        ValueError, KeyError, TypeError: a damaged file (the caller rebuilds the entry)."""
    saved = entry / _PLAIN_ATTRIBUTES
    if not saved.is_file():
        return None
    record = json.loads(saved.read_text())
    if not isinstance(record, dict):
        raise ValueError(f"{_PLAIN_ATTRIBUTES} is not a JSON object")
    attributes, as_dict = record["attributes"], record["to_dict"]
    if not isinstance(attributes, dict) or not isinstance(as_dict, dict) or record["model_type"] not in PLAIN_CONFIG_TYPES:
        raise ValueError(f"{_PLAIN_ATTRIBUTES} does not describe a plain config")
    if record.get("transformers") != _installed_transformers() or record["transformers"] is None:
        return None  # another transformers built those attributes: once through it again (cached_config)
    return PlainConfig(record["model_type"], _label_ids(attributes), as_dict)


@functools.cache
def _installed_transformers() -> str | None:
    """The installed transformers' version, from its dist-info directory's name (without importing it, or
    importlib.metadata: 70 ms on a slow machine); None when not found."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return None
    for info in Path(spec.origin).parent.parent.glob("transformers-*.dist-info"):
        return info.name[len("transformers-"):-len(".dist-info")]
    return None


def _store_plain(path: Path, config) -> None:
    """Save ``config`` (of a plain type) as ``config-attributes.json`` in GGUF file ``path``'s entry, if its
    attributes survive JSON."""
    record = _plain_attributes(config)
    if record is not None:
        _store(path, lambda tmp: (tmp / _PLAIN_ATTRIBUTES).write_text(json.dumps(record)), _PLAIN_ATTRIBUTES)


@functools.cache
def _plain_config_base():
    """The base class of every transformers-built plain config (``class_config`` tells them by it)."""
    from transformers import PretrainedConfig

    return type("PlainConfig", (PretrainedConfig,), {})


@functools.cache
def _plain_config_class(model_type: str):
    return type(f"PlainConfig_{model_type}", (_plain_config_base(),), {"model_type": model_type})


def cached_config(path: Path, produce: Callable[[], object]):
    """The GGUF file's transformers config: reloaded from the cache when present, else ``produce()`` (then
    saved for next time). A cached config of the ``PLAIN_CONFIG_TYPES`` comes back as a :class:`PlainConfig`
    without importing transformers (entries written before ``config-attributes.json`` existed: once through
    ``plain_config``, which then writes it); any other through ``AutoConfig``."""
    entry = entry_dir(path)
    saved = entry / _CONFIG
    if (saved / "config.json").is_file():
        try:
            fields = json.loads((saved / "config.json").read_text())  # read even where unused: a damaged entry
            if not isinstance(fields, dict):                          # is rebuilt whole
                raise ValueError("config.json is not a JSON object")
            plain = _read_plain(entry) if fields.get("model_type") in PLAIN_CONFIG_TYPES else None
            if plain is not None:
                return plain
            if fields.get("model_type") in PLAIN_CONFIG_TYPES:
                config = plain_config(fields)
                _store_plain(path, config)
                return config
            from transformers import AutoConfig

            return AutoConfig.from_pretrained(str(saved))
        except (ValueError, KeyError, TypeError, OSError) as exc:
            _discard(entry / _PLAIN_ATTRIBUTES, exc)
            _discard(saved, exc)
    config = produce()
    _store(path, lambda tmp: config.save_pretrained(str(tmp / _CONFIG)), _CONFIG)
    if getattr(config, "model_type", None) in PLAIN_CONFIG_TYPES:
        _store_plain(path, config)
    return config


def cached_tokenizer(path: Path, produce: Callable[[], object]):
    """The GGUF file's tokenizer: reloaded from the cache when present, else ``produce()`` (then
    saved with ``save_pretrained`` for next time)."""
    saved = entry_dir(path) / _TOKENIZER
    if saved.is_dir():
        try:
            light = open_light_tokenizer(saved)  # served without importing transformers (tokenmill/light_tokenizer.py)
            return light if light is not None else _tokenizer_class(saved).from_pretrained(str(saved))
        except (ValueError, KeyError, TypeError, OSError) as exc:
            _discard(saved, exc)
    tokenizer = produce()
    _store(path, lambda tmp: tokenizer.save_pretrained(str(tmp / _TOKENIZER)), _TOKENIZER)
    try:  # the first load serves what every later one does
        light = open_light_tokenizer(saved)
    except (ValueError, OSError) as exc:
        logger.warning("GGUF cache: %s cannot be read back (%s); serving transformers' tokenizer", saved, exc)
        light = None
    return tokenizer if light is None else light


def _tokenizer_class(saved: Path):
    """The class that reloads a saved tokenizer: ``PreTrainedTokenizerFast`` (transformers'
    ``TokenizersBackend``) when the saved tokenizer_config.json names that class, as it does for the llama
    model type's GGUF tokenizers (Llama 3 and SmolLM2 files among them), or ``Qwen2Tokenizer`` (whose class
    would replace the saved pipeline, llama.cpp's split for the file, with its own: see
    ``tokenmill.light_tokenizer``), else ``AutoTokenizer`` (Gemma's are saved as their own class, whose module
    sits behind transformers' index of every model: 0.6 s of a cached start on a Zen 1 EPYC).

    Raises:
        ValueError: tokenizer_config.json is not a JSON object (the caller rebuilds the entry).
    """
    from transformers import PreTrainedTokenizerFast

    config_file = saved / "tokenizer_config.json"
    fields = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if not isinstance(fields, dict):
        raise ValueError("tokenizer_config.json is not a JSON object")
    named = fields.get("tokenizer_class")
    if named in LIGHT_CLASSES:
        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def _discard(saved: Path, exc: BaseException) -> None:
    """Remove a cache item that cannot be read back (a damaged disk, an edit by hand), so it is rebuilt
    from the GGUF file and stored again."""
    logger.warning("GGUF cache: %s cannot be read (%s); rebuilding it from the file", saved, exc)
    if saved.is_dir():
        shutil.rmtree(saved, ignore_errors=True)
    else:
        saved.unlink(missing_ok=True)


def _store(path: Path, write: Callable[[Path], object], name: str) -> None:
    """Write ``name`` into the entry of GGUF file ``path`` (``claimed_entry``) through a temporary directory and an
    atomic rename."""
    try:
        _write_into(claimed_entry(path), write, name)
    except OSError as exc:
        logger.warning("GGUF cache: could not write %s (%s); the next load parses the file again", name, exc)


def _write_into(entry: Path, write: Callable[[Path], object], name: str) -> None:
    """``write(tmp)`` makes ``tmp / name`` in a temporary directory inside ``entry``; it is then renamed to
    ``entry / name`` (atomic: a reader sees the old item or the whole new one).

    Raises:
        OSError: the directory or the item cannot be written.
    """
    tmp = Path(tempfile.mkdtemp(dir=entry, prefix=".tmp-"))
    try:
        write(tmp)
        os.replace(tmp / name, entry / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
