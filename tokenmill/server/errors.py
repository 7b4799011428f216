"""OpenAI-style error bodies and the FastAPI exception handlers that produce them.

Every error the server returns has the shape
``{"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}``.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.security.http import allowed_methods

logger = logging.getLogger(__name__)

# pydantic tags union members in error locations ("str", "list[int]", "TextContentPart");
# such segments are not field names and are left out of ``param``.
_TYPE_TAGS = {"str", "int", "float", "bool", "none"}


class APIError(Exception):
    """An error to return to the client as an OpenAI error body.

    Args:
        message: what went wrong, naming the field and the offending value.
        status_code: HTTP status (400 unless stated).
        type: OpenAI error type ("invalid_request_error", "not_found_error", ...).
        param: the request field at fault, or None.
        code: a short machine-readable code, or None.
    """

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        """This error as an HTTP response with an OpenAI error body."""
        return error_response(self.message, self.status_code, self.type, self.param, self.code)


def error_response(
    message: str, status_code: int, type: str, param: str | None = None, code: str | int | None = None
) -> JSONResponse:
    """A JSONResponse carrying an OpenAI error body."""
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status_code)


def field_error(message: str, aliases: dict[str, str] | None = None) -> APIError:
    """An APIError for a ``SamplingParams``/engine ValueError, whose first word names the field.

    SamplingParams messages read "<field> must be ..., got <value>"; ``aliases`` renames fields
    to the request's names (in the message too).
    """
    first = message.split(" ", 1)[0].strip(":,")
    if not first.isidentifier():
        return APIError(message)
    param = (aliases or {}).get(first, first)
    return APIError(param + message[len(first):], param=param)


def param_from_loc(loc: tuple) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``; union-member tags are dropped."""
    parts: list[str] = []
    for segment in loc[1:] if loc and loc[0] in ("body", "query", "path") else loc:
        if isinstance(segment, int):
            if parts:
                parts[-1] += f"[{segment}]"
        elif segment.isidentifier() and segment[:1].islower() and segment not in _TYPE_TAGS:
            parts.append(segment)
    return ".".join(parts) or None


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    # A union field (``prompt``: text or lists) reports one error per member; a failed value check
    # (such as a lone surrogate in one string of a list) says more than "not a string", so it wins.
    value_errors = [e for e in errors if e.get("type") == "value_error"]
    first = (value_errors or errors or [{"loc": (), "msg": "invalid request", "type": ""}])[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg"))
        return error_response(f"request body is not valid JSON: {detail}", 400, "invalid_request_error")
    param = param_from_loc(tuple(first.get("loc", ())))
    msg = str(first.get("msg")).removeprefix("Value error, ")
    message = f"{param}: {msg}" if param else msg
    if "input" in first and param:
        message += f" (got {first['input']!r})"[:300]
    return error_response(message, 400, "invalid_request_error", param)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    response = error_response(str(exc.detail), exc.status_code, error_type, code=getattr(exc, "code", None))
    response.headers.update(exc.headers or {})
    if exc.status_code == 405:  # RFC 9110: a 405 names the methods the path takes
        response.headers["Allow"] = allowed_methods(request.app.router.routes, request.url.path)
    return response


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return error_response(f"internal server error: {type(exc).__name__}: {exc}", 500, "internal_server_error")


def install_error_handlers(app: FastAPI) -> None:
    """Make validation errors, APIErrors, HTTP errors and crashes all return OpenAI error bodies."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
