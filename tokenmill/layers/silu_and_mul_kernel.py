"""Batch-invariant SiLU-and-multiply (csrc/silu_and_mul.c) for the deterministic mode.

torch's own ``F.silu(gate) * up`` can round an element differently depending on how many rows
are in the batch (see the C file); this kernel cannot. Built on first use like the other CPU kernels.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokenmill.csrc_build import DEFAULT_FLAGS, CLibrary

_SOURCE = Path(__file__).parent / "csrc" / "silu_and_mul.c"
# No FMA contraction: every ISA path computes the same formula in the same order.
_FLAGS = (*DEFAULT_FLAGS, "-ffp-contract=off")


def _setup(lib: ctypes.CDLL) -> None:
    for name in ("silu_and_mul_f32", "silu_and_mul_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        fn.restype = None
    lib.silu_and_mul_isa.argtypes = []
    lib.silu_and_mul_isa.restype = ctypes.c_char_p


library = CLibrary(_SOURCE, "silu_and_mul", _setup, _FLAGS)
# this process's build, or None; tests pin another ISA path's with monkeypatch.setattr(library, "built", ...)
_get_lib = library.built
_load = library.load  # any ISA path's build, not cached (tests compare the paths)
available = library.available


def bi_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused ``[gate | up]`` input, bitwise independent of the batch.

    Args:
        x: [M, 2 * I] float32 or bfloat16 on CPU.
    Returns:
        [M, I] in x's dtype; for bf16, silu is rounded to bf16 before the multiply (torch's order).
    Raises:
        ValueError: another dtype or device, or an odd last dimension.
        RuntimeError: the kernel could not be built.
    """
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(f"bi_silu_and_mul needs a float32 or bfloat16 CPU tensor, got {x.dtype} on {x.device}")
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"bi_silu_and_mul needs [M, 2 * I], got {tuple(x.shape)}")
    lib = library.built()
    if lib is None:
        raise RuntimeError("the batch-invariant SiLU kernel could not be built (is a C compiler installed?)")
    return _silu_and_mul(lib, x)


def _silu_and_mul(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """bi_silu_and_mul on a given build of the kernel (tests compare the ISA paths' builds)."""
    x = x.contiguous()
    num_rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, inter, dtype=x.dtype)
    fn = lib.silu_and_mul_bf16 if x.dtype == torch.bfloat16 else lib.silu_and_mul_f32
    fn(x.data_ptr(), out.data_ptr(), num_rows, inter, torch.get_num_threads())
    return out
