"""Who may call which route of the router, checked on every HTTP request before any route runs.

Three kinds of route: public (``/health``, and ``/metrics`` with ``--metrics-without-auth``), worker
administration (``/workers`` and below: ``--admin-api-key``, and the clients' key never opens it when one is
set; without ``--admin-api-key``, ``--api-key`` also guards ``/workers``) and the rest (``/v1/...``,
``/metrics``, anything else: ``--api-key``). Every request also passes the Host check
(DNS rebinding), every state-changing request must declare a JSON body (which a cross-site page cannot
send), and bodies are capped: the shared middlewares of tokenmill/security/http.py, as ``tokenmill
serve`` uses them. Refusals are OpenAI error bodies. No routing, no worker state here.
"""
from __future__ import annotations

import hmac
from typing import Sequence

from starlette.routing import BaseRoute

from tokenmill.security.http import (AllowedHostsMiddleware, APIKeyMiddleware, ASGIApp, BodySizeLimitMiddleware,
                                     JSONContentTypeMiddleware, send_error)

ADMIN_PATH = "/workers"
PUBLIC_PATHS = ("/health",)
METRICS_PATH = "/metrics"


def _authorization(scope) -> bytes:
    for key, value in scope["headers"]:
        if key == b"authorization":
            return value
    return b""


def is_admin_path(path: str) -> bool:
    """``/workers`` and every path below it (register, list, remove workers)."""
    return path == ADMIN_PATH or path.startswith(ADMIN_PATH + "/")


class AdminKeyMiddleware:
    """Require ``Authorization: Bearer <admin_api_key>`` on the administration paths (``is_admin_path``):
    401 otherwise. Other paths pass untouched (the clients' key is checked separately)."""

    def __init__(self, app: ASGIApp, admin_api_key: str) -> None:
        if not admin_api_key:
            raise ValueError("admin_api_key must be a non-empty string")
        self.app = app
        self.expected = f"Bearer {admin_api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and is_admin_path(scope["path"]):
            if not hmac.compare_digest(_authorization(scope), self.expected):
                await send_error(send, 401, "worker administration needs the router's admin key: send "
                                 "'Authorization: Bearer <--admin-api-key>'", "authentication_error",
                                 "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


def guarded(app: ASGIApp, api_key: str | None, admin_api_key: str | None, allowed_hosts: tuple[str, ...] | None,
            max_body_bytes: int, metrics_without_auth: bool = False, routes: Sequence[BaseRoute] | None = None
            ) -> ASGIApp:
    """``app`` behind the router's checks, outermost first: Host (``allowed_hosts`` from
    ``allowed_hosts_for``; None: any), the admin key on ``/workers``, the clients' key elsewhere (but
    ``/health``, and ``/metrics`` when ``metrics_without_auth``), a JSON content type on state-changing
    methods (415), and the body cap in bytes (413). A key that is None is not required. Without
    ``admin_api_key``, ``api_key`` also guards ``/workers`` (a loopback router with only a client key is
    not open to administration by anyone on the host). ``routes``: the app's routes, so that a method no
    route takes gets the app's 405 (or 404) rather than a 415 (``JSONContentTypeMiddleware``)."""
    app = BodySizeLimitMiddleware(app, max_body_bytes)
    app = JSONContentTypeMiddleware(app, routes)
    if api_key:
        public = PUBLIC_PATHS + ((METRICS_PATH,) if metrics_without_auth else ())
        admin = ((ADMIN_PATH,), (ADMIN_PATH + "/",)) if admin_api_key else ((), ())  # the admin key's alone
        app = APIKeyMiddleware(app, api_key, public_paths=(*public, *admin[0]), public_prefixes=admin[1])
    if admin_api_key:
        app = AdminKeyMiddleware(app, admin_api_key)
    return AllowedHostsMiddleware(app, allowed_hosts)
