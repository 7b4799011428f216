"""`tokenmill router` end to end: two real tokenmill workers (tiny Llama) behind router processes.

Outputs through the router equal direct requests for every policy (openai client, completions and
chat, streamed and not); streams pass through chunk by chunk; a client that leaves aborts the worker's
request; workers join and leave at run time; a failing worker is retried around and marked unhealthy;
cache_aware earns more prefix-cache hits than round_robin on a multi-tenant workload; sessions stick;
bad input gets OpenAI error bodies. Workers are started once per module; routers start in ~1-2 s.
"""
from __future__ import annotations

import importlib.util
import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.server_fixtures import REPO, LocalHTTPServer, ServerProcess, free_port
from tests.tiny_models import make_tiny_model

WORKER_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "512", "--block-size", "16"]
POLICIES = ["round_robin", "least_load", "power_of_two", "cache_aware"]
WORKER_HEADER = "x-router-worker-id"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


class RouterProcess(ServerProcess):
    """``python -m tokenmill.cli.main router --port P --worker-urls ... *args`` (ServerProcess's helpers).
    ``api_key``: the clients' key (``headers()``); ``admin_api_key``: the key of /workers (``admin_headers()``)."""

    def __init__(self, worker_urls: list[str], args: list[str], log_path: Path, api_key: str | None = None,
                 admin_api_key: str | None = None) -> None:
        self.port = free_port()
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.log_path = log_path
        cmd = [sys.executable, "-m", "tokenmill.cli.main", "router", "--port", str(self.port),
               *(["--worker-urls", *worker_urls] if worker_urls else []), *args,
               *(["--api-key", api_key] if api_key else []),
               *(["--admin-api-key", admin_api_key] if admin_api_key else [])]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_up(self, timeout: float = 60.0) -> RouterProcess:
        """Poll /workers until the router answers (its lifespan has checked every worker by then)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/workers", headers=self.admin_headers(), timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"router not up after {timeout}s:\n{self.log()[-3000:]}")

    def wait_workers_healthy(self, timeout: float = 30.0) -> RouterProcess:
        """Poll /workers until every registered worker is healthy."""
        deadline = time.monotonic() + timeout
        while not all(w["state"] == "healthy" for w in self.workers().values()):
            assert time.monotonic() < deadline, self.workers()
            time.sleep(0.05)
        return self

    def admin_headers(self) -> dict:
        """The admin key's header; without one, the clients' key's (it then guards /workers too)."""
        key = self.admin_api_key or self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def workers(self) -> dict[str, dict]:
        response = httpx.get(f"{self.url}/workers", headers=self.admin_headers(), timeout=30)
        response.raise_for_status()
        return {w["url"]: w for w in response.json()["workers"]}

    def add_worker(self, url: str) -> httpx.Response:
        """``POST /workers`` with the admin key (when the router has one)."""
        return httpx.post(f"{self.url}/workers", json={"url": url}, headers=self.admin_headers(), timeout=30)

    def remove_worker(self, worker_id: str) -> httpx.Response:
        """``DELETE /workers/ID`` with the admin key, declaring JSON as every state-changing request must."""
        return httpx.delete(f"{self.url}/workers/{worker_id}", timeout=30,
                            headers={**self.admin_headers(), "content-type": "application/json"})


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("router_logs")


def stop_all(procs: list[ServerProcess]) -> None:
    """SIGTERM every process first, then wait for each (shutdowns overlap)."""
    for proc in procs:
        if proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.stop()


