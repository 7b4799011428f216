"""The GGUF block formats tokenmill runs without dequantizing, and the tensor that carries them.

Block layouts follow the GGUF file format (ggml type ids, block sizes and bytes per block below);
the kernels in ``csrc/`` read them (``qg_formats.h``). Q4_0, Q4_1 and Q8_0 also have a tiled layout (type id + ``TILED``): the
same bytes regrouped at load by ``qgemm.repack`` into tiles of ``TILE_ROWS`` rows for the SIMD
kernels (described in csrc/qg_tiles.h), and so do the other formats (csrc/qg_tiles_kq.h). Pure
metadata: no kernels here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# ggml type id -> (name, weights per block, bytes per block)
GGUF_QUANT_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    20: ("IQ4_NL", 32, 18),
    23: ("IQ4_XS", 256, 136),
}
# --quantization values: "gguf" (a GGUF file's own blocks, the default for GGUF models), "int8"
# (weight-only int8 with per-output-channel scales, for HF checkpoints), "none" (dense weights).
QUANTIZATION_METHODS: tuple[str, ...] = ("gguf", "int8", "none")
TILED = 256  # added to a format's type id: its tiled layout (csrc/qg_tiles.h's QG_TILED)
TILE_ROWS = 16  # weight rows per tile of the tiled layout (csrc/qg_tiles.h's TP)
# the formats with a tiled layout: Q4_0, Q4_1, Q8_0 (qg_tiles.h) and the others (qg_tiles_kq.h)
TILED_FORMATS: tuple[int, ...] = (2, 3, 8, 6, 7, 10, 11, 12, 13, 14, 20, 23)
AMX_TILED_FORMATS: tuple[int, ...] = (2, 3, 8)  # the tiled formats with AMX int8 and AMX bf16 products


def base_qtype(qtype: int) -> int:
    """The GGUF format of a type id: ``qtype`` itself, or the format a tiled id (format + TILED) lays out."""
    return qtype - TILED if qtype - TILED in TILED_FORMATS else qtype


def is_tiled(qtype: int) -> bool:
    """True for the type id of a tiled layout."""
    return qtype - TILED in TILED_FORMATS


def qtype_name(qtype: int) -> str:
    """"Q4_1" for 3 (and for its tiled id), etc.; ValueError for a type tokenmill does not run quantized."""
    qtype = base_qtype(qtype)
    if qtype not in GGUF_QUANT_TYPES:
        raise ValueError(f"GGUF type {qtype} is not a supported quantized format "
                         f"({', '.join(n for n, _, _ in GGUF_QUANT_TYPES.values())})")
    return GGUF_QUANT_TYPES[qtype][0]


def block_size(qtype: int) -> int:
    """Weights per block (32, or 256 for the K-quants)."""
    qtype_name(qtype)
    return GGUF_QUANT_TYPES[base_qtype(qtype)][1]


def block_bytes(qtype: int) -> int:
    """Bytes per block."""
    qtype_name(qtype)
    return GGUF_QUANT_TYPES[base_qtype(qtype)][2]


@dataclass
class QuantizedTensor:
    """A 2-D weight in a GGUF block format: logical ``shape`` (N, K) = (out_features, in_features), and
    ``data`` [N, K // block_size * block_bytes] uint8, each row the blocks of one output row (for a tiled
    ``qtype``, the same bytes in the tiled layout: rows of the data are then not weight rows).

    Raises (on construction):
        ValueError: an unsupported type, K not a whole number of blocks, or data of the wrong size.
    """

    qtype: int
    shape: tuple[int, int]
    data: torch.Tensor

    def __post_init__(self) -> None:
        n, k = self.shape
        bs = block_size(self.qtype)
        if k % bs:
            raise ValueError(f"{qtype_name(self.qtype)} weight with in_features {k}: not a multiple of {bs}")
        expected = (n, k // bs * block_bytes(self.qtype))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(f"{qtype_name(self.qtype)} data must be uint8 {expected}, got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())
