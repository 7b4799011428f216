"""RMSNorm, computed in float32 and cast back exactly as transformers' LlamaRMSNorm does."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension.

    forward(x [..., hidden_size]) -> [..., hidden_size] in x's dtype. The statistics are computed
    in float32; the result is cast back to x's dtype *before* the weight multiply (HF order), so
    bf16 outputs match transformers bit for bit.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # no copy when x is already float32
        variance = x32.pow(2).mean(-1, keepdim=True)  # (..., 1)
        x32 = x32 * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
