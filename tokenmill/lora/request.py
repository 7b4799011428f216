"""LoRARequest: which adapter a request runs with (vLLM's field names). Pure Python."""
from __future__ import annotations

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
