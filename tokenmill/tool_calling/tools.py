"""The OpenAI ``tools`` / ``tool_choice`` request fields: validation into a :class:`ToolRequest`, and the
output constraint that ``tool_choice: "required"`` or a named tool puts on generation.

Pure Python (jsonschema for schema checks); knows nothing of the server or the engine.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICE_MODES = ("none", "auto", "required")


class ToolCallingError(ValueError):
    """A bad ``tools`` / ``tool_choice`` / tool message field; ``param`` is its OpenAI path
    (``tools[1].function.name``, ``tool_choice``), for a 400 answer that names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    """One function a model may call: its ``name``, optional ``description`` and ``parameters``
    (a JSON schema of the arguments object; ``{"type": "object", "properties": {}}`` when not given)."""

    name: str
    description: str | None
    parameters: dict
    strict: bool | None = None

    def to_openai(self) -> dict:
        """The tool in the OpenAI request shape ``{"type": "function", "function": {...}}``."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """A request's validated tools and tool choice.

    Attributes:
        tools: the tools, in request order (empty when the request has none).
        mode: ``"none"`` (never call), ``"auto"`` (the model decides), ``"required"`` (at least one
            call) or ``"named"`` (exactly one call of tool ``name``).
        name: the tool that ``mode == "named"`` forces; None otherwise.
    """

    tools: tuple[ToolSpec, ...]
    mode: str
    name: str | None = None

    def tool(self, name: str) -> ToolSpec | None:
        """The tool called ``name``, or None."""
        return next((t for t in self.tools if t.name == name), None)

    def openai_tools(self) -> list[dict] | None:
        """The tools in the OpenAI shape (for a chat template's ``tools``); None when there are none."""
        return [t.to_openai() for t in self.tools] or None


def parse_tools(tools: list | None, tool_choice: Any = None) -> ToolRequest:
    """Validates the OpenAI ``tools`` and ``tool_choice`` fields of a chat request.

    ``tools`` None or ``[]`` means no tools. ``tool_choice`` None defaults to ``"auto"`` when
    there are tools and ``"none"`` otherwise.

    Raises:
        ToolCallingError: naming the bad field (``tools[i].function.parameters``, ``tool_choice``...).
    """
    specs = _parse_tool_list(tools)
    if tool_choice is None:
        return ToolRequest(specs, "auto" if specs else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICE_MODES:
            raise ToolCallingError(
                f"tool_choice must be one of {', '.join(CHOICE_MODES)} or a named function, got {tool_choice!r}",
                "tool_choice")
        if tool_choice == "required" and not specs:
            raise ToolCallingError('tool_choice "required" needs a non-empty tools list', "tool_choice")
        return ToolRequest(specs, tool_choice)
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise ToolCallingError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice")
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise ToolCallingError("tool_choice.function must be an object with a name", "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str):
        raise ToolCallingError("tool_choice.function.name must be a string", "tool_choice.function.name")
    if not specs:
        raise ToolCallingError("a named tool_choice needs a non-empty tools list", "tool_choice")
    if not any(s.name == name for s in specs):
        raise ToolCallingError(f"tool_choice names {name!r}, which is not in tools", "tool_choice.function.name")
    return ToolRequest(specs, "named", name)


def _parse_tool_list(tools: Any) -> tuple[ToolSpec, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ToolCallingError("tools must be a list of function tools", "tools")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolCallingError(f"{where} must be an object", where)
        if tool.get("type") != "function":
            raise ToolCallingError(f'{where}.type must be "function", got {tool.get("type")!r}', f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolCallingError(f"{where}.function must be an object", f"{where}.function")
        specs.append(_parse_function(function, f"{where}.function", {s.name for s in specs}))
    return tuple(specs)


def _parse_function(function: dict, where: str, taken: set[str]) -> ToolSpec:
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolCallingError(f"{where}.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}", f"{where}.name")
    if name in taken:
        raise ToolCallingError(f"{where}.name {name!r} is used by another tool", f"{where}.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolCallingError(f"{where}.description must be a string", f"{where}.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolCallingError(f"{where}.strict must be a boolean", f"{where}.strict")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    _check_parameters(parameters, f"{where}.parameters")
    return ToolSpec(name, description, parameters, strict)


def _check_parameters(schema: Any, where: str) -> None:
    """A JSON schema of an object: valid against its metaschema, and ``type`` (if any) ``"object"``."""
    if not isinstance(schema, dict):
        raise ToolCallingError(f"{where} must be a JSON schema object", where)
    if "type" in schema and schema["type"] != "object":
        raise ToolCallingError(f'{where} must describe an object (type "object"), got type {schema["type"]!r}', where)
    import jsonschema  # on the first request with tools (60 ms of a server's start otherwise)

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        raise ToolCallingError(f"{where} is not a valid JSON schema: {e.message}", where) from None


def tool_constraint(request: ToolRequest, parallel_tool_calls: bool = True) -> StructuredOutputsParams | None:
    """The output constraint a tool choice imposes: ``"required"`` -> one or more calls of any tool
    (exactly one unless ``parallel_tool_calls``); named -> exactly one call of that tool;
    ``"none"`` / ``"auto"`` -> None (free text, parsed afterwards)."""
    if request.mode == "required":
        chosen, parallel = request.tools, parallel_tool_calls
    elif request.mode == "named":
        chosen, parallel = tuple(t for t in request.tools if t.name == request.name), False
    else:
        return None
    return StructuredOutputsParams(tool_calls={
        "tools": [{"name": t.name, "parameters": t.parameters} for t in chosen], "parallel": parallel})
