"""The GGUF header fields every test model writer shares (tests/test_models.py, test_kquant_models.py,
test_more_architectures.py): a ``gguf.GGUFWriter`` with a transformers config's block count, context,
widths, heads and RMSNorm epsilon written the way llama.cpp's converter names them; callers add the rest."""
from __future__ import annotations

from pathlib import Path


def gguf_writer_for(config, arch: str, out_path: Path):
    """A ``gguf.GGUFWriter`` for ``arch`` at ``out_path`` holding ``config``'s common llama-family keys
    ({arch}.block_count, context_length, embedding_length, feed_forward_length, attention.head_count,
    attention.head_count_kv, attention.layer_norm_rms_epsilon)."""
    import gguf

    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    return writer
