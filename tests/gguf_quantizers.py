"""Small numpy quantizers that write valid GGUF blocks, for tests that need GGUF files in any format.

``quantize(w, qtype)`` takes a float [N, K] matrix and returns its GGUF blocks, uint8 [N, K // block *
block bytes] (one row of blocks per weight row, as GGUF stores a matrix). Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
come from ``gguf.quants.quantize`` (llama.cpp's reference rounding); gguf-py has no quantizer for the
K-quants, so Q4_K, Q5_K and Q6_K are written here with a plain min/max scheme (not llama.cpp's search for
the best scales, so the error is somewhat larger, but every weight is within half a step of its value):

- Q4_K / Q5_K (256 weights, 8 sub-blocks of 32): ``w = d * sc[j] * q - dmin * m[j]``, q 4 or 5 bits,
  ``sc`` and ``m`` 6-bit integers relative to the fp16 super-block ``d`` and ``dmin``. Block bytes:
  d (fp16), dmin (fp16), 12 bytes of packed scales and mins, [Q5_K: 32 bytes of 5th bits], 128 bytes of
  low nibbles.
- Q6_K (256 weights, 16 sub-blocks of 16): ``w = d * sc[s] * (u - 32)``, u 6 bits, ``sc`` int8. Block
  bytes: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales, d (fp16).

The byte layouts are the inverse of gguf-py's ``dequantize_blocks`` (and of csrc/qg_formats.h's ``group_params``
/ ``group_codes`` / ``k4_scale_min``); tests/test_kquant_models.py checks them against gguf-py.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

QK_K = 256  # weights per K-quant super-block
Q4_K, Q5_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K


def quantize(w: np.ndarray, qtype: GGMLQuantizationType | int) -> np.ndarray:
    """GGUF blocks of ``w`` (float [N, K]) in ``qtype``: uint8 [N, row bytes]."""
    qtype = GGMLQuantizationType(qtype)
    w = np.ascontiguousarray(w, dtype=np.float32)
    assert w.ndim == 2, w.shape
    if qtype in (Q4_K, Q5_K, Q6_K):
        n, k = w.shape
        assert k % QK_K == 0, f"{qtype.name} needs in_features a multiple of {QK_K}, got {k}"
        blocks = w.reshape(-1, QK_K)  # (N * K / 256, 256): one super-block per row
        raw = _q6_k(blocks) if qtype == Q6_K else _q45_k(blocks, bits=4 if qtype == Q4_K else 5)
        return raw.reshape(n, -1)
    return gguf_quantize(w, qtype)


def _fp16_at_least(x: np.ndarray) -> np.ndarray:
    """``x`` (>= 0) rounded to float16, moved up one step where rounding went down: a scale that covers
    the range it was computed for (so no code needs clipping)."""
    h = x.astype(np.float16)
    low = h.astype(np.float32) < x
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0 (an all-zero block)."""
    return np.divide(a, b, out=np.zeros_like(a, dtype=np.float32), where=b > 0)


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4, 144 bytes) or Q5_K (bits 5, 176 bytes) blocks of x [B, 256]."""
    nb = x.shape[0]
    levels = (1 << bits) - 1
    sub = x.reshape(nb, 8, 32)  # (B, sub-block j, weight i)
    mins = np.maximum(-sub.min(-1), 0.0)  # (B, 8): the offset is -dmin * m <= 0, as llama.cpp keeps it
    dmin = _fp16_at_least(mins.max(-1) / 63)  # (B,)
    m = np.minimum(np.ceil(_divide(mins, dmin.astype(np.float32)[:, None])), 63)  # m[j] * dmin >= mins[j]
    offset = dmin.astype(np.float32)[:, None] * m  # (B, 8)
    steps = (sub.max(-1) + offset) / levels  # (B, 8): the step that reaches the sub-block's max
    d = _fp16_at_least(np.maximum(steps, 0).max(-1) / 63)
    sc = np.minimum(np.ceil(_divide(steps, d.astype(np.float32)[:, None])), 63)  # d * sc[j] >= steps[j]
    scale = d.astype(np.float32)[:, None] * sc  # (B, 8)
    q = np.clip(np.rint(_divide(sub + offset[..., None], scale[..., None])), 0, levels).astype(np.uint8)

    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    packed = np.empty((nb, 12), dtype=np.uint8)  # see gguf-py's Q4_K.get_scale_min
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)  # scales 0-3, top 2 bits of scales 4-7
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)  # mins 0-3, top 2 bits of mins 4-7
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)  # low 4 bits of scales and mins 4-7
    low = (q & 0xF).reshape(nb, 4, 2, 32)  # sub-block 2c + h sits in byte 32c + i, nibble h
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
    parts = [d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2), packed]
    if bits == 5:  # bit 4 of weight i of sub-block j is bit j of byte i
        high = (q >> 4).astype(np.uint8)  # (B, 8, 32)
        qh = np.zeros((nb, 32), dtype=np.uint8)
        for j in range(8):
            qh |= high[:, j] << j
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks (210 bytes) of x [B, 256]."""
    nb = x.shape[0]
    sub = x.reshape(nb, 16, 16)
    steps = np.abs(sub).max(-1) / 31  # (B, 16): codes in -31..31 (the format allows -32..31)
    d = _fp16_at_least(steps.max(-1) / 127)
    sc = np.minimum(np.ceil(_divide(steps, d.astype(np.float32)[:, None])), 127)  # d * sc[s] >= steps[s]
    scale = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.rint(_divide(sub, scale[..., None])), -32, 31).astype(np.int16)
    u = (q + 32).astype(np.uint8).reshape(nb, 2, 4, 32)  # weight 128c + 32r + i: half c, row r, column i

    low = (u & 0xF).reshape(nb, 2, 2, 2, 32)  # [c, r // 2, r % 2, i]: byte 64c + 32(r % 2) + i, nibble r // 2
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
    high = u >> 4  # [c, r, i]: bits 2r..2r+1 of byte 32c + i
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(nb, 64)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql, qh, scales, d.view(np.uint8).reshape(nb, 2)], axis=1)
