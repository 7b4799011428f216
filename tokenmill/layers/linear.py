"""Linear layers with uninitialised storage, and MergedLinear: several projections of one input in one GEMM.

MergedLinear is how qkv_proj (q | k | v) and gate_up_proj (gate | up) run as a single matmul;
``load_shard`` copies one checkpoint projection into its row range.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.batch_invariant import bi_linear


class Linear(nn.Module):
    """y = x W^T (+ b). forward(x [T, in_features]) -> [T, out_features].

    Parameters are allocated with ``torch.empty``: a model is always filled by ``load_weights``.
    With ``batch_invariant`` set (deterministic mode) the product always runs in the batch-invariant
    C kernel. With ``cpu_gemm_max_rows`` > 0 (the CPU runner's default mode, see
    ``tokenmill.runner.cpu_kernels``) it runs there when x has at most that many rows: decode-sized
    products, where that kernel streams the weights once and beats ``F.linear``.
    """

    batch_invariant = False
    cpu_gemm_max_rows = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant or (x.dim() == 2 and x.shape[0] <= self.cpu_gemm_max_rows):
            return bi_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Projections that share an input, stacked along the output dimension.

    forward(x [T, in_features]) -> [T, sum(output_sizes)]; shard i occupies output columns
    ``offsets[i] : offsets[i] + output_sizes[i]``.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]

    @torch.no_grad()
    def load_shard(self, param_name: str, shard: int, loaded: torch.Tensor) -> None:
        """Copy one projection's ``weight`` [size, in] or ``bias`` [size] into shard ``shard``.

        Raises:
            ValueError: unknown param_name or a tensor whose shape does not fit the shard.
        """
        param = {"weight": self.weight, "bias": self.bias}.get(param_name)
        if param is None:
            raise ValueError(f"MergedLinear has no parameter {param_name!r}")
        start, size = self.offsets[shard], self.output_sizes[shard]
        target = param.narrow(0, start, size)
        if target.shape != loaded.shape:
            raise ValueError(f"shard {shard} {param_name}: expected shape {tuple(target.shape)}, got {tuple(loaded.shape)}")
        target.copy_(loaded)
