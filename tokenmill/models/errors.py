"""The error a model file gets when it holds something tokenmill cannot run.

Imports nothing heavy: the CLI, the server and ``LLM(...)`` all catch it as a ``ValueError`` (one
``error:`` line, exit status 2, no traceback on the command line).
"""
from __future__ import annotations


class UnsupportedModelError(ValueError, NotImplementedError):
    """A model file tokenmill cannot run: an unknown architecture, tensor type, tensor, RoPE variant or
    tokenizer. The message is one line naming what is missing and where (the file, and the metadata key or
    tensor name). A ``ValueError`` (what every interface reports as a bad input) and, for callers that
    caught the loader's older ``NotImplementedError``, that too."""