@pytest.fixture(scope="module")
def cluster(logs, request):
    """Every router of the module, then (while they import) the tiny model and two workers, which the
    routers get through ``POST /workers`` and admit as soon as they finish loading (health checks
    every 0.5 s). Router ids follow registration order: worker-0, worker-1."""
    flaky = FlakyWorker(["503", "drop"])
    headless = FlakyWorker(["head"] * 1000)  # answers every POST 200 with SSE headers, then hangs up
    fast = ["--health-check-interval", "0.5"]
    routers = {p: RouterProcess([], ["--policy", p, "--seed", "0", *fast], logs / f"router_{p}.log") for p in POLICIES}
    routers["api_key"] = RouterProcess([], ["--policy", "round_robin", *fast], logs / "router_key.log", api_key="sekret",
                                       admin_api_key="admin-sekret")
    routers["dynamic"] = RouterProcess([], ["--policy", "round_robin", *fast], logs / "router_dynamic.log")
    routers["flaky"] = RouterProcess([flaky.url], ["--policy", "round_robin", "--health-check-interval", "0.3"],
                                     logs / "router_flaky.log")
    routers["headless"] = RouterProcess([headless.url], ["--policy", "round_robin", "--health-check-interval", "0.3"],
                                        logs / "router_headless.log")
    routers["headless_only"] = RouterProcess([headless.url], ["--policy", "round_robin", "--health-check-interval",
                                                              "0.3"], logs / "router_headless_only.log")
    workers: list[ServerProcess] = []
    try:
        tiny_path = request.getfixturevalue("tiny_path")
        workers.extend(ServerProcess(tiny_path, WORKER_ARGS, logs / f"worker{i}.log") for i in range(2))
        members = {name: [w.url for w in workers] if name in POLICIES else [workers[0].url] for name in routers}
        members["headless_only"] = []
        for name, router in routers.items():
            router.wait_up()
            for url in members[name]:
                added = router.add_worker(url)
                assert added.status_code == 201, added.text
        for worker in workers:
            worker.wait_healthy()
        for router in routers.values():
            router.wait_workers_healthy()
        yield workers, routers, flaky
    finally:
        flaky.close()
        headless.close()
        stop_all([*routers.values(), *workers])


@pytest.fixture(scope="module")
def workers(cluster) -> list[ServerProcess]:
    return cluster[0]


@pytest.fixture(scope="module")
def routers(cluster) -> dict[str, RouterProcess]:
    return cluster[1]


def worker_by_id(router: RouterProcess, workers: list[ServerProcess], worker_id: str) -> ServerProcess:
    url = next(w["url"] for w in router.workers().values() if w["id"] == worker_id)
    return next(w for w in workers if w.url == url)


# ---- results equal a direct request ---------------------------------------------------------------
def four_ways(server: ServerProcess, model: str) -> list[str]:
    """Greedy text of a completion and a chat, each plain and streamed, via the openai client."""
    client = server.client()
    out = [client.completions.create(model=model, prompt="The capital of France is", max_tokens=10,
                                     temperature=0).choices[0].text]
    chunks = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=0,
                                       stream=True)
    out.append("".join(c.choices[0].text for c in chunks if c.choices))
    out.append(client.chat.completions.create(model=model, messages=CHAT, max_tokens=10,
                                              temperature=0).choices[0].message.content)
    chunks = client.chat.completions.create(model=model, messages=CHAT[1:], max_tokens=10, temperature=0, stream=True)
    out.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_outputs_through_the_router_equal_a_direct_request(workers, routers, tiny_path, policy):
    router = routers[policy]
    direct = four_ways(workers[0], tiny_path)
    assert all(direct)
    assert four_ways(router, tiny_path) == direct
    assert four_ways(router, tiny_path) == direct  # second round: other workers / cache hits, same text
    metrics = router.metrics()
    decisions = sum(v for k, v in metrics.items() if k.startswith("tokenmill_router:routing_decisions_total")
                    and f"policy={policy}" in k)
    assert decisions >= 8
    # The router's own time is observed once per request (dispatch) and once per stream (first-token relay):
    # half of four_ways' requests stream.
    overhead = "tokenmill_router:request_overhead_seconds"
    assert metrics[f"{overhead}_count{{stage=dispatch}}"] == decisions
    assert metrics[f"{overhead}_count{{stage=first_token_relay}}"] * 2 == decisions
    assert metrics[f"{overhead}_sum{{stage=dispatch}}"] > 0
    models = router.get_json("/v1/models")["data"]
    assert [m["id"] for m in models] == [tiny_path]  # the union of two workers serving one model


