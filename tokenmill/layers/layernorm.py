"""RMSNorm, computed in float32 and cast back exactly as transformers' LlamaRMSNorm does."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.batch_invariant import bi_rms_norm
from tokenmill.layers.triton_elementwise import triton_rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension.

    forward(x [..., hidden_size]) -> [..., hidden_size] in x's dtype. The statistics are computed
    in float32; the result is cast back to x's dtype *before* the weight multiply (HF order), so
    bf16 outputs match transformers bit for bit. With ``batch_invariant`` set (deterministic mode)
    it runs in the batch-invariant kernel (same formula, fixed reduction order). With ``use_triton``
    set (CUDA runner) it is one fused Triton kernel (same formula and rounding). ``cpu_kernel_table``
    (the CPU runner's default mode, from measurements: tokenmill.runner.cpu_kernels) says per row
    count whether that same C kernel, one pass instead of six torch ops, runs; entry
    ``min(rows, len - 1)`` is used, empty means torch.
    """

    batch_invariant = False
    cpu_kernel_table: tuple[bool, ...] = ()
    use_triton = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.cpu_kernel_table
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.batch_invariant or (table and table[min(rows, len(table) - 1)]):
            shape = x.shape
            return bi_rms_norm(x.reshape(-1, shape[-1]), self.weight, self.variance_epsilon).view(shape)
        if self.use_triton:
            return triton_rms_norm(x, self.weight, self.variance_epsilon)
        x32 = x.float()  # no copy when x is already float32
        variance = x32.pow(2).mean(-1, keepdim=True)  # (..., 1)
        x32 = x32 * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)``, all in float32, then cast to x's dtype (HF Gemma order).

    forward(x [..., hidden_size]) -> [..., hidden_size] in x's dtype. ``weight`` is the checkpoint's offset
    (zero-initialised, as in transformers' ``Gemma2RMSNorm``/``Gemma3RMSNorm``); llama.cpp stores
    ``1 + weight`` in GGUF files, which ``gguf_loader`` undoes. Always plain torch: the C RMSNorm kernel
    multiplies by the weight after rounding to x's dtype, which is the Llama order, not this one.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)  # (..., hidden)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
