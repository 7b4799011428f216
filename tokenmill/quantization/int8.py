"""``--quantization int8`` for safetensors checkpoints: weight-only int8 with one scale per output channel.

Each linear layer's weight W [N, K] becomes q = round(W / s) in [-127, 127] with s[n] = max|W[n]| / 127
(rounded to float16), stored as Q8_0 blocks that all carry their channel's scale, so the layer runs in
``qgemm``'s quantized kernel (batch invariant, so deterministic mode keeps its guarantee). Measured on
the AVX2 machine (1 thread, 3072x576 and 576x1536 weights, 1-64 rows): torch's
``aten._weight_int8pack_mm`` is as fast as this kernel with bf16 activations but 15-25x slower with
float32 ones, and its rows are not batch invariant; one kernel for both dtypes was kept. The LM head and
the embedding stay dense (the logits are the most sensitive product); layers whose in_features is not
a multiple of 32 stay dense.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.quantization.formats import QuantizedTensor

Q8_0 = 8


def int8_per_channel_blocks(weight: torch.Tensor) -> QuantizedTensor:
    """W [N, K] (K a multiple of 32) -> Q8_0 blocks with a per-channel scale: dequantizing gives
    s[n] * q[n, k] with |W - s q| <= s / 2 elementwise (s = float16(max|W[n]| / 127)).

    Raises:
        ValueError: K is not a multiple of 32.
    """
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"int8 blocks need in_features divisible by 32, got {k}")
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).to(torch.float16)  # (N,)
    s32 = scale.float().clamp_min(torch.finfo(torch.float16).tiny)
    q = torch.round(w / s32[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    blocks = torch.empty(n, k // 32, 34, dtype=torch.uint8)
    blocks[:, :, :2] = scale.view(torch.uint8).view(n, 1, 2)  # each block's float16 d: the channel scale
    blocks[:, :, 2:] = q.view(torch.uint8).view(n, k // 32, 32)
    return QuantizedTensor(Q8_0, (n, k), blocks.view(n, -1))


def quantize_linears_int8(model: nn.Module) -> int:
    """Replace every linear layer's dense weight (but the LM head's) with int8 per-channel blocks.

    Works on modules that have ``in_features``, a 2-D ``weight`` and ``load_quantized`` (tokenmill's
    ``Linear``). Returns the number of layers quantized.
    """
    count = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (name.endswith("lm_head") or not hasattr(module, "load_quantized") or not hasattr(module, "in_features")
                or weight is None or weight.dim() != 2 or weight.shape[1] % 32):
            continue
        module.load_quantized(int8_per_channel_blocks(weight.detach()))
        count += 1
    return count
