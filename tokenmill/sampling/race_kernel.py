"""Random sampling's exponential race with its noise drawn in C (csrc/race.c).

``race_rows(probs, seeds)`` returns, per row, ``argmax(probs / E)`` with ``E ~ Exp(1)`` drawn from a
counter-based hash of the row's 64-bit seed and the token index: a draw from the row's distribution that
depends on the seed and the probabilities only. torch's CPU path draws its uniforms one at a time and
then runs three elementwise passes over a float64 buffer (~20 ms at [64, 49152] on 2 Zen 4 threads);
this kernel takes about a millisecond, computing a logarithm only for the tokens that can still win.
``sampler.race_noise_torch`` computes the same noise with tensor ops (CUDA, no compiler).
Built on first use like the other CPU kernels; ``available()`` is False without a C compiler (or with
TOKENMILL_DISABLE_CPU_KERNELS=1), and the sampler then races on torch's uniforms.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokenmill.csrc_build import DEFAULT_FLAGS, CLibrary

_SOURCE = Path(__file__).parent / "csrc" / "race.c"


def _setup(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.race_rows_f32.argtypes = [p, i64, i64, i64, p, p, ctypes.c_int]
    lib.race_rows_f32.restype = ctypes.c_int
    lib.race_noise.argtypes = [ctypes.c_uint64, i64, p]
    lib.race_noise.restype = None
    lib.race_isa.argtypes = []
    lib.race_isa.restype = ctypes.c_char_p


library = CLibrary(_SOURCE, "race", _setup, DEFAULT_FLAGS)
available = library.available


def takes(probs: torch.Tensor) -> bool:
    """Whether ``race_rows`` runs ``probs`` in C: [B, V] float32 on CPU, rows contiguous, 0 < V < 2^31."""
    return (probs.dim() == 2 and probs.dtype == torch.float32 and probs.device.type == "cpu"
            and probs.stride(1) == 1 and probs.stride(0) >= probs.shape[1] and 0 < probs.shape[1] < 2**31
            and probs.shape[0] > 0 and library.built() is not None)


def race_rows(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Sample one token per row: ``argmax(probs[b] / E_b)`` with ``E_b[i] = race_noise(seeds[b])[i]``.

    Ties go to the first index; a row holding a NaN gives its first NaN's index (torch.argmax's rules).

    Args:
        probs: [B, V] float32 on CPU, rows contiguous (any row stride), each summing to 1 (filtered tokens
            exactly 0); see :func:`takes`.
        seeds: [B] int64, each row's 64-bit seed (two's complement).
    Returns:
        [B] int64 token ids.
    Raises:
        RuntimeError: the kernel is unavailable. ValueError: a shape it does not take.
    """
    lib = library.built()
    if lib is None:
        raise RuntimeError("the C race kernel is unavailable")
    if not (probs.dim() == 2 and probs.dtype == torch.float32 and probs.device.type == "cpu"
            and probs.stride(1) == 1 and probs.stride(0) >= 0):
        raise ValueError(f"race_rows: takes [B, V] float32 CPU rows with contiguous columns, got {probs.dtype} "
                         f"{tuple(probs.shape)} on {probs.device} with strides {probs.stride()}")
    return _race_rows(lib, probs, seeds)


def _race_rows(lib: ctypes.CDLL, probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """race_rows on a given build of the kernel (tests compare the ISA paths' builds)."""
    batch, vocab = probs.shape
    seeds = seeds.to(torch.int64).contiguous()
    if seeds.shape != (batch,):
        raise ValueError(f"race_rows: {tuple(seeds.shape)} seeds for {batch} rows")
    out = torch.empty(batch, dtype=torch.int64)
    ld = probs.stride(0) if batch > 1 else vocab
    rc = lib.race_rows_f32(probs.data_ptr(), batch, vocab, ld, seeds.data_ptr(), out.data_ptr(),
                           torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"race_rows: bad shape {tuple(probs.shape)} / row stride {ld}")
    return out


def race_noise(seed: int, vocab: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The Exp(1) noise [vocab] float32 that ``race_rows`` compares against for a row seeded ``seed`` (tests)."""
    lib = lib or library.built()
    noise = torch.empty(vocab, dtype=torch.float32)
    lib.race_noise(ctypes.c_uint64(seed % 2**64), vocab, noise.data_ptr())
    return noise
