"""OpenAI tool calling in the Hermes format: request validation (``tools.py``), parsing of model
output, whole or streamed (``hermes.py``), and tool turns for the chat template (``prompt.py``).

Pure Python: imports only ``tokenmill.sampling_params``, the standard library and jsonschema.
"""
from tokenmill.tool_calling.hermes import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    ExtractedToolCalls,
    HermesStreamParser,
    IdFactory,
    ToolCall,
    extract_tool_calls,
    new_tool_call_id,
)
from tokenmill.tool_calling.prompt import (
    HERMES_SYSTEM_PROMPT,
    conversation_for_template,
    template_supports_tools,
)
from tokenmill.tool_calling.tools import (
    ToolCallingError,
    ToolRequest,
    ToolSpec,
    parse_tools,
    tool_constraint,
)

__all__ = [
    "HERMES_SYSTEM_PROMPT",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "ExtractedToolCalls",
    "HermesStreamParser",
    "IdFactory",
    "ToolCall",
    "ToolCallingError",
    "ToolRequest",
    "ToolSpec",
    "conversation_for_template",
    "extract_tool_calls",
    "new_tool_call_id",
    "parse_tools",
    "template_supports_tools",
    "tool_constraint",
]
