"""Which compiled CPU kernels the default (non-deterministic) CPU runner uses, and up to which size.

RMSNorm and SiLU×up run in their C kernels (one pass over the row instead of several torch ops and
temporaries) at every size.

The batch-invariant GEMM (``tokenmill/layers/csrc/batch_invariant.c``) reads each weight matrix once
per call and runs AVX512-BF16 dot products, so at decode-sized row counts it is 1.5–3.7× faster than
``F.linear`` on this project's CPUs and never slower up to a few hundred rows in bfloat16
(``benchmarks/batch_invariant_gemm.py``). Larger products (prompt chunks) stay on ``F.linear``,
whose blocked GEMM catches up there, and float32 hands over earlier.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from tokenmill.layers import batch_invariant, silu_and_mul_kernel
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import Linear

logger = logging.getLogger(__name__)

# Most rows x may have for a Linear to use the C GEMM in default mode, per weight dtype. Measured on
# SmolLM2-135M shapes with 2 threads (RESULTS.md, "Default-mode CPU kernels"): bfloat16 is at
# least as fast as F.linear through M = 512; float32 loses from M = 128 on the MLP shapes.
CPU_GEMM_MAX_ROWS: dict[torch.dtype, int] = {torch.bfloat16: 256, torch.float32: 32}


def enable_cpu_gemm(model: nn.Module, dtype: torch.dtype) -> int:
    """Route ``model``'s Linear layers with at most ``CPU_GEMM_MAX_ROWS[dtype]`` input rows to the C GEMM.

    Does nothing (returns 0) for other dtypes or when the kernels cannot be built (no C compiler,
    or TOKENMILL_DISABLE_CPU_KERNELS=1); the layers then keep ``F.linear``.

    Returns the number of Linear layers switched.
    """
    max_rows = CPU_GEMM_MAX_ROWS.get(dtype, 0)
    if max_rows == 0 or not batch_invariant.available():
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.cpu_gemm_max_rows = max_rows
            count += 1
    logger.info("CPU GEMM kernel (%s) for %d linear layers at up to %d rows", batch_invariant.isa(), count, max_rows)
    return count


def enable_cpu_elementwise(model: nn.Module, dtype: torch.dtype) -> int:
    """Run ``model``'s RMSNorm and SiluAndMul layers in their C kernels (float32 or bfloat16).

    Does nothing (returns 0) for other dtypes or when a kernel cannot be built.

    Returns the number of layers switched.
    """
    if dtype not in (torch.float32, torch.bfloat16):
        return 0
    kinds = tuple(kind for kind, built in ((RMSNorm, batch_invariant.available()),
                                           (SiluAndMul, silu_and_mul_kernel.available())) if built)
    count = 0
    for module in model.modules():
        if isinstance(module, kinds):
            module.use_cpu_kernel = True
            count += 1
    return count