def test_router_process_never_imports_torch():
    code = ("import sys, tokenmill.cli.main, tokenmill.cli.router, tokenmill.router.app; "
            "print(sorted({'torch', 'transformers', 'numpy', 'tokenmill.engine', 'tokenmill.server'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def test_workers_are_detected_as_tokenmill_with_their_block_size(workers, routers):
    listed = routers["cache_aware"].workers()
    assert set(listed) == {w.url for w in workers}
    for w in listed.values():
        assert w["state"] == "healthy" and w["is_tokenmill"] is True and w["block_size"] == 16
        assert w["outstanding_tokens"] == 0 and w["running_requests"] == 0


def test_least_load_spreads_concurrent_requests_by_outstanding_tokens(routers, tiny_path):
    router = routers["least_load"]
    body = {"model": tiny_path, "prompt": "Spread the load", "max_tokens": 40, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda _: router.post("/v1/completions", body), range(4)))
    assert all(r.status_code == 200 for r in responses)
    assert sorted(Counter(r.headers[WORKER_HEADER] for r in responses).values()) == [2, 2]
    assert all(w["outstanding_tokens"] == 0 for w in router.workers().values())  # every lease released


# ---- streaming, disconnects -----------------------------------------------------------------------
def test_stream_chunks_arrive_before_the_worker_finishes(routers, tiny_path):
    body = {"model": tiny_path, "prompt": "Count with me:", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    start = time.perf_counter()
    with httpx.stream("POST", f"{routers['round_robin'].url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        text = b""
        for chunk in response.iter_raw():
            arrivals.append(time.perf_counter() - start)
            text += chunk
    events = [e for e in text.decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]" and len(events) > 150  # ~ a chunk per token, the finish chunk, [DONE]
    assert len(arrivals) > 50  # passed through as produced, not as one buffered body
    assert arrivals[0] < 0.25 * arrivals[-1], (arrivals[0], arrivals[-1])


def _abort_count(worker: ServerProcess) -> float:
    return worker.metrics().get('tokenmill:request_success_total{finished_reason=abort}', 0.0)


def _wait_worker_idle(worker: ServerProcess, timeout: float = 3.0) -> float:
    """Seconds until the worker runs nothing (fails the test past ``timeout``)."""
    start = time.monotonic()
    while worker.kv_cache()["num_running"] or worker.kv_cache()["num_waiting"]:
        assert time.monotonic() - start < timeout, "the worker kept running the abandoned request"
        time.sleep(0.02)
    return time.monotonic() - start


def test_client_disconnect_mid_stream_aborts_the_worker_request(workers, routers, tiny_path):
    router = routers["round_robin"]
    body = {"model": tiny_path, "prompt": "Tell me a long story", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as response:
        worker = worker_by_id(router, workers, response.headers[WORKER_HEADER])
        aborted_before = _abort_count(worker)
        chunks = response.iter_raw()  # kept: a dropped iterator closes the response
        assert next(chunks).startswith(b"data: ")
        assert worker.kv_cache()["num_running"] == 1
    # 400 tokens take seconds on this model; an aborted request is gone in a fraction of that
    assert _wait_worker_idle(worker) < 1.5
    assert _abort_count(worker) == aborted_before + 1
    assert all(w["running_requests"] == 0 and w["outstanding_tokens"] == 0 for w in router.workers().values())


def test_client_disconnect_while_waiting_for_a_plain_response_aborts_it(workers, routers, tiny_path):
    router = routers["round_robin"]
    aborts_before = sum(_abort_count(w) for w in workers)
    # 480 tokens take ~0.7 s on a fast host (400 took 0.56 s, which raced a 0.5 s timeout): the client
    # gives up well before the worker could finish
    body = {"model": tiny_path, "prompt": "Tell me a long story", "max_tokens": 480, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router.url}/v1/completions", json=body, timeout=0.2)
    for worker in workers:
        _wait_worker_idle(worker)
    assert sum(_abort_count(w) for w in workers) == aborts_before + 1
    deadline = time.monotonic() + 2
    while any(w["running_requests"] for w in router.workers().values()):
        assert time.monotonic() < deadline
        time.sleep(0.02)


# ---- cache-aware routing and sessions -------------------------------------------------------------
def tenant_workload(salt: str) -> list[tuple[int, list[dict]]]:
    """16 chat requests of 4 tenants in a fixed shuffled order; each tenant has its own long system prompt."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    systems = [f"{salt} tenant {t}: you are assistant number {t}. " + " ".join(random.Random(t).choices(words, k=60))
               for t in range(4)]
    order = [t for t in range(4) for _ in range(4)]
    random.Random(7).shuffle(order)
    return [(t, [{"role": "system", "content": systems[t]}, {"role": "user", "content": f"question {i}"}])
            for i, t in enumerate(order)]


def cached_tokens_of(router: RouterProcess, model: str, salt: str) -> tuple[int, dict[int, set[str]]]:
    """Sum of the workers' cached prompt tokens over the workload, and the workers each tenant reached."""
    total, placed = 0, {}
    for tenant, messages in tenant_workload(salt):
        response = router.post("/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 1,
                                                        "temperature": 0})
        assert response.status_code == 200, response.text
        total += response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        placed.setdefault(tenant, set()).add(response.headers[WORKER_HEADER])
    return total, placed


def test_cache_aware_beats_round_robin_on_prefix_hits(routers, tiny_path):
    rr_hits, rr_placed = cached_tokens_of(routers["round_robin"], tiny_path, "rr")
    ca_hits, ca_placed = cached_tokens_of(routers["cache_aware"], tiny_path, "ca")
    assert all(len(w) == 1 for w in ca_placed.values()), ca_placed  # every tenant stays on one worker
    assert len(set().union(*ca_placed.values())) == 2  # ... and both workers are used
    assert any(len(w) == 2 for w in rr_placed.values())
    assert ca_hits > rr_hits, (ca_hits, rr_hits)
    metrics = routers["cache_aware"].metrics()
    assert metrics["tokenmill_router:routing_decisions_total{policy=cache_aware,reason=cache_hit}"] >= 12
    assert metrics["tokenmill_router:estimated_prefix_hit_tokens_total{policy=cache_aware}"] > 0


def test_sessions_stick_to_one_worker(routers, tiny_path):
    router = routers["round_robin"]

    def served_by(body: dict, headers: dict | None = None) -> str:
        response = httpx.post(f"{router.url}/v1/completions", json={"model": tiny_path, "max_tokens": 1, **body},
                              headers=headers or {}, timeout=60)
        assert response.status_code == 200, response.text
        return response.headers[WORKER_HEADER]

    assert len({served_by({"prompt": f"hi {i}", "user": "alice"}) for i in range(5)}) == 1
    assert len({served_by({"prompt": f"yo {i}"}, {"X-Session-Id": "bob"}) for i in range(5)}) == 1
    assert len({served_by({"prompt": f"hey {i}"}) for i in range(4)}) == 2  # no session: round robin
    assert router.metrics()["tokenmill_router:routing_decisions_total{policy=round_robin,reason=session}"] >= 8


# ---- workers joining, leaving, failing ------------------------------------------------------------
def test_workers_join_and_leave_at_run_time(workers, routers, tiny_path):
    router = routers["dynamic"]
    added = httpx.post(f"{router.url}/workers", json={"url": workers[1].url + "/"}, timeout=30)
    assert added.status_code == 201, added.text
    new = added.json()
    assert new["state"] == "healthy" and new["is_tokenmill"] and new["url"] == workers[1].url
    assert set(router.workers()) == {w.url for w in workers}

    body = {"model": tiny_path, "prompt": "Hello", "max_tokens": 2}
    served = {router.post("/v1/completions", body).headers[WORKER_HEADER] for _ in range(4)}
    assert new["id"] in served and len(served) == 2

    for bad, status in [({"url": workers[0].url}, 409), ({"url": "ftp://host:1"}, 400), ({"url": 5}, 400),
                        ({}, 400), ({"url": "http://host:notaport"}, 400)]:
        response = httpx.post(f"{router.url}/workers", json=bad, timeout=30)
        assert response.status_code == status, (bad, response.text)
        assert response.json()["error"]["param"] == "url"

    # a stream in flight on the removed worker still finishes
    stream_body = {**body, "max_tokens": 60, "ignore_eos": True, "stream": True, "temperature": 0}
    for _ in range(2):
        with httpx.stream("POST", f"{router.url}/v1/completions", json=stream_body, timeout=60) as response:
            if response.headers[WORKER_HEADER] != new["id"]:
                response.read()
                continue
            chunks = response.iter_raw()
            next(chunks)
            deleted = router.remove_worker(new["id"])
            assert deleted.status_code == 200 and deleted.json()["deleted"] is True
            rest = b"".join(chunks).decode()
            assert rest.rstrip().endswith("data: [DONE]") and rest.count("data: ") >= 60
            break
    else:
        pytest.fail("round robin never chose the added worker")
    assert set(router.workers()) == {workers[0].url}
    assert {router.post("/v1/completions", body).headers[WORKER_HEADER] for _ in range(3)} == {"worker-0"}
    missing = router.remove_worker(new["id"])
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    dead = httpx.post(f"{router.url}/workers", json={"url": f"http://127.0.0.1:{free_port()}"}, timeout=30)
    assert dead.status_code == 201 and dead.json()["state"] == "unhealthy"
    assert router.post("/v1/completions", body).status_code == 200


class FlakyWorker:
    """A fake worker: /health answers 200; POSTs fail as scripted ("503"; "drop": close without answering;
    "head": answer 200 with a stream's headers, then close before any event)."""

    def __init__(self, failures: list[str]) -> None:
        failures_left = list(failures)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                code = 200 if self.path == "/health" else 404
                self.send_response(code)
                self.send_header("content-length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                mode = failures_left.pop(0) if failures_left else "503"
                if mode == "drop":
                    self.close_connection = True
                    return
                if mode == "head":
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.end_headers()
                    self.wfile.flush()
                    time.sleep(0.05)  # the router has sent the client its head by now
                    self.close_connection = True
                    return
                payload = json.dumps({"error": {"message": "engine down", "type": "service_unavailable_error",
                                                "param": None, "code": 503}}).encode()
                self.send_response(503)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.http = LocalHTTPServer(Handler)
        self.url = self.http.url
        self.close = self.http.close


def test_failing_worker_is_marked_unhealthy_and_requests_are_retried(cluster, tiny_path):
    workers, routers, flaky = cluster
    router = routers["flaky"]
    body = {"model": tiny_path, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    expected = workers[0].post("/v1/completions", body).json()["choices"][0]["text"]
    for reason in ("http_503", "connect_error"):
        key = f"tokenmill_router:retries_total{{reason={reason}}}"
        deadline = time.monotonic() + 10
        while router.metrics().get(key, 0) == 0:
            assert time.monotonic() < deadline, f"no {reason} retry"
            while router.workers()[flaky.url]["state"] != "healthy":  # re-admitted by its health checks
                assert time.monotonic() < deadline
                time.sleep(0.05)
            response = router.post("/v1/completions", body)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected
            assert response.headers[WORKER_HEADER] == "worker-1"
        assert router.metrics()[key] == 1
    flaky.close()
    deadline = time.monotonic() + 10
    while router.workers()[flaky.url]["state"] != "unhealthy":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert router.metrics()[f"tokenmill_router:worker_healthy{{url={flaky.url},worker_id=worker-0}}"] == 0
    assert router.post("/v1/completions", body).status_code == 200


def sse_events(response: httpx.Response) -> list:
    """The ``data:`` payloads of a streamed response: parsed JSON objects, and "[DONE]"."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append("[DONE]" if line[6:] == "[DONE]" else json.loads(line[6:]))
    return events


def test_a_stream_whose_worker_hangs_up_after_its_head_is_retried_as_one_stream(cluster, tiny_path):
    """The router sends a stream's head when a worker answers 200 (writing it overlaps the prefill); a
    worker that then hangs up before its first token is retried on another, and the client still gets
    one whole stream, equal to a direct one."""
    workers, routers, _ = cluster
    router = routers["headless"]
    body = {"model": tiny_path, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True}
    expected = workers[0].post("/v1/completions", {**body, "stream": False}).json()["choices"][0]["text"]
    key = "tokenmill_router:retries_total{reason=stream_error}"
    deadline = time.monotonic() + 20
    while router.metrics().get(key, 0) < 2:  # round robin: the headless worker gets every other request
        assert time.monotonic() < deadline, router.metrics()
        while not all(w["state"] == "healthy" for w in router.workers().values()):  # re-admitted by health checks
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            events = sse_events(response)
        assert events[-1] == "[DONE]", events
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == expected


def test_a_stream_whose_only_worker_hangs_up_after_its_head_ends_with_an_error_event(cluster, tiny_path):
    router = cluster[1]["headless_only"]
    body = {"model": tiny_path, "prompt": "Hello", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200  # the head went out before the worker failed
        events = sse_events(response)
    assert len(events) == 1 and events[0]["error"]["code"] == 503, events
    assert events[0]["error"]["type"] == "service_unavailable_error"
    assert "no healthy worker" in events[0]["error"]["message"]
    metrics = router.metrics()
    assert metrics["tokenmill_router:retries_total{reason=stream_error}"] == 1
    assert metrics["tokenmill_router:request_errors_total{reason=no_worker}"] == 1


# ---- bad input ------------------------------------------------------------------------------------
def test_bad_inputs_get_openai_error_bodies_and_the_router_keeps_serving(routers, tiny_path):
    router = routers["cache_aware"]
    cases = [
        ("/v1/completions", b"{not json", "400", None),
        ("/v1/completions", b"[1, 2]", "400", None),
        ("/v1/completions", {"max_tokens": 2}, "400", "prompt"),
        ("/v1/completions", {"prompt": {"a": 1}}, "400", "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "400", "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "400", "stream"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "400", "n"),
        ("/v1/completions", {"prompt": "hi", "user": 5}, "400", "user"),
        ("/v1/chat/completions", {"messages": []}, "400", "messages"),
        ("/v1/chat/completions", {"messages": ["hi"]}, "400", "messages[0]"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1}, "400", "max_completion_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "400", "temperature"),  # the worker's 400
        ("/v1/nothing", {}, "404", None),
    ]
    for path, body, status, param in cases:
        kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        response = httpx.post(f"{router.url}{path}", timeout=30, **kwargs)
        assert str(response.status_code) == status, (path, body, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"] and error["param"] == param, (body, error)
    ok = router.client().completions.create(model=tiny_path, prompt="still here", max_tokens=2)
    assert ok.choices[0].text


def test_api_key_is_checked_and_the_admin_key_guards_workers(routers, tiny_path):
    router = routers["api_key"]
    denied = httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{router.url}/workers", timeout=30).status_code == 401
    assert httpx.get(f"{router.url}/workers", headers=router.headers(), timeout=30).status_code == 401
    assert httpx.get(f"{router.url}/workers", headers=router.admin_headers(), timeout=30).status_code == 200
    assert router.client().completions.create(model=tiny_path, prompt="hi", max_tokens=2).choices[0].text
    assert httpx.get(f"{router.url}/health", timeout=30).status_code == 200


def test_cli_refuses_bad_settings_with_one_line(tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "router", "--port", str(free_port()), *args],
                              capture_output=True, text=True, cwd=REPO, timeout=60)

    bad_url = run("--worker-urls", "localhost:8000")
    assert bad_url.returncode == 2 and "error: url must be http://host[:port]" in bad_url.stderr
    if importlib.util.find_spec("tokenmill.router.kv_aware") is None:
        kv = run("--policy", "kv_aware")
        assert kv.returncode == 2 and "policy kv_aware is not available" in kv.stderr
