"""Which torch device an engine runs on: resolves the ``device`` setting ("auto", "cpu", "cuda", "cuda:N")."""
from __future__ import annotations

import torch

from tokenmill.config import ConfigError


def resolve_device(device: str) -> torch.device:
    """Map the ``device`` setting to a torch device; "auto" picks CUDA when one is available.

    A CUDA device always comes back with its index (plain "cuda" means the current device).

    Raises:
        ConfigError: "cuda" (or "cuda:N") asked for on a machine without a usable CUDA device.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"`device` must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"`device` {device!r} asked for, but torch sees no CUDA device")
        if resolved.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if resolved.index >= torch.cuda.device_count():
            raise ConfigError(
                f"`device` {device!r} asked for, but only {torch.cuda.device_count()} CUDA devices exist"
            )
    return resolved
