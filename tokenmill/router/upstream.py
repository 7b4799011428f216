"""The data plane to the workers: one shared ``aiohttp`` session, what a broken connection raises, and
how an upstream response is let go (back to the pool when read to the end, else closed, so the worker aborts)."""
from __future__ import annotations

import asyncio

import aiohttp
from starlette.responses import Response
from starlette.types import Receive

# What a broken worker connection raises on the data plane (connect, send, or read).
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
# Idle upstream connections are dropped after this long, before a worker's own keep-alive timeout
# (uvicorn's default: 5 s) closes them under a request that was just sent on one.
UPSTREAM_KEEPALIVE_S = 4.0


def upstream_session(request_timeout: float, connect_timeout: float = 10.0) -> aiohttp.ClientSession:
    """The data-plane client: no connection limit, bytes passed through undecoded, ``request_timeout``
    (seconds) as the longest wait for a worker's headers or next chunk. Create it inside the event
    loop that uses it."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=request_timeout),
        auto_decompress=False, skip_auto_headers=("User-Agent",))


def close_upstream(response: aiohttp.ClientResponse) -> None:
    """Done with an upstream response: its connection goes back to the pool when the body was read to
    the end, else it is closed (the worker sees the disconnect and aborts the request)."""
    if response.content.at_eof():
        response.release()
    else:
        response.close()


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class RetryElsewhere(Exception):
    """This attempt failed before anything reached the client; try another worker."""

    def __init__(self, reason: str, detail: str, response: Response | None = None) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.response = reason, detail, response


class UpstreamTimeout(Exception):
    """The worker took longer than the request timeout to answer."""
