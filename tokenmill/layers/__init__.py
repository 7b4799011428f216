"""Building blocks shared by the model files: norms, RoPE, (fused) linear layers, activations, embeddings.

Every layer works on the flat ``[num_tokens, ...]`` layout; none of them knows about requests or the KV cache.
"""
from tokenmill.layers.activation import GeluTanhAndMul, SiluAndMul
from tokenmill.layers.embedding import VocabEmbedding
from tokenmill.layers.layernorm import GemmaRMSNorm, RMSNorm
from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb

__all__ = [
    "GeluTanhAndMul",
    "GemmaRMSNorm",
    "Linear",
    "MergedLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "VocabEmbedding",
    "apply_rotary_emb",
]
