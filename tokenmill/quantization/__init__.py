"""Quantized weights: GGUF block formats run as stored (``qgemm``), and int8 weight-only for HF checkpoints.

Imports only torch and ``tokenmill.csrc_build``; the layers (``tokenmill.layers.linear``) call into it,
never the other way round.
"""
from tokenmill.quantization.formats import (
    GGUF_QUANT_TYPES,
    QUANTIZATION_METHODS,
    QuantizedTensor,
    block_bytes,
    block_size,
    qtype_name,
)

__all__ = ["GGUF_QUANT_TYPES", "QUANTIZATION_METHODS", "QuantizedTensor", "block_bytes", "block_size", "qtype_name"]
