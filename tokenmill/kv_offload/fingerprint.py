"""model_fingerprint: the key that decides whether KV blocks stored on disk belong to this model.

Two engines may share disk blocks only if their K/V for the same tokens would be identical:
same weights (names, shapes, dtypes, bytes), same model config (RoPE settings change K), same
compute dtype, block size and KV dtype.
"""
from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

_FORMAT_TAG = b"tokenmill-kv-fingerprint-v1\0"
_VOLATILE_CONFIG_KEYS = {"transformers_version", "name_or_path"}  # not part of the model's math


def model_fingerprint(
    model: nn.Module, hf_config: object, dtype: torch.dtype, block_size: int, kv_dtype: torch.dtype
) -> str:
    """sha256 (hex) over every weight's name, shape, dtype and bytes, the model config, the
    compute dtype, the block size and the KV dtype. Costs one pass over the weights."""
    h = hashlib.sha256(_FORMAT_TAG)
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}\0".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    config = {k: v for k, v in config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(f"\0dtype={dtype}|block_size={block_size}|kv_dtype={kv_dtype}".encode())
    return h.hexdigest()
