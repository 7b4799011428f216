"""The Hermes tool-call text that ``StructuredOutputsParams(tool_calls=...)`` forces, as literal
pieces around each tool's arguments schema, shared by both backends. Pure Python.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from tokenmill.structured_output.backend import ConstraintError

CALL_END = "}\n</tool_call>"
CALL_SEPARATOR = ""


def call_begin(name: str) -> str:
    """The text before one call's arguments: ``<tool_call>\\n{"name": "NAME", "arguments": ``."""
    return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '


@dataclass(frozen=True)
class ToolCallsSpec:
    """A parsed ``tool_calls`` constraint: (name, parameters schema) per tool, and whether several
    calls may follow each other (``parallel``)."""

    tools: tuple[tuple[str, dict], ...]
    parallel: bool


def parse_tool_calls_spec(spec: str) -> ToolCallsSpec:
    """Parse the canonical JSON text of a ``tool_calls`` constraint.

    Raises:
        ConstraintError: not ``{"tools": [{"name": str, "parameters": dict}, ...], "parallel": bool}``.
    """
    try:
        value = json.loads(spec)
        tools = tuple((t["name"], t.get("parameters") or {"type": "object"}) for t in value["tools"])
        parallel = bool(value.get("parallel", True))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConstraintError("tool_calls", f"expected {{'tools': [{{'name', 'parameters'}}], 'parallel'}}: {exc}") from None
    if not tools or not all(isinstance(n, str) and isinstance(p, dict) for n, p in tools):
        raise ConstraintError("tool_calls", "needs at least one tool with a string name and a dict parameters")
    return ToolCallsSpec(tools, parallel)
