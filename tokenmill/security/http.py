"""ASGI middleware that guards an HTTP surface against browsers and oversized requests: the Host header
(DNS rebinding), a bearer API key on every path but a public few, a JSON content type on state-changing
methods (no cross-site "simple" requests), and request bodies bounded while they are read: in bytes per
request, in time (a body trickled in slowly), and in bytes buffered by all requests together.

Shared by ``tokenmill serve`` and ``tokenmill router``. Plain ASGI on starlette only: imports nothing from
``server/`` or ``router/``. Every refusal is an OpenAI error body (docs/security.md).
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import re
import socket
import time
from typing import Awaitable, Callable, Iterable, Sequence

from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match

from tokenmill.security.addresses import is_loopback

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")  # always allowed: a rebinding page cannot send them
STATE_CHANGING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024**2  # 128k prompt tokens as JSON ids are about 1 MB
DEFAULT_REQUEST_BODY_TIMEOUT_S = 60.0  # a whole request body must arrive this soon after its headers
DEFAULT_MAX_BUFFERED_BODY_BYTES = 256 * 1024**2  # request body bytes held by all requests of a server together
ANY_IP_LITERAL = "<any IP address>"  # an allowed-hosts entry: any IP literal (a rebinding page needs a DNS name)
_PORT = re.compile(r"[0-9]{1,5}")


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> bytes:
    """An OpenAI error body, ``{"error": {"message", "type", "param", "code"}}``, as JSON bytes."""
    return json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}}).encode()


async def send_error(send: Callable[[dict], Awaitable[None]], status: int, message: str, type: str,
                     code: str | None = None, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Send a whole JSON error response (``status``, OpenAI error body) through ASGI ``send``."""
    body = error_body(message, type, None, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None




def this_hosts_names() -> list[str]:
    """This machine's host name, fully qualified name and their addresses, lowercase (empty on lookup errors)."""
    names = [socket.gethostname().lower(), socket.getfqdn().lower()]
    addresses = []
    for name in names:
        try:
            addresses += [str(info[4][0]).split("%", 1)[0].lower() for info in socket.getaddrinfo(name, None)]
        except OSError:
            continue
    return list(dict.fromkeys(n for n in [*names, *addresses] if n))


def allowed_hosts_for(bind_host: str, allowed_hosts: Iterable[str] | None) -> tuple[str, ...] | None:
    """The Host header names a server bound to ``bind_host`` answers (None: any).

    ``allowed_hosts`` None: on a loopback bind, the loopback names and the bind host; beyond loopback, also
    this machine's names and addresses (``this_hosts_names``) and any IP literal (``ANY_IP_LITERAL``): a
    DNS-rebinding page needs a DNS name, so only foreign names are refused (clients reaching the server
    by another DNS name need ``--allowed-hosts``). Given: those names (``*`` any, ``*.example.com`` any
    subdomain), plus the loopback names and the bind host (a DNS-rebinding page can make a browser send
    neither).
    """
    names = [h.strip().lower() for h in (allowed_hosts or ())]
    if "*" in names:
        return None
    extra = [bind_host.strip("[]").lower()] if bind_host not in ("0.0.0.0", "::", "") else []
    if allowed_hosts is None and not is_loopback(bind_host):
        extra += [*this_hosts_names(), ANY_IP_LITERAL]
    return tuple(dict.fromkeys([*names, *LOOPBACK_HOSTS, *extra]))


def host_name(header: str) -> str | None:
    """The name of a Host header value without its port, lowercase (``[::1]:8000`` -> ``::1``); None when it
    is not ``name``, ``name:port``, ``[ipv6]`` or ``[ipv6]:port`` (port: digits only)."""
    header = header.strip().lower()
    if header.startswith("["):
        name, bracket, rest = header[1:].partition("]")
        if not bracket or not name or (rest and not (rest[:1] == ":" and _PORT.fullmatch(rest[1:]))):
            return None
        return name
    if header.count(":") > 1:  # a bare IPv6 address (no port can be told apart)
        return header
    name, colon, port = header.partition(":")
    if not name or (colon and not _PORT.fullmatch(port)) or any(c in name for c in "@/\\?#[] \t"):
        return None
    return name


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_matches(name: str | None, allowed: Iterable[str]) -> bool:
    """Whether ``name`` (no port) is one of ``allowed`` (exact, ``*.suffix`` for subdomains, or any IP literal
    when ``ANY_IP_LITERAL`` is listed); None (an unparsable Host) matches nothing."""
    if name is None:
        return False
    for pattern in allowed:
        if pattern == name or (pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
        if pattern.lower() == ANY_IP_LITERAL.lower() and _is_ip_literal(name):  # the middleware lowercases it
            return True
    return False


class AllowedHostsMiddleware:
    """Refuse requests whose ``Host`` header (port ignored) is not allowed: 400, OpenAI error body.

    Args:
        app: the ASGI app behind it.
        allowed_hosts: names from ``allowed_hosts_for`` (None: every host is served).
    """

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str] | None) -> None:
        self.app = app
        self.allowed = None if allowed_hosts is None else tuple(h.lower() for h in allowed_hosts)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.allowed is not None:
            hosts = [v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"host"]
            host = hosts[0] if len(hosts) == 1 else None  # none, or two (which one would a proxy use?)
            if host is None or not host_matches(host_name(host), self.allowed):
                host = host if len(hosts) < 2 else ", ".join(hosts)
                await send_error(send, 400, f"Host header {host!r} is not served here; allowed: "
                                 f"{', '.join(self.allowed)} (--allowed-hosts)", "invalid_request_error",
                                 "invalid_host")
                return
        await self.app(scope, receive, send)


