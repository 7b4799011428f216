"""Greedy sampling's row argmax (csrc/argmax.c), with ``torch.argmax(x, dim=-1)``'s answer.

torch's CPU argmax over a decode step's float32 logits ([64, 49152]) ran at ~4.6 GB/s on 2 threads
of a Zen 4 (2.8 ms a step); the C kernel reads the logits at cache speed. Built on first use like
the other CPU kernels; without a C compiler (or with TOKENMILL_DISABLE_CPU_KERNELS=1) ``argmax_rows``
is torch's argmax.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokenmill.csrc_build import DEFAULT_FLAGS, CLibrary

_SOURCE = Path(__file__).parent / "csrc" / "argmax.c"


def _setup(lib: ctypes.CDLL) -> None:
    lib.argmax_rows_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_int]
    lib.argmax_rows_f32.restype = ctypes.c_int
    lib.argmax_isa.argtypes = []
    lib.argmax_isa.restype = ctypes.c_char_p


_FLAGS = DEFAULT_FLAGS
library = CLibrary(_SOURCE, "argmax", _setup, _FLAGS)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value: ``torch.argmax(logits, dim=-1)``, bit for bit.

    The first index wins a tie, and a row holding a NaN gives its first NaN's index (torch ranks
    NaN above every number).

    Args:
        logits: [B, V] float32 on CPU, rows contiguous (any row stride); other inputs (another dtype
            or device, V = 0 or V >= 2^31) go to torch.argmax.
    Returns:
        [B] int64 token ids.
    """
    lib = library.built()
    if (lib is None or logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or logits.stride(1) != 1 or not 0 < logits.shape[1] < 2**31 or logits.shape[0] == 0):
        return logits.argmax(dim=-1)
    return _argmax_rows(lib, logits)


def _argmax_rows(lib: ctypes.CDLL, logits: torch.Tensor) -> torch.Tensor:
    """argmax_rows on a given build of the kernel (tests compare the ISA paths' builds)."""
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64)
    ld = logits.stride(0) if batch > 1 else vocab
    rc = lib.argmax_rows_f32(logits.data_ptr(), batch, vocab, ld, out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"argmax_rows: bad shape {tuple(logits.shape)} / row stride {ld}")
    return out
