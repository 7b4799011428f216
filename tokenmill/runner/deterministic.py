"""The deterministic (batch-invariant) mode: switches a model's layers onto batch-invariant kernels.

Approach (docs/deterministic.md): every operation that reduces over a dimension computes each
token with a fixed instruction sequence that depends only on that token's own data — the GEMMs
(tokenmill.layers.batch_invariant), RMSNorm, SiLU-and-multiply and attention (each token runs
as a decode query over its own context). Token-level invariance makes prefill chunking, prefix
hits, batch composition and recompute preemption irrelevant to a request's bits.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention import cpu_decode
from tokenmill.attention.layer import Attention
from tokenmill.layers import batch_invariant, silu_and_mul_kernel
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import Linear

# Layers with a batch-invariant path; every other op in the models is a gather or exact elementwise arithmetic.
_INVARIANT_LAYERS = (Linear, RMSNorm, SiluAndMul, Attention)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def check_deterministic_supported(dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
    """Refuse configurations the deterministic mode cannot guarantee.

    Raises:
        ValueError: a dtype other than float32/bfloat16, a non-CPU device, or a missing C compiler
            (the batch-invariant kernels are compiled on first use).
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"deterministic mode supports dtype float32 or bfloat16, not {dtype}")
    if torch.device(device).type != "cpu":
        raise ValueError("deterministic mode is implemented for the CPU backend only")
    missing = [
        name
        for name, ok in (
            ("GEMM/RMSNorm", batch_invariant.available()),
            ("SiLU", silu_and_mul_kernel.available()),
            ("attention", cpu_decode.available()),
        )
        if not ok
    ]
    if missing:
        raise ValueError(
            f"deterministic mode needs the compiled batch-invariant kernels ({', '.join(missing)}), which could not "
            "be built: install a C compiler (gcc) with OpenMP"
        )


def enable_batch_invariant(model: nn.Module) -> int:
    """Put every Linear, RMSNorm, SiluAndMul and Attention of ``model`` on its batch-invariant path.

    Returns the number of layers switched.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, _INVARIANT_LAYERS):
            module.batch_invariant = True
            count += 1
    return count
