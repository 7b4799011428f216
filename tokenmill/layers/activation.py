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
    in one fused Triton kernel. ``cpu_kernel_table`` (the CPU runner's default mode, from
    measurements: tokenmill.runner.cpu_kernels) says per row count whether the same C kernel as
    deterministic mode runs; entry ``min(rows, len - 1)`` is used, empty means torch.
    """

    batch_invariant = False
    cpu_kernel_table: tuple[bool, ...] = ()
    use_triton = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.cpu_kernel_table
        if self.batch_invariant or (table and x.dim() == 2 and table[min(x.shape[0], len(table) - 1)]):
            return bi_silu_and_mul(x)
        if self.use_triton:
            return triton_silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)  # (T, I) views each
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up for a fused ``[gate | up]`` tensor (Gemma's ``gelu_pytorch_tanh`` MLP).

    forward(x [T, 2 * intermediate]) -> [T, intermediate]; plain torch on every device.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # (T, I) views each
        return F.gelu(gate, approximate="tanh") * up
