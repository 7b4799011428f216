"""Batch-invariant ops of the Gated DeltaNet layers (csrc/gated_delta.c) for deterministic mode.

Each op computes every token (row, element) with one fixed instruction sequence, so its bits do not depend on
the batch or on how a prompt is chunked; torch's own elementwise kernels send some elements through a scalar
``exp`` and others through a vector one depending on the tensor's size (docs/deterministic.md). Inputs are
float32 CPU tensors (callers cast; casts are exact or round each element on its own). Built on first use like
the other CPU kernels.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokenmill.csrc_build import DEFAULT_FLAGS, CLibrary

_SOURCE = Path(__file__).parent / "csrc" / "gated_delta.c"
_FLAGS = (*DEFAULT_FLAGS, "-ffp-contract=off")  # no FMA contraction: one rounding sequence per operation
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def _setup(lib: ctypes.CDLL) -> None:
    lib.gdn_recurrent_f32.argtypes = [_P] * 8 + [_I64] * 5
    lib.gdn_gates_f32.argtypes = [_P] * 6 + [_I64] * 2
    lib.gdn_sigmoid_f32.argtypes = [_P, _P, _I64, ctypes.c_int]
    lib.gdn_row_inv_norm_f32.argtypes = [_P, _P, _I64, _I64, ctypes.c_float, ctypes.c_int]
    for fn in (lib.gdn_recurrent_f32, lib.gdn_gates_f32, lib.gdn_sigmoid_f32, lib.gdn_row_inv_norm_f32):
        fn.restype = None


library = CLibrary(_SOURCE, "gated_delta", _setup, _FLAGS, unavailable=(
    "the batch-invariant Gated DeltaNet kernel could not be built (is a C compiler installed?)"))
_lib = library.get  # this process's build (RuntimeError when unavailable)
available = library.available


def _f32(x: torch.Tensor) -> torch.Tensor:
    assert x.device.type == "cpu", "batch-invariant Gated DeltaNet ops run on CPU"
    return x.float().contiguous()


def recurrent_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
    """The gated delta rule token by token (as ``gated_delta_rule.recurrent_gated_delta_rule``) for S sequences
    of L tokens each, updating their states in place (also the default mode's decode step: one C call, no
    gather of the states).

    Args:
        q, k: [S * L, H, Dk] float32 (normalised, scaled, expanded to value heads); v: [S * L, H, Dv];
        g, beta: [S * L, H]; state: [S, H, Dk, Dv] float32 contiguous, or with ``slots`` ([S] int64) a pool
        [N, H, Dk, Dv] whose row slots[s] is sequence s's state.
    Returns:
        o [S * L, H, Dv] float32.
    """
    assert state.dtype == torch.float32 and state.is_contiguous() and state.device.type == "cpu"
    num_seqs = state.shape[0] if slots is None else slots.shape[0]
    heads, dk, dv = state.shape[1:]
    q, k, v, g, beta = (_f32(x) for x in (q, k, v, g, beta))
    seq_len = q.shape[0] // num_seqs if num_seqs else 0
    if slots is not None:
        slots = slots.to(torch.int64).contiguous()
        assert num_seqs == 0 or 0 <= int(slots.min()) and int(slots.max()) < state.shape[0]
    out = torch.empty(q.shape[0], heads, dv, dtype=torch.float32)
    library.get().gdn_recurrent_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                     state.data_ptr(), None if slots is None else slots.data_ptr(), out.data_ptr(),
                                     num_seqs, seq_len, heads, dk, dv)
    return out


def gates(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta), each [T, H] float32: g = neg_a * softplus(a + dt_bias), beta = sigmoid(b); a, b: [T, H];
    neg_a = -exp(A_log), dt_bias: [H]."""
    a, b, neg_a, dt_bias = (_f32(x) for x in (a, b, neg_a, dt_bias))
    g, beta = torch.empty_like(a), torch.empty_like(a)
    library.get().gdn_gates_f32(a.data_ptr(), b.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr(), g.data_ptr(),
                                 beta.data_ptr(), a.shape[0], a.shape[1])
    return g, beta


def sigmoid(x: torch.Tensor, silu: bool = False) -> torch.Tensor:
    """sigmoid(x), or x * sigmoid(x) with ``silu``: any shape, float32 result."""
    x = _f32(x)
    out = torch.empty_like(x)
    library.get().gdn_sigmoid_f32(x.data_ptr(), out.data_ptr(), x.numel(), int(silu))
    return out


def row_inv_norm(x: torch.Tensor, eps: float, mean: bool) -> torch.Tensor:
    """1 / sqrt(sum(x^2) (/ dim with ``mean``) + eps) over the last dim: x [..., D] -> [..., 1] float32."""
    x = _f32(x)
    dim = x.shape[-1]
    scale = torch.empty(*x.shape[:-1], 1, dtype=torch.float32)
    library.get().gdn_row_inv_norm_f32(x.data_ptr(), scale.data_ptr(), x.numel() // dim, dim, eps, int(mean))
    return scale
