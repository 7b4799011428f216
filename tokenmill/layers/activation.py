"""Gated activations for the MLP: SiluAndMul consumes the fused gate_up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.silu_and_mul_kernel import bi_silu_and_mul
from tokenmill.layers.triton_elementwise import triton_silu_and_mul


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused ``[gate | up]`` tensor.

    forward(x [T, 2 * intermediate]) -> [T, intermediate]. With ``batch_invariant`` set
    (deterministic mode) it runs in the batch-invariant kernel; with ``use_triton`` (CUDA runner)
    in one fused Triton kernel; with ``use_cpu_kernel`` (the CPU runner's default mode) in the same C
    kernel as deterministic mode.
    """

    batch_invariant = False
    use_cpu_kernel = False
    use_triton = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant or self.use_cpu_kernel:
            return bi_silu_and_mul(x)
        if self.use_triton:
            return triton_silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)  # (T, I) views each
        return F.silu(gate) * up
