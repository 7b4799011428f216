"""Constrained decoding (JSON schema, regex, choice, grammar, tool calls) on llguidance or xgrammar.

``StructuredOutputManager`` is the engine's entry point; ``backend.py`` is the interface each grammar
library sits behind. Imports flow one way: engine/runner -> structured_output -> sampling_params,
config. Never imports torch.
"""
from tokenmill.structured_output.backend import (
    CompiledConstraint, ConstraintError, ConstraintTimeoutError, Matcher, StructuredOutputBackend,
)
from tokenmill.structured_output.manager import BACKENDS, GrammarBitmask, StructuredOutputManager

__all__ = [
    "BACKENDS", "CompiledConstraint", "ConstraintError", "ConstraintTimeoutError", "GrammarBitmask", "Matcher",
    "StructuredOutputBackend", "StructuredOutputManager",
]
