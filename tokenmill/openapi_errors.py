"""The error answers in the OpenAPI schemas (``/openapi.json``) of ``tokenmill serve`` and ``tokenmill router``.

FastAPI documents a 422 with its own validation-error body on every route that reads a body or a
parameter; neither app ever sends that: every refusal is a 4xx with an OpenAI error body
(``{"error": {"message", "type", "param", "code"}}``; 400 for a bad field), and 503 means "not now"
(loading, no healthy worker, queue full, engine dead). :func:`document_error_responses` rewrites each
operation's responses to say so, so a client generator or a schema fuzzer (tests/test_api_fuzz.py)
sees what the apps answer. Imports only FastAPI; never the engine or torch.
"""
from __future__ import annotations

from fastapi import FastAPI

ERROR_SCHEMA_NAME = "ErrorResponse"
ERROR_SCHEMA = {
    "title": ERROR_SCHEMA_NAME,
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "code": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
        },
    }},
}
ERROR_RESPONSES = {
    "4XX": "Refused: an OpenAI error body; 400 names the request field at fault in param",
    "503": "Not serving now (loading, asleep, no healthy worker, queue full, engine stopped): an OpenAI error body",
}
_FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")
# Routes whose 200 is a server-sent event stream when the body says "stream": true (both apps).
STREAMING_PATHS = ("/v1/completions", "/v1/chat/completions")
SSE_CONTENT = {"text/event-stream": {"schema": {
    "description": "server-sent events: one `data:` line per chunk (the JSON object OpenAI streams), then "
                   "`data: [DONE]`"}}}


def document_error_responses(app: FastAPI) -> None:
    """Make ``app.openapi()`` document, for every operation, the OpenAI error body under ``4XX`` and
    ``503`` in place of FastAPI's 422 (which neither app sends), and the event stream a generation route
    answers with ``"stream": true`` (``STREAMING_PATHS``) beside its JSON 200; built once, on first use."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        ref = {"$ref": f"#/components/schemas/{ERROR_SCHEMA_NAME}"}
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                if path in STREAMING_PATHS and "200" in responses:
                    responses["200"].setdefault("content", {}).update(SSE_CONTENT)
                for status, description in ERROR_RESPONSES.items():
                    responses.setdefault(status, {"description": description,
                                                  "content": {"application/json": {"schema": ref}}})
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in _FASTAPI_VALIDATION_SCHEMAS:
            components.pop(name, None)
        components[ERROR_SCHEMA_NAME] = ERROR_SCHEMA
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
