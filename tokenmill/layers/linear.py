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
from tokenmill.layers.gemm_shapes import bounded_linear, needs_bounded_shapes
from tokenmill.quantization.formats import QuantizedTensor
from tokenmill.quantization.gguf_weight import GGUFWeight


# Vocabulary rows per float32 chunk when torch computes float32 logits from bf16 weights on CPU.
_LOGITS_CHUNK = 8192
# Whether torch.mm(..., out_dtype=float32) works on CUDA here (cleared at its first failure, which
# happens in the eager profiling forward, before any CUDA graph is captured).
_cuda_mm_out_dtype = True


class Linear(nn.Module):
    """y = x W^T (+ b). forward(x [T, in_features]) -> [T, out_features].

    Parameters are allocated with ``torch.empty``: a model is always filled by ``load_weights``.
    With ``batch_invariant`` set (deterministic mode) the product always runs in the batch-invariant
    C kernel. ``cpu_gemm_table`` (set by the CPU runner's default mode from measurements, see
    ``tokenmill.runner.cpu_kernels``) says per row count whether that kernel beats ``F.linear`` on
    this CPU: entry ``min(rows, len - 1)`` is used; empty means always ``F.linear`` (bf16/f16 on CPU: at
    bucketed row counts, ``gemm_shapes.bounded_linear``, so oneDNN's per-shape kernels stay few).
    ``forward_float32`` is the LM head's entry point (float32 logits). ``lora`` (set by
    ``tokenmill.lora.manager.LoRAManager`` on the adapter target projections) adds each token's
    adapter delta to the output, in the same batch-invariant mode; None costs nothing.
    ``quant`` (set by ``load_quantized``): the weight kept in GGUF block formats
    (``tokenmill.quantization.GGUFWeight``); ``weight`` is then None and the blocks are buffers
    ``qweight_<i>``.
    """

    batch_invariant = False
    cpu_gemm_table: tuple[bool, ...] = ()
    float32_logits_kernel = False
    lora = None  # a tokenmill.lora.slots.ModuleLoRA, or None
    quant: GGUFWeight | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load_quantized(self, weight: QuantizedTensor | GGUFWeight) -> None:
        """Keep ``weight`` (shape [out_features, in_features]) quantized in place of the dense weight.

        Raises:
            ValueError: the shape does not match the layer.
        """
        quant = weight if isinstance(weight, GGUFWeight) else GGUFWeight([weight])
        if (quant.out_features, quant.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {quant.out_features}x{quant.in_features} does not fit a "
                             f"{self.out_features}x{self.in_features} layer")
        self.weight = None
        self.quant = quant
        for i, data in enumerate(quant.tensors()):
            self.register_buffer(f"qweight_{i}", data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.cpu_gemm_table
        if self.quant is not None:
            y = self.quant.matmul(x, self.bias, self.batch_invariant)
        elif self.batch_invariant or (table and x.dim() == 2 and table[min(x.shape[0], len(table) - 1)]):
            y = bi_linear(x, self.weight, self.bias)
        elif x.dim() == 2 and needs_bounded_shapes(x):
            y = bounded_linear(x, self.weight, self.bias)  # a bounded set of oneDNN kernels (gemm_shapes)
        else:
            y = F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora.apply(x, y, self.batch_invariant)
        return y

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in_features] -> [N, out_features] float32, accumulated in float32 and never rounded to
        x's dtype (an LM head's logits: bf16 rounding would turn near-ties into exact ties).

        float32 weights run ``forward``. bf16 weights run the C GEMM with float32 output in
        deterministic mode or when ``float32_logits_kernel`` is set (the CPU runner's default); on
        CUDA ``torch.mm`` with ``out_dtype=float32`` where torch offers it; otherwise torch in float32
        over chunks of ``_LOGITS_CHUNK`` weight rows converted on the fly (no float32 copy is kept).
        """
        if self.quant is not None:
            return self.quant.matmul(x, self.bias, self.batch_invariant, out_dtype=torch.float32)
        if self.weight.dtype == torch.float32:
            return self(x).float()
        if self.batch_invariant or self.float32_logits_kernel:
            return bi_linear(x, self.weight, self.bias, out_dtype=torch.float32)
        global _cuda_mm_out_dtype
        if x.is_cuda and self.bias is None and _cuda_mm_out_dtype:
            try:
                return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
            except (RuntimeError, TypeError):  # a torch/cuBLAS without it: the chunked path from now on
                _cuda_mm_out_dtype = False
        x32 = x.float()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        for start in range(0, self.out_features, _LOGITS_CHUNK):
            rows = slice(start, start + _LOGITS_CHUNK)
            bias = None if self.bias is None else self.bias[rows].float()
            out[:, rows] = F.linear(x32, self.weight[rows].float(), bias)
        return out

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
    def load_shard(self, param_name: str, shard: int, loaded: torch.Tensor | QuantizedTensor) -> None:
        """Copy one projection's ``weight`` [size, in] or ``bias`` [size] into shard ``shard``.

        A QuantizedTensor weight is held until every shard has arrived (all of them must be quantized),
        then the layer keeps them quantized (``load_quantized``).

        Raises:
            ValueError: unknown param_name or a tensor whose shape does not fit the shard.
        """
        if isinstance(loaded, QuantizedTensor):
            if param_name != "weight" or loaded.shape != (self.output_sizes[shard], self.in_features):
                raise ValueError(f"shard {shard} {param_name}: a quantized tensor of shape {loaded.shape} does not fit")
            pending = self.__dict__.setdefault("_pending_quantized", {})
            pending[shard] = loaded
            if len(pending) == len(self.output_sizes):
                self.load_quantized(GGUFWeight([pending[i] for i in range(len(self.output_sizes))]))
                del self.__dict__["_pending_quantized"]
            return
        param = {"weight": self.weight, "bias": self.bias}.get(param_name)
        if param is None:
            raise ValueError(f"MergedLinear has no parameter {param_name!r}")
        start, size = self.offsets[shard], self.output_sizes[shard]
        target = param.narrow(0, start, size)
        if target.shape != loaded.shape:
            raise ValueError(f"shard {shard} {param_name}: expected shape {tuple(target.shape)}, got {tuple(loaded.shape)}")
        target.copy_(loaded)
