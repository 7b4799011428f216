"""Linear attention for hybrid models: the gated delta rule (reference, chunked, decode step) and the
per-sequence state cache the linear layers read and write (docs/hybrid_models.md)."""
from tokenmill.linear_attention.gated_delta_rule import (
    chunk_gated_delta_rule,
    decode_step,
    recurrent_gated_delta_rule,
)

__all__ = ["chunk_gated_delta_rule", "decode_step", "recurrent_gated_delta_rule"]
