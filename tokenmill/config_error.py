"""``ConfigError`` and ``config_from_value``: the leaf every config module builds on (``config.py``,
``kv_transfer/config.py``, ``spec_decode/config.py``), so those import one way only. Pure Python."""
from __future__ import annotations

import dataclasses
import json
import re


class ConfigError(ValueError):
    """An engine setting out of range, or inconsistent with another setting.

    The message names settings between backticks (`kv_offload_memory`), by their ``LLM(...)``
    keyword; `!name` names a switch turned off (``name=False``, on the command line its ``--no-``
    flag). ``str(error)`` spells them as those keywords; ``for_cli()`` spells them as the
    command-line flags (``--kv-offload-memory``), so each interface names what its user typed.
    """

    _NAME = re.compile(r"`(!?)(\w+)`")

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__(self._NAME.sub(lambda m: m[2] + ("=False" if m[1] else ""), template))

    def for_cli(self) -> str:
        """The message with each setting spelled as its command-line flag."""
        # The flags are written with the options in engine_args, which imports this module: import it when called.
        from tokenmill.engine_args import cli_flag

        return self._NAME.sub(lambda m: cli_flag(m[2]), self.template)


def config_from_value(cls, value, name: str, example: str):
    """A frozen config dataclass ``cls`` from an instance, a dict, its JSON text or None (defaults).

    Raises:
        ConfigError naming ``name``: not JSON (with ``example``), not an object, or an unknown key.
    """
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"`{name}` must be JSON, e.g. '{example}': {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"`{name}` must be a JSON object, got {value!r}")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ConfigError(f"`{name}` has unknown keys {unknown}; known: {known}")
    return cls(**value)
