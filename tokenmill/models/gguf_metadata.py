"""A fast reader of a GGUF file's header: its metadata key/values and where each tensor's bytes are.

What ``gguf.GGUFReader`` parses too, in a fraction of the time: the package builds numpy views for every
string of the tokenizer's arrays (about 7 s of Python for a 49 k-token vocabulary on a 2-core box); here
scalars and numeric arrays are read with ``struct``/``numpy`` and strings decoded once (~0.1 s). Reads only
the header; the tensor data stays on disk (``gguf_loader`` maps it). Imports numpy and ``gguf``'s
constants, no torch.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenmill.models.errors import UnsupportedModelError

# GGUF value type id -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KNOWN_TYPE_IDS = frozenset(int(t) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES)


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor's bytes are in a GGUF file: ``name`` (GGUF), ``qtype`` (ggml type id), ``shape`` in
    PyTorch order (``[out_features, in_features]`` for a matrix), ``offset`` (absolute, bytes) and ``nbytes``."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF header: ``fields`` (key -> value: str, int, float, bool, or a list for arrays), ``tensors``
    (in file order) and the file it came from (``source``)."""

    source: Path
    fields: dict[str, Any]
    tensors: list[GGUFTensorInfo]


def read_gguf_metadata(path: Path) -> GGUFMetadata:
    """Parse a GGUF file's header (versions 2 and 3).

    Raises:
        UnsupportedModelError: not a GGUF file (magic, version, truncated), or a tensor whose type id
            neither tokenmill nor the gguf package knows (named).
    """
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise UnsupportedModelError(f"{path}: empty file (not a GGUF file)")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(path, buf)
    except UnsupportedModelError:
        raise
    except struct.error as exc:  # a read past the end of the mapping: the header stops early
        raise UnsupportedModelError(f"{path}: the file ends inside its GGUF header ({size} bytes): truncated "
                                    f"(an interrupted download?)") from exc
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        raise UnsupportedModelError(f"{path}: not a GGUF file tokenmill can read "
                                    f"({type(exc).__name__}: {exc})") from exc


def _parse(path: Path, buf: mmap.mmap) -> GGUFMetadata:
    if buf[:4] != b"GGUF":
        raise UnsupportedModelError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
    version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    offset = 24

    def read_string() -> str:
        nonlocal offset
        (length,) = struct.unpack_from("<Q", buf, offset)
        text = buf[offset + 8:offset + 8 + length].decode("utf-8", "replace")
        offset += 8 + length
        return text

    def read_value(value_type: int) -> Any:
        nonlocal offset
        if value_type == _STRING:
            return read_string()
        if value_type == _ARRAY:
            item_type, count = struct.unpack_from("<IQ", buf, offset)
            offset += 12
            if item_type in _SCALARS:  # numeric arrays in one numpy read
                dtype = np.dtype(_SCALARS[item_type].replace("?", "b1"))
                values = np.frombuffer(buf, dtype=dtype, count=count, offset=offset).tolist()
                offset += dtype.itemsize * count
                return values
            return [read_value(item_type) for _ in range(count)]
        if value_type not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {value_type} at byte {offset}")
        fmt = _SCALARS[value_type]
        (value,) = struct.unpack_from(fmt, buf, offset)
        offset += struct.calcsize(fmt)
        return value

    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = read_string()
        (value_type,) = struct.unpack_from("<I", buf, offset)
        offset += 4
        fields[key] = read_value(value_type)
    raw = []
    for _ in range(n_tensors):
        name = read_string()
        (n_dims,) = struct.unpack_from("<I", buf, offset)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, offset + 4)
        type_id, data_offset = struct.unpack_from("<IQ", buf, offset + 4 + 8 * n_dims)
        offset += 4 + 8 * n_dims + 12
        if type_id not in _KNOWN_TYPE_IDS:
            raise UnsupportedModelError(f"{path}: tensor {name!r} has tensor type id {type_id}, which neither "
                                        "tokenmill nor the gguf package knows")
        raw.append((name, type_id, dims, data_offset))
    alignment = int(fields.get("general.alignment", 32))
    start = (offset + alignment - 1) // alignment * alignment
    tensors = []
    for name, type_id, dims, data_offset in raw:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        nbytes = n_elements // block * type_size
        if start + data_offset + nbytes > len(buf):
            raise UnsupportedModelError(f"{path}: tensor {name!r} ends past the end of the file (truncated?)")
        shape = tuple(int(d) for d in reversed(dims))  # GGUF lists dims innermost first
        tensors.append(GGUFTensorInfo(name, type_id, shape, start + data_offset, nbytes))
    return GGUFMetadata(path, fields, tensors)