class APIKeyMiddleware:
    """Require ``Authorization: Bearer <api_key>`` on every path except the public ones: 401 otherwise.

    Args:
        app: the ASGI app behind it.
        api_key: the key (compared in constant time).
        public_paths: paths served without the key (exact match).
        public_prefixes: path prefixes served without the key (``/static/``).
    """

    def __init__(self, app: ASGIApp, api_key: str, public_paths: Iterable[str] = (),
                 public_prefixes: Iterable[str] = ()) -> None:
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.public_paths = frozenset(public_paths)
        self.public_prefixes = tuple(public_prefixes)

    def is_public(self, path: str) -> bool:
        """Whether ``path`` is served without the key."""
        return path in self.public_paths or path.startswith(self.public_prefixes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and not self.is_public(scope["path"]):
            given = (_header(scope, b"authorization") or "").encode("latin-1")
            if not hmac.compare_digest(given, self.expected):
                await send_error(send, 401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                                 "authentication_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class JSONContentTypeMiddleware:
    """Refuse POST/PUT/PATCH/DELETE requests whose ``Content-Type`` is not ``application/json``: 415.

    A browser sends a cross-site request without asking the server first (a CORS preflight) only with a
    "simple" content type (``text/plain``, form encodings); requiring JSON makes every state-changing
    request one the server's CORS policy decides. Routes without a body need the header too.

    ``routes`` (the app's route list, read live): a request that no route takes with its method is let
    through, so the app answers 404, or 405 with ``Allow``, and no handler runs; None: refuse them all.
    """

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute] | None = None) -> None:
        self.app = app
        self.routes = routes

    def _routed(self, scope) -> bool:
        """Whether a route would run a handler for this method and path (checked only before a 415)."""
        return self.routes is None or any(route.matches(scope)[0] == Match.FULL for route in self.routes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] in STATE_CHANGING_METHODS:
            content_type = _header(scope, b"content-type")
            media_type = (content_type or "").split(";", 1)[0].strip().lower()
            if media_type != "application/json" and self._routed(scope):
                await send_error(send, 415, f"{scope['method']} requests need 'Content-Type: application/json' "
                                 f"(got {content_type!r}), even without a body", "invalid_request_error",
                                 "unsupported_media_type")
                return
        await self.app(scope, receive, send)


