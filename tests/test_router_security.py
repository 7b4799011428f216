"""The router cannot be hijacked: real router processes on 127.0.0.1, fake workers that record every
request they get, and hostile clients.

A cross-site page's ``text/plain`` POST cannot register a worker (415, nothing registered, no CORS);
``/workers`` needs ``--admin-api-key`` and the clients' key does not open it; a router beyond loopback
refuses to start without an admin key; ``--allowed-worker-urls`` refuses other URLs; workers see the
router's ``--worker-api-key`` and never a client's key or ``kv_transfer_params``; a foreign Host header
(DNS rebinding) is refused; oversized bodies get 413; ``/metrics`` needs the key unless
``--metrics-without-auth``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler

import httpx2 as httpx
import pytest

from tests.server_fixtures import REPO, LocalHTTPServer, free_port
from tests.test_router import RouterProcess, stop_all

CLIENT_KEY, ADMIN_KEY, WORKER_KEY = "client-key-1", "admin-key-2", "worker-key-3"
COMPLETION = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
              "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
CROSS_SITE = {"Origin": "https://attacker.example", "Content-Type": "text/plain;charset=UTF-8"}


class RecordingWorker:
    """A fake OpenAI worker on 127.0.0.1: ``/health`` 200, ``/v1/models`` one card, POSTs answered with a
    fixed completion; every request's (method, path, headers, parsed body) lands in ``seen``."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict, dict | None]] = []
        lock = threading.Lock()
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _record(self, body: dict | None) -> None:
                with lock:
                    seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))

            def _answer(self, status: int, payload: dict | None) -> None:
                data = json.dumps(payload).encode() if payload is not None else b""
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._record(None)
                if self.path == "/health":
                    self._answer(200, None)
                elif self.path == "/v1/models":
                    self._answer(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
                else:
                    self._answer(404, {"error": {"message": "no", "type": "not_found_error"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"null")
                self._record(body)
                self._answer(200, COMPLETION)

        self.http = LocalHTTPServer(Handler)
        self.url, self.port, self.close = self.http.url, self.http.server.server_address[1], self.http.close

    def posts(self) -> list[tuple[str, dict, dict]]:
        """(path, headers, body) of every POST received."""
        return [(path, headers, body) for method, path, headers, body in self.seen if method == "POST"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Four routers, each over its own recording worker: ``open`` (no keys, loopback, a 4 KiB body cap),
    ``keyed`` (client, admin and worker keys; the worker key from the environment), ``allow``
    (an allow-list of worker URLs, ``--allowed-hosts``, ``--metrics-without-auth``) and ``client_only``
    (client and worker keys, no admin key)."""
    logs = tmp_path_factory.mktemp("router_security")
    fakes = {name: RecordingWorker() for name in ("open", "keyed", "allow", "stranger", "client_only", "late")}
    fast = ["--policy", "round_robin", "--health-check-interval", "0.5"]
    env_before = os.environ.get("TOKENMILL_WORKER_API_KEY")
    os.environ["TOKENMILL_WORKER_API_KEY"] = WORKER_KEY  # the keyed router's worker key; the others have none
    routers = {}
    try:
        routers["keyed"] = RouterProcess([fakes["keyed"].url], fast, logs / "keyed.log", api_key=CLIENT_KEY,
                                         admin_api_key=ADMIN_KEY)
        os.environ.pop("TOKENMILL_WORKER_API_KEY")
        routers["open"] = RouterProcess([fakes["open"].url], [*fast, "--max-request-body-bytes", "4096"],
                                        logs / "open.log")
        routers["allow"] = RouterProcess([fakes["allow"].url], [*fast, "--allowed-worker-urls", "http://localhost:*",
                                                                "--allowed-hosts", "router.example",
                                                                "--metrics-without-auth"],
                                         logs / "allow.log", api_key=CLIENT_KEY)
        routers["client_only"] = RouterProcess([fakes["client_only"].url], [*fast, "--worker-api-key", WORKER_KEY],
                                               logs / "client_only.log", api_key=CLIENT_KEY)  # no --admin-api-key
        for router in routers.values():
            router.wait_up().wait_workers_healthy()
        yield routers, fakes
    finally:
        if env_before is None:
            os.environ.pop("TOKENMILL_WORKER_API_KEY", None)
        else:
            os.environ["TOKENMILL_WORKER_API_KEY"] = env_before
        stop_all(list(routers.values()))
        for fake in fakes.values():
            fake.close()


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"], error
    return error


def test_cross_site_text_plain_post_registers_no_worker(setup):
    """What a web page can send without a CORS preflight: text/plain and form bodies. Both get 415, the
    router answers no CORS headers, and the next client's completion does not reach the stranger."""
    routers, fakes = setup
    router = routers["open"]
    body = json.dumps({"url": fakes["stranger"].url})
    for content_type in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None):
        headers = {"Origin": "https://attacker.example", **({"Content-Type": content_type} if content_type else {})}
        response = httpx.post(f"{router.url}/workers", content=body, headers=headers, timeout=30)
        assert_openai_error(response, 415)
        assert "access-control-allow-origin" not in response.headers
    preflight = httpx.request("OPTIONS", f"{router.url}/workers", timeout=30, headers={
        "Origin": "https://attacker.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert "access-control-allow-origin" not in preflight.headers
    assert set(router.workers()) == {fakes["open"].url}
    for _ in range(3):
        assert router.post("/v1/completions", {"prompt": "my secret", "max_tokens": 1}).status_code == 200
    assert fakes["stranger"].seen == []


def test_admin_routes_need_the_admin_key_and_the_client_key_does_not_grant_it(setup):
    routers, fakes = setup
    router = routers["keyed"]
    stranger = {"url": fakes["stranger"].url}
    for key in (None, "wrong", CLIENT_KEY):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert_openai_error(httpx.post(f"{router.url}/workers", json=stranger, headers=headers, timeout=30), 401)
        assert_openai_error(httpx.get(f"{router.url}/workers", headers=headers, timeout=30), 401)
        assert_openai_error(httpx.delete(f"{router.url}/workers/worker-0", timeout=30,
                                         headers={**headers, "content-type": "application/json"}), 401)
    assert set(router.workers()) == {fakes["keyed"].url}  # (with the admin key)
    added = router.add_worker(fakes["stranger"].url)
    assert added.status_code == 201, added.text
    removed = router.remove_worker(added.json()["id"])
    assert removed.status_code == 200 and removed.json()["deleted"] is True
    assert fakes["stranger"].posts() == []


def test_router_beyond_loopback_without_admin_key_refuses_to_start():
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "router", "--port", str(free_port()),
                               *args], capture_output=True, text=True, cwd=REPO, timeout=60)

    for host in ("0.0.0.0", "::"):
        refused = run("--host", host, "--api-key", CLIENT_KEY)
        assert refused.returncode == 2, refused.stderr
        last = refused.stderr.strip().splitlines()[-1]
        assert last.startswith("error: --admin-api-key is required when the router listens beyond loopback"), last


def test_allow_list_refuses_worker_urls_outside_it(setup):
    """``--allowed-worker-urls http://localhost:*``: 127.0.0.1 is outside, localhost inside; the
    command line's worker is allowed implicitly."""
    routers, fakes = setup
    router = routers["allow"]
    assert set(router.workers()) == {fakes["allow"].url}
    for url in (fakes["stranger"].url, "http://localhost.attacker.example:80", "http://user@localhost:80"):
        refused = router.add_worker(url)
        error = assert_openai_error(refused, 403 if "user@" not in url else 400)
        assert error["param"] == "url"
    assert set(router.workers()) == {fakes["allow"].url}
    allowed = router.add_worker(f"http://localhost:{fakes['stranger'].port}")
    assert allowed.status_code == 201, allowed.text
    assert router.remove_worker(allowed.json()["id"]).status_code == 200


def test_workers_get_the_worker_key_never_the_clients_key_nor_its_kv_transfer_params(setup):
    routers, fakes = setup
    hostile = {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.6.6.6", "remote_port": 6666}}
    for name, key, expected in (("keyed", CLIENT_KEY, f"Bearer {WORKER_KEY}"), ("open", "client-secret", None)):
        router, fake = routers[name], fakes[name]
        start = len(fake.posts())
        headers = {"Authorization": f"Bearer {key}"}
        for path, body in (("/v1/completions", {"prompt": "p", "max_tokens": 1, **hostile}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "m"}], **hostile}),
                           ("/v1/completions", {"prompt": "p", "max_tokens": 1, "stream": False, **hostile})):
            response = httpx.post(f"{router.url}{path}", json=body, headers=headers, timeout=30)
            assert response.status_code == 200, response.text
        assert httpx.get(f"{router.url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"] == "fake"
        posts = fake.posts()[start:]
        assert len(posts) == 3
        for path, seen_headers, seen_body in posts:
            assert seen_headers.get("authorization") == expected, (name, path, seen_headers)
            assert "kv_transfer_params" not in seen_body, seen_body
        for method, path, seen_headers, _ in fake.seen:
            assert key not in json.dumps(seen_headers), (name, method, path)
        models = [h for m, p, h, _ in fake.seen if p == "/v1/models"]
        assert models and all(h.get("authorization") == expected for h in models)


def test_a_foreign_host_header_is_refused(setup):
    """DNS rebinding: a page on attacker.example whose name now resolves to 127.0.0.1 still sends
    ``Host: attacker.example``. The default on loopback serves only loopback names; ``--allowed-hosts``
    adds names."""
    routers, fakes = setup
    stranger_seen = len(fakes["stranger"].seen)
    for name, extra in (("open", {}), ("allow", {"Authorization": f"Bearer {CLIENT_KEY}"})):
        router = routers[name]
        for path, method in (("/v1/models", "GET"), ("/workers", "POST"), ("/health", "GET")):
            response = httpx.request(method, f"{router.url}{path}", json={"url": fakes["stranger"].url}, timeout=30,
                                     headers={**extra, "Host": f"attacker.example:{router.port}"})
            assert_openai_error(response, 400)
        assert httpx.get(f"{router.url}/health", headers={"Host": f"localhost:{router.port}"}, timeout=30).status_code == 200
    named = httpx.get(f"{routers['allow'].url}/v1/models", timeout=30,
                      headers={"Host": "router.example", "Authorization": f"Bearer {CLIENT_KEY}"})
    assert named.status_code == 200
    assert len(fakes["stranger"].seen) == stranger_seen
    assert all(fakes["stranger"].url not in routers[name].workers() for name in ("open", "allow"))


def test_oversized_bodies_get_413_and_the_router_keeps_serving(setup):
    routers, fakes = setup
    router, fake = routers["open"], fakes["open"]
    before = len(fake.posts())
    big = {"prompt": "x" * 5000, "max_tokens": 1}
    assert_openai_error(router.post("/v1/completions", big), 413)

    def chunks():
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    chunked = httpx.post(f"{router.url}/v1/completions", content=chunks(), timeout=30,
                         headers={"content-type": "application/json"})
    assert_openai_error(chunked, 413)
    assert_openai_error(httpx.post(f"{router.url}/workers", json={"url": "http://h:1", "pad": "x" * 5000},
                                   timeout=30), 413)
    assert len(fake.posts()) == before
    assert router.post("/v1/completions", {"prompt": "small", "max_tokens": 1}).status_code == 200


def test_metrics_need_the_key_unless_metrics_without_auth(setup):
    routers, _ = setup
    keyed, allow = routers["keyed"], routers["allow"]
    assert_openai_error(httpx.get(f"{keyed.url}/metrics", timeout=30), 401)
    assert httpx.get(f"{keyed.url}/metrics", headers=keyed.headers(), timeout=30).status_code == 200
    assert "tokenmill_router" in httpx.get(f"{allow.url}/metrics", timeout=30).text
    assert_openai_error(httpx.get(f"{allow.url}/v1/models", timeout=30), 401)
    for router in (keyed, allow):  # only /health is public
        assert_openai_error(httpx.get(f"{router.url}/docs", timeout=30), 401)
        assert httpx.get(f"{router.url}/health", timeout=30).status_code == 200


def test_ray_replicas_bind_as_host_says():
    """``serve --data-parallel-size N --distributed-executor-backend ray``: a replica binds ``--host``
    (loopback only on the router's node), not the node's address whatever ``--host`` says."""
    from tokenmill.cli.replicas import replica_bind

    assert replica_bind("127.0.0.1", "10.1.2.3", on_router_node=True) == ("127.0.0.1", "127.0.0.1")
    with pytest.raises(RuntimeError, match="binds loopback"):
        replica_bind("127.0.0.1", "10.1.2.3", on_router_node=False)
    assert replica_bind("0.0.0.0", "10.1.2.3", on_router_node=False) == ("0.0.0.0", "10.1.2.3")
    assert replica_bind("10.1.2.3", "10.1.2.3", on_router_node=False) == ("10.1.2.3", "10.1.2.3")


def test_without_an_admin_key_the_client_key_guards_workers_and_a_runtime_worker_gets_no_worker_key(setup):
    """``--api-key K --worker-api-key W`` without ``--admin-api-key`` on loopback: ``/workers`` needs K (no
    local process registers a worker of its own or removes the real one without it), and a worker registered
    at run time, which only a client vouched for, never receives W; the command line's worker does."""
    routers, fakes = setup
    router, own, late = routers["client_only"], fakes["client_only"], fakes["late"]
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert_openai_error(httpx.post(f"{router.url}/workers", json={"url": late.url}, headers=headers,
                                       timeout=30), 401)
        assert_openai_error(httpx.get(f"{router.url}/workers", headers=headers, timeout=30), 401)
        assert_openai_error(httpx.delete(f"{router.url}/workers/worker-0", timeout=30,
                                         headers={**headers, "content-type": "application/json"}), 401)
    assert set(router.workers()) == {own.url} and late.seen == []  # (with the client key)
    added = router.add_worker(late.url)
    assert added.status_code == 201, added.text
    router.wait_workers_healthy()
    for _ in range(4):  # round robin: both workers serve
        assert router.post("/v1/completions", {"prompt": "p", "max_tokens": 1}).status_code == 200
    assert httpx.get(f"{router.url}/v1/models", headers=router.headers(), timeout=30).status_code == 200
    assert late.posts() and own.posts()
    assert all("authorization" not in headers for _, _, headers, _ in late.seen), late.seen
    assert all(headers.get("authorization") == f"Bearer {WORKER_KEY}" for _, path, headers, _ in own.seen
               if path not in ("/health", "/ready")), own.seen  # the probes are public
    assert router.remove_worker(added.json()["id"]).status_code == 200


def test_long_session_ids_are_refused_and_never_reach_a_worker(setup):
    """``user`` and ``X-Session-Id`` are kept by the router (session affinity): more than 256 characters is
    a 400 naming the field, so a client cannot fill the router's memory with megabyte ids."""
    routers, fakes = setup
    router, fake = routers["open"], fakes["open"]
    before = len(fake.posts())
    long = "u" * 257
    error = assert_openai_error(router.post("/v1/completions", {"prompt": "p", "max_tokens": 1, "user": long}), 400)
    assert error["param"] == "user"
    error = assert_openai_error(httpx.post(f"{router.url}/v1/chat/completions", timeout=30,
                                           json={"messages": [{"role": "user", "content": "m"}]},
                                           headers={"X-Session-Id": long}), 400)
    assert error["param"] == "X-Session-Id"
    assert len(fake.posts()) == before
    assert router.post("/v1/completions", {"prompt": "p", "max_tokens": 1, "user": long[:256]}).status_code == 200
