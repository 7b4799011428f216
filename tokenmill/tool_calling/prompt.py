"""How tools and tool-call turns reach the model through its chat template.

A template that knows tools (it mentions ``tools``) gets them as ``apply_chat_template(tools=...)``
and assistant ``tool_calls`` with parsed arguments. A template that does not (SmolLM2's ChatML) gets
plain-text turns in the Hermes format: a system block listing the tools, ``<tool_call>`` blocks in
assistant contents and ``<tool_response>`` blocks in user turns. Pure Python; no tokenizer here.
"""
from __future__ import annotations

import json
import re
from typing import Any

from tokenmill.tool_calling.hermes import TOOL_CALL_END, TOOL_CALL_START
from tokenmill.tool_calling.tools import ToolCallingError

_MENTIONS_TOOLS = re.compile(r"\btools\b")

HERMES_SYSTEM_PROMPT = (
    "You can call functions to help with the user's request. The functions available to you are "
    "described below as JSON signatures, between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call one or more of them, answer with one block per call, each holding a JSON object with the "
    "function's name and its arguments (an object matching the function's parameters):\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n</tool_call>\n'
    "Each result comes back to you between <tool_response> and </tool_response>. Do not make up "
    "results or argument values; ask the user when something you need is missing."
)
"""The system text that describes the tools to a template without a tools section (``{tools}``:
one JSON tool per line)."""


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself (it mentions the word ``tools``)."""
    return bool(chat_template) and _MENTIONS_TOOLS.search(chat_template) is not None


def conversation_for_template(
    messages: list[dict], tools: list[dict] | None, supports_tools: bool
) -> tuple[list[dict], list[dict] | None]:
    """The messages to render and the ``tools`` argument for ``tokenizer.apply_chat_template``.

    ``messages`` are OpenAI chat messages (dicts; assistant ``tool_calls`` with JSON-text
    ``function.arguments``; ``tool`` messages with the result as content); ``tools`` the OpenAI
    tools list. Every returned message has a string ``content`` (None becomes ""; text parts are
    joined). With ``supports_tools`` the tools pass through and arguments are parsed into dicts (as
    HF templates expect); otherwise the tools go into the first system message (one is added when
    there is none) as :data:`HERMES_SYSTEM_PROMPT`, calls into assistant contents as ``<tool_call>``
    blocks, and each run of ``tool`` messages becomes one ``user`` turn of ``<tool_response>`` blocks.

    Raises:
        ToolCallingError: a message's content or ``tool_calls`` has the wrong shape (``param`` names it).
    """
    if supports_tools:
        out = []
        for i, message in enumerate(messages):
            message = {**message, "content": _text(message.get("content"), f"messages[{i}].content")}
            if message.get("tool_calls"):
                message["tool_calls"] = [
                    {**call, "function": {"name": name, "arguments": _parsed(arguments)}}
                    for call, (name, arguments) in zip(message["tool_calls"], _calls(message, i))]
            out.append(message)
        return out, tools or None
    out = []
    previous_role = None
    for i, message in enumerate(messages):
        role, content = message.get("role"), _text(message.get("content"), f"messages[{i}].content")
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if previous_role == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif role == "assistant" and message.get("tool_calls"):
            blocks = [f'{TOOL_CALL_START}\n{{"name": {json.dumps(name)}, "arguments": {_as_json(arguments)}}}\n'
                      f"{TOOL_CALL_END}" for name, arguments in _calls(message, i)]
            content = "\n".join(([content] if content else []) + blocks)
            out.append({**{k: v for k, v in message.items() if k != "tool_calls"}, "content": content})
        else:
            out.append({**message, "content": content})
        previous_role = role
    if tools:
        system = HERMES_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + system) if out[0]["content"] else system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None


def _text(content: Any, where: str) -> str:
    """A message content as one string: None is "", text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ToolCallingError(f"{where} must be a string or a list of text parts", where)


def _calls(message: dict, i: int) -> list[tuple[str, Any]]:
    """(name, arguments) of each item of an assistant message's ``tool_calls``."""
    calls = message["tool_calls"]
    if not isinstance(calls, list):
        raise ToolCallingError(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}].function"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolCallingError(f"{where} must be an object with a string name", where)
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, (str, dict)):
            raise ToolCallingError(f"{where}.arguments must be a JSON string", f"{where}.arguments")
        out.append((function["name"], arguments))
    return out


def _parsed(arguments: str | dict) -> Any:
    """Arguments as a dict for HF templates (text that is not a JSON object stays text)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _as_json(arguments: str | dict) -> str:
    """Arguments as JSON text for a ``<tool_call>`` block: valid JSON text as written, else encoded."""
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    try:
        json.loads(arguments)
    except ValueError:
        return json.dumps(arguments, ensure_ascii=False)
    return arguments