def allowed_methods(routes: Sequence[BaseRoute], path: str) -> str:
    """The ``Allow`` header of a 405 at ``path``: every method some route takes there, comma-separated
    (Starlette's own 405 names only the first route's, so ``GET /workers`` hid ``POST /workers``)."""
    methods: set[str] = set()
    for route in routes:
        regex, route_methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and route_methods and regex.match(path):
            methods |= route_methods
    return ", ".join(sorted(methods))


class BodyRefused(HTTPException):
    """Raised from ``receive`` when a request body is refused while it is read (FastAPI passes it through its
    body reader to the app's HTTPException handler, which may read ``code``); ``BodySizeLimitMiddleware``
    answers it itself when the app lets it through."""

    code = "request_refused"

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)


class RequestBodyTooLarge(BodyRefused):
    """A body past the per-request cap: 413."""

    code = "request_too_large"

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body is larger than {max_bytes} bytes (--max-request-body-bytes)")


class RequestBodyTimeout(BodyRefused):
    """A body that did not arrive whole within the deadline: 408."""

    code = "request_timeout"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s (--request-body-timeout)")


class BodyBudgetExhausted(BodyRefused):
    """Request bodies being read hold the server-wide budget of buffered bytes: 503, retry later."""

    code = "server_busy"

    def __init__(self, budget: int) -> None:
        super().__init__(503, f"the server holds {budget} bytes of request bodies already "
                              "(--max-buffered-body-bytes); retry later", {"Retry-After": "1"})


class BodySizeLimitMiddleware:
    """Bound request bodies: ``max_bytes`` each (413), ``timeout_s`` from the headers to the body's last byte
    (408), and ``max_buffered_bytes`` held by all requests being served together (503 with ``Retry-After``).
    Every refusal is an OpenAI error body.

    A declared ``Content-Length`` over the cap, or over what is left of the shared budget, is refused before
    any of the body is read; a chunked body (or one longer than declared) is counted as it arrives and cut off
    at the first message past a limit, so nothing over the limits plus one receive message is ever held. A
    request's bytes count against the budget until its response is done. One instance serves one event loop.

    Args:
        app: the ASGI app behind it.
        max_bytes: the most body bytes a request may carry (>= 1).
        timeout_s: seconds a request's whole body may take to arrive (None: no limit).
        max_buffered_bytes: body bytes all requests may hold at once (None: no limit).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float | None = DEFAULT_REQUEST_BODY_TIMEOUT_S,
                 max_buffered_bytes: int | None = DEFAULT_MAX_BUFFERED_BODY_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_buffered_bytes is not None and max_buffered_bytes < 1:
            raise ValueError(f"max_buffered_bytes must be >= 1, got {max_buffered_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_buffered_bytes = max_buffered_bytes
        self.buffered = 0  # body bytes held by requests being served now

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        declared = int(declared) if declared is not None and declared.strip().isdigit() else None
        refusal: BodyRefused | None = None
        if declared is not None and declared > self.max_bytes:
            refusal = RequestBodyTooLarge(self.max_bytes)
        elif declared and self.max_buffered_bytes is not None and self.buffered + declared > self.max_buffered_bytes:
            refusal = BodyBudgetExhausted(self.max_buffered_bytes)
        if refusal is not None:
            await self._refuse(send, refusal)
            return
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        received = 0
        body_done = False
        started = False

        async def limited_receive() -> dict:
            nonlocal received, body_done
            if body_done or deadline is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise RequestBodyTimeout(self.timeout_s) from None
            if message["type"] == "http.request":
                size = len(message.get("body", b""))
                received += size
                self.buffered += size
                body_done = not message.get("more_body", False)
                if received > self.max_bytes:
                    raise RequestBodyTooLarge(self.max_bytes)
                if self.max_buffered_bytes is not None and self.buffered > self.max_buffered_bytes:
                    raise BodyBudgetExhausted(self.max_buffered_bytes)
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyRefused as exc:
            if started:
                raise
            await self._refuse(send, exc)
        finally:
            self.buffered -= received

    @staticmethod
    async def _refuse(send, exc: BodyRefused) -> None:
        headers = [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
        await send_error(send, exc.status_code, exc.detail, "invalid_request_error", exc.code, headers)
