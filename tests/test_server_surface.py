"""The HTTP surface of `tokenmill serve` against hostile clients (issue 41, item 5): two real servers on
127.0.0.1, one with the defaults and one with --api-key, --allowed-hosts and --allowed-origins.

- every route the app serves needs the key except an explicit public list (the routes are enumerated from
  ``app.routes``, so a new route that is not covered fails here);
- a DNS-rebinding request (``Host: attacker.example``) is refused, /health included;
- a cross-site ``text/plain`` (or form) POST cannot reach a state-changing route: 415, the engine stays awake;
- a body over --max-request-body-bytes is refused with 413 before the client has sent it (declared length),
  or as soon as a chunked body passes the cap (no terminating chunk is ever sent);
- CORS: no allow headers for a foreign origin by default; the configured origin gets them.
"""
from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx2 as httpx
import pytest

from tests.server_fixtures import ServerProcess

API_KEY = "surface-test-key"
ARGS = ["--max-model-len", "256", "--num-threads", "1", "--enable-rl-endpoints"]
GOOD_ORIGIN = "https://app.example"
EVIL_ORIGIN = "https://evil.example"
PUBLIC = {"/health", "/ready", "/", "/static"}  # served without the key (the probes and the data-free web page)
JSON = {"content-type": "application/json"}
MiB = 1024 * 1024
BODY_TIMEOUT_S = 12  # the keyed server's --request-body-timeout
BODY_BUDGET = 4 * MiB  # the keyed server's --max-buffered-body-bytes


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(plain: the defaults, keyed: --api-key --allowed-hosts --allowed-origins), both healthy."""
    logs = tmp_path_factory.mktemp("logs")
    plain = ServerProcess(None, ARGS, logs / "plain.log")
    keyed = ServerProcess(None, [*ARGS, "--allowed-hosts", "api.example", "--allowed-origins", GOOD_ORIGIN,
                                 "--request-body-timeout", str(BODY_TIMEOUT_S),
                                 "--max-buffered-body-bytes", str(BODY_BUDGET),
                                 "--session-save-path", str(tmp_path_factory.mktemp("sessions"))],
                          logs / "keyed.log", api_key=API_KEY)
    try:
        yield plain.wait_healthy(), keyed.wait_healthy()
    finally:
        codes = plain.stop(), keyed.stop()
    assert codes == (0, 0), (plain.log()[-2000:], keyed.log()[-2000:])


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    return error


def app_routes(config) -> list[tuple[str, str, str]]:
    """(method, route path, URL to request) of every route ``build_app(config)`` serves: its own routes, the
    routes of the routers it includes (FastAPI keeps those behind ``effective_route_contexts``) and mounts."""
    from starlette.routing import Mount

    from tokenmill.server.api_server import build_app

    app = build_app(config)
    flat = []
    for route in app.routes:
        if hasattr(route, "effective_route_contexts"):  # an included APIRouter (/v1, RL, LoRA, sessions)
            flat.extend((c.path, c.original_route) for c in route.effective_route_contexts())
        else:
            flat.append((route.path, route))
    routes = []
    for path, route in flat:
        if isinstance(route, Mount):
            routes.append(("GET", path, f"{path}/app.js"))
            continue
        for method in sorted(route.methods - {"HEAD"}):
            routes.append((method, path, re.sub(r"\{[^}]+\}", "x", path)))
    schema_paths = {re.sub(r"\{(\w+):\w+\}", r"{\1}", path) for _, path, _ in routes}  # {model:path} -> {model}
    assert set(app.openapi()["paths"]) <= schema_paths  # nothing the schema lists is missed
    return routes


# ---- the API key ----------------------------------------------------------------------------------------
def test_every_route_needs_the_api_key_except_the_public_list(servers):
    from tokenmill.server.api_server import PUBLIC_PATHS, PUBLIC_PREFIXES
    from tokenmill.server.state import ServerConfig

    _, keyed = servers
    assert set(PUBLIC_PATHS) | {p.rstrip("/") for p in PUBLIC_PREFIXES} == PUBLIC  # widening it is a decision
    routes = app_routes(ServerConfig(served_model_name="m", api_key=API_KEY, enable_rl_endpoints=True))
    paths = {path for _, path, _ in routes}
    assert {"/tokenize", "/detokenize", "/tokenizer_info", "/metrics", "/version", "/v1/models", "/sleep",
            "/openapi.json", "/static"} <= paths  # the enumeration sees the routes of every router
    with httpx.Client(base_url=keyed.url, timeout=60) as client:
        for method, path, url in routes:
            body = {"content": b"{}", "headers": JSON} if method in ("POST", "PUT", "PATCH", "DELETE") else {}
            for key in (None, "wrong"):
                headers = {**body.get("headers", {}), **({"Authorization": f"Bearer {key}"} if key else {})}
                response = client.request(method, url, content=body.get("content"), headers=headers)
                if path in PUBLIC:
                    assert response.status_code != 401, (method, url)
                else:
                    assert_openai_error(response, 401, "invalid_api_key")
        for url in ("/tokenize", "/detokenize"):  # the cases, answered with the key
            body = {"prompt": "hi"} if url == "/tokenize" else {"tokens": [1, 2]}
            assert client.post(url, json=body, headers=keyed.headers()).status_code == 200
        for url in ("/tokenizer_info", "/metrics", "/version", "/openapi.json"):
            assert client.get(url, headers=keyed.headers()).status_code == 200, url
        assert client.get("/v1/no-such-route").status_code == 401  # nothing to learn about paths without the key


def test_metrics_without_auth_opens_metrics_only():
    """In-process app (no engine started): --metrics-without-auth takes /metrics, and nothing else, off the key."""
    from tokenmill.server.api_server import build_app
    from tokenmill.server.state import ServerConfig

    async def status(config, path: str) -> int:
        transport = httpx.ASGITransport(app=build_app(config))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return (await client.get(path)).status_code

    opened = ServerConfig(served_model_name="m", api_key=API_KEY, metrics_without_auth=True)
    assert asyncio.run(status(opened, "/metrics")) == 200
    assert asyncio.run(status(opened, "/tokenizer_info")) == 401
    assert asyncio.run(status(ServerConfig(served_model_name="m", api_key=API_KEY), "/metrics")) == 401


# ---- the Host header (DNS rebinding) --------------------------------------------------------------------
def test_foreign_host_header_is_refused(servers):
    plain, keyed = servers
    for server in (plain, keyed):
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
            response = httpx.request(method, f"{server.url}{path}", timeout=30,
                                     headers={"Host": f"attacker.example:{server.port}", **JSON, **server.headers()},
                                     json={"prompt": "hi", "max_tokens": 1})
            assert_openai_error(response, 400, "invalid_host")
        for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", f"[::1]:{server.port}", "localhost"):
            assert httpx.get(f"{server.url}/health", headers={"Host": host}, timeout=30).status_code == 200, host
    listed = httpx.get(f"{keyed.url}/health", headers={"Host": f"api.example:{keyed.port}"}, timeout=30)
    assert listed.status_code == 200  # --allowed-hosts api.example
    assert httpx.get(f"{plain.url}/health", headers={"Host": "api.example"}, timeout=30).status_code == 400
    status, _ = raw_exchange(plain.port, b"GET /health HTTP/1.0\r\n\r\n")  # no Host header at all
    assert status == 400


def test_malformed_and_duplicate_host_headers_are_refused(servers):
    """A Host that only starts like a loopback name (userinfo, junk after ``]``, a non-numeric port), or two
    Host headers (a proxy may route by the other one), is refused: 400."""
    plain, _ = servers
    for host in (f"127.0.0.1:{plain.port}@attacker.example", "[::1]evil", f"[::1]:{plain.port}.attacker.example",
                 "localhost:80x", "localhost:"):
        head = f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
        status, body = raw_exchange(plain.port, head)
        assert status == 400 and json.loads(body)["error"]["code"] == "invalid_host", host
    head = (f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{plain.port}\r\nHost: attacker.example\r\n"
            "Connection: close\r\n\r\n").encode()
    assert raw_exchange(plain.port, head)[0] == 400
    head = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{plain.port}\r\nConnection: close\r\n\r\n".encode()
    assert raw_exchange(plain.port, head)[0] == 200


def test_allowed_hosts_default_depends_on_the_bind_address():
    from tokenmill.security.http import allowed_hosts_for, host_matches, host_name

    assert allowed_hosts_for("127.0.0.1", None) == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts_for("::1", None) == ("localhost", "127.0.0.1", "::1")
    import socket as _socket

    for bind in ("0.0.0.0", "::", "10.0.0.5"):  # beyond loopback: this host's names and any IP literal
        allowed = allowed_hosts_for(bind, None)
        assert allowed is not None and _socket.gethostname().lower() in allowed
        for ok in ("localhost", "127.0.0.1", "192.168.1.20", "2001:db8::1", _socket.getfqdn().lower()):
            assert host_matches(host_name(f"{ok}:8000") if ":" not in ok else ok, allowed), (bind, ok)
        for foreign in ("attacker.example", "rebind.attacker.example", "192.168.1.20.nip.io"):
            assert not host_matches(host_name(foreign), allowed), (bind, foreign)
    assert "10.0.0.5" in allowed_hosts_for("10.0.0.5", None)
    assert allowed_hosts_for("0.0.0.0", ["API.example"]) == ("api.example", "localhost", "127.0.0.1", "::1")
    assert "10.0.0.5" in allowed_hosts_for("10.0.0.5", ["api.example"])
    assert allowed_hosts_for("127.0.0.1", ["*"]) is None
    assert [host_name(h) for h in ("A.example:80", "[::1]:8000", "::1", "x")] == ["a.example", "::1", "::1", "x"]
    for bad in ("127.0.0.1:8000@attacker.example", "[::1]evil", "[::1]:80x", "localhost:", "a:b@c", "[]:80"):
        assert host_name(bad) is None, bad
    assert host_matches("a.b.example", ["*.b.example"]) and not host_matches("evilb.example", ["*.b.example"])


# ---- cross-site simple requests -------------------------------------------------------------------------
def test_cross_site_text_plain_post_cannot_put_the_engine_to_sleep(servers):
    plain, _ = servers
    # What a page on another site can send without a CORS preflight: text/plain, form encodings, no type.
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"},
                    {"content-type": "multipart/form-data; boundary=x"}, {}):
        response = httpx.post(f"{plain.url}/sleep", content=b"{}", timeout=30,
                              headers={"Origin": EVIL_ORIGIN, **headers})
        assert_openai_error(response, 415, "unsupported_media_type")
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    assert httpx.post(f"{plain.url}/v1/completions", content=body, timeout=30,
                      headers={"content-type": "text/plain"}).status_code == 415
    assert httpx.delete(f"{plain.url}/v1/sessions/x", timeout=30).status_code == 415
    assert httpx.get(f"{plain.url}/is_sleeping", timeout=30).json() == {"is_sleeping": False}
    assert plain.post("/v1/completions", {"prompt": "still awake", "max_tokens": 2}).status_code == 200
    # A JSON request without a body (what a same-site client sends) still works.
    assert httpx.post(f"{plain.url}/resume_generation", headers=JSON, timeout=30).status_code == 200


# ---- the request body cap -------------------------------------------------------------------------------
def raw_exchange(port: int, head: bytes, body_parts=(), timeout: float = 120.0) -> tuple[int, bytes]:
    """Send ``head`` then each of ``body_parts`` on a raw socket (never finishing a body it does not
    finish), then read one response; returns (status, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        for part in body_parts:
            sock.sendall(part)
        header, body = read_response(sock)
    return int(header.split(b" ", 2)[1]), body


def read_response(sock: socket.socket, data: bytes = b"") -> tuple[bytes, bytes]:
    """Read one HTTP response from ``sock`` (``data``: bytes already received) through its whole
    Content-Length body, however the server splits it into segments; returns (header, body)."""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    header, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", header)
    while length and len(body) < int(length.group(1)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return header, body


def test_declared_64_mib_body_is_refused_before_it_is_sent(servers):
    plain, _ = servers
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{plain.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {64 * MiB}\r\n\r\n").encode()
    status, body = raw_exchange(plain.port, head, [b'{"prompt": "' + b"a" * 4096])  # 4 KiB of 64 MiB sent
    assert status == 413, body
    assert json.loads(body)["error"]["code"] == "request_too_large"
    # A client that sends the whole body (httpx, Content-Length) gets the same answer.
    response = httpx.post(f"{plain.url}/v1/completions", content=b"a" * (64 * MiB), headers=JSON, timeout=120)
    assert_openai_error(response, 413)
    assert plain.post("/v1/completions", {"prompt": "still serving", "max_tokens": 2}).status_code == 200


def test_chunked_body_is_cut_off_at_the_cap(servers):
    plain, _ = servers
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{plain.port}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    chunk = b"%x\r\n" % MiB + b" " * MiB + b"\r\n"
    # 17 chunks of 1 MiB pass the 16 MiB default; the terminating chunk never comes, so only a server that
    # enforces the cap while reading answers at all.
    status, body = raw_exchange(plain.port, head, [chunk] * 17)
    assert status == 413, body
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and "max-request-body-bytes" in error["message"]
    assert plain.post("/v1/completions", {"prompt": "still serving", "max_tokens": 2}).status_code == 200


def test_a_body_trickled_in_gets_408_and_held_bodies_share_a_budget(servers):
    """Slowloris on the body: a request that never sends its last bytes is answered 408 after
    --request-body-timeout instead of being held forever; while bodies being read hold
    --max-buffered-body-bytes, another request declaring more gets 503 with Retry-After, not memory."""
    _, keyed = servers
    auth = f"Authorization: Bearer {API_KEY}\r\n"

    def head(length: int) -> bytes:
        return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{keyed.port}\r\n{auth}"
                f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()

    with socket.create_connection(("127.0.0.1", keyed.port), timeout=60) as holder:
        holder.sendall(head(3 * MiB) + b" " * (3 * MiB - 10))  # all but 10 bytes: held until the deadline
        sent = time.monotonic()
        # Probes declare 2 MiB but send no body, so they never add to the budget (a probe admitted while the holder's
        # bytes still arrive would otherwise race it over the budget, and one of the two would be refused): once the
        # server has read the holder's bytes, a probe is refused at once, before any body.
        while True:
            with socket.create_connection(("127.0.0.1", keyed.port), timeout=60) as probe:
                probe.sendall(head(2 * MiB))
                probe.settimeout(0.5)
                try:
                    reply = probe.recv(65536)
                except socket.timeout:  # admitted: it waits for a body that never comes
                    reply = b""
                if reply:  # refused: the head and the body may come in separate segments
                    probe.settimeout(60)
                    header, body = read_response(probe, reply)
            if reply or time.monotonic() - sent > BODY_TIMEOUT_S - 3:
                break
            time.sleep(0.05)
        status = int(header.split(b" ", 2)[1]) if reply else None
        assert status == 503 and b"retry-after" in header.lower(), reply
        assert json.loads(body)["error"]["code"] == "server_busy"
        status, _ = raw_exchange(keyed.port, head(3 * MiB), [b" " * 16], timeout=60)
        assert status in (503, 408)  # never buffered beyond the budget
        header, body = read_response(holder)  # the holder's own answer, once its body is late: 408
        assert int(header.split(b" ", 2)[1]) == 408, header
        assert json.loads(body)["error"]["code"] == "request_timeout"
    response = httpx.post(f"{keyed.url}/v1/completions", json={"prompt": "still serving", "max_tokens": 2},
                          headers={**keyed.headers(), "Host": "api.example"}, timeout=60)
    assert response.status_code == 200, response.text


# ---- CORS -----------------------------------------------------------------------------------------------
def preflight(server: ServerProcess, origin: str) -> httpx.Response:
    return httpx.options(f"{server.url}/v1/chat/completions", timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_is_off_unless_an_origin_is_allowed(servers):
    plain, keyed = servers
    for server, origin in ((plain, EVIL_ORIGIN), (plain, GOOD_ORIGIN), (keyed, EVIL_ORIGIN)):
        response = preflight(server, origin)  # without Access-Control-Allow-Origin the browser sends nothing
        assert "access-control-allow-origin" not in response.headers and response.status_code >= 400, response
        simple = httpx.get(f"{server.url}/v1/models", headers={"Origin": origin, **server.headers()}, timeout=30)
        assert "access-control-allow-origin" not in simple.headers
    allowed = preflight(keyed, GOOD_ORIGIN)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == GOOD_ORIGIN
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    models = httpx.get(f"{keyed.url}/v1/models", headers={"Origin": GOOD_ORIGIN, **keyed.headers()}, timeout=30)
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == GOOD_ORIGIN
    assert "access-control-allow-credentials" not in models.headers  # --allow-credentials is off
