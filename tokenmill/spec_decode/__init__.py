"""Speculative decoding (vLLM's ``--speculative-config``): drafts proposed per request, verified
in one step as extra scheduled tokens, accepted exactly (docs/spec_decode.md).

One-way imports: the engine, scheduler output and runner use this package; it imports none of them.
"""
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.metrics import SpecDecodingStats
from tokenmill.spec_decode.speculator import NgramSpeculator, Speculator

__all__ = ["NgramSpeculator", "SpecDecodingStats", "SpeculativeConfig", "Speculator"]
