"""LoRARequest: which adapter a request runs with (vLLM's field names), and the ``--lora-modules``
spellings (``LoRAModulePath``). Pure Python."""
from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter to apply to one request.

    Args:
        lora_name: the adapter's name (in error messages and, with the id, in prefix-cache keys).
        lora_int_id: a positive integer naming the adapter inside the engine; one id must always
            name the same adapter (the engine refuses an id reused for another name or path).
        lora_path: a directory written by peft's ``save_pretrained`` (adapter_config.json plus
            adapter_model.safetensors or adapter_model.bin).

    Raises:
        ValueError: an empty name, an id that is not a positive integer, or a path that is not a string.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, numbers.Integral) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a directory path, got {self.lora_path!r}")


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: ``name=path`` or ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """One ``--lora-modules`` value: ``name=path`` or the JSON form (vLLM's two spellings).

    Raises:
        ValueError: neither form, or an empty name or path.
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not valid JSON ({exc}): {text!r}") from None
        unknown = set(spec) - {"name", "path", "base_model_name"} if isinstance(spec, dict) else set()
        if not isinstance(spec, dict) or unknown:
            raise ValueError(
                f'expected {{"name": ..., "path": ..., "base_model_name": ...}}, got {text!r}')
        name, path, base = spec.get("name"), spec.get("path"), spec.get("base_model_name")
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise ValueError(f"expected name=path or a JSON object, got {text!r}")
    for key, value in (("name", name), ("path", path)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{key} must be a non-empty string in {text!r}")
    if base is not None and (not isinstance(base, str) or not base):
        raise ValueError(f"base_model_name must be a non-empty string in {text!r}")
    return LoRAModulePath(name.strip(), path.strip(), base)
