"""Attention over the paged KV cache: per-step metadata and the backends that consume it."""
from tokenmill.attention.layer import Attention
from tokenmill.attention.metadata import AttentionMetadata, build_attention_metadata

__all__ = ["Attention", "AttentionMetadata", "build_attention_metadata"]
