"""Gated activations for the MLP: SiluAndMul consumes the fused gate_up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused ``[gate | up]`` tensor.

    forward(x [T, 2 * intermediate]) -> [T, intermediate].
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # (T, I) views each
        return F.silu(gate) * up
