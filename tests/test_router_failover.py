"""Router failover end to end: real tokenmill workers (tiny Llama) die under load and no stream is lost.

SIGKILL one of two workers in the middle of 32 concurrent streams (completions and chat, greedy and
seeded, n = 2, token ids, usage, a stop string): every stream completes and equals an undisturbed run
(text, finish_reason, token ids, usage counts); requests in flight that were not streamed are retried
whole; the router's metrics count both. A worker that fails after a chat stream's role chunk, before the
first token, is retried with nothing repeated. With no healthy worker left the client gets a clean
error (a 503 before the stream starts, an SSE error event mid-stream) until a worker is back and
re-admitted. ``tokenmill serve --data-parallel-size 2`` (local processes, and Ray actors when the ray
extra is installed) serves through its router and leaves no process behind after SIGTERM.
"""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler

import httpx2 as httpx
import psutil
import pytest

from tests.server_fixtures import REPO, LocalHTTPServer, ServerProcess, free_port
from tests.test_router import RouterProcess, stop_all
from tests.tiny_models import make_tiny_model
from tokenmill.router.client_stream import ClientStream
from tokenmill.router.resume import StreamState
from tokenmill.router.sse import SSEEvent, encode_event

WORKER_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "1024", "--block-size", "16"]
FAST = ["--policy", "round_robin", "--health-check-interval", "0.3"]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two workers, a router over both, and the tiny model path. Routers start while the model builds."""
    logs = tmp_path_factory.mktemp("failover_logs")
    router = RouterProcess([], FAST, logs / "router.log")
    workers: list[ServerProcess] = []
    try:
        model = str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama")))
        workers.extend(ServerProcess(model, WORKER_ARGS, logs / f"worker{i}.log") for i in range(2))
        router.wait_up()
        for worker in workers:
            worker.wait_healthy()
            assert httpx.post(f"{router.url}/workers", json={"url": worker.url}, timeout=30).status_code == 201
        router.wait_workers_healthy()
        yield model, workers, router, logs
    finally:
        stop_all([router, *workers])


def request_of(i: int, model: str, stop: str | None = None) -> tuple[str, dict]:
    """Request ``i`` of the load, all streamed: completions or chat, greedy or seeded; some with n = 2,
    token ids, usage, or a stop string that comes late in the output."""
    sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": 1000 + i}
    body = {"model": model, "max_tokens": MAX_TOKENS, "stream": True, **sampling}
    if i in (1, 5, 7):
        body["n"] = 2
    if i in (2, 3, 4, 9):
        body["return_token_ids"] = True
    if i in (0, 2, 5):
        body["stream_options"] = {"include_usage": True}
    if i == 8 and stop is not None:
        body["stop"] = [stop]
    if i % 4 < 2:
        return "/v1/completions", {**body, "prompt": f"Request {i}: the story of a"}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Tell story {i}."}]}


def stream(url: str, path: str, body: dict, progress: list[int] | None = None, i: int = 0) -> dict:
    """Read one SSE stream: per choice its text, finish reason and token ids (when asked for); role
    chunks, usage, errors and whether it ended with [DONE]."""
    out = {"choices": {}, "roles": 0, "usage": None, "errors": [], "done": False}
    with httpx.stream("POST", url + path, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out["done"] = True
                continue
            event = json.loads(data)
            if "error" in event:
                out["errors"].append(event["error"])
                continue
            if event.get("usage"):
                out["usage"] = event["usage"]
            if body.get("return_token_ids") is not True:
                assert "token_ids" not in data, data  # the router's own request for them stays hidden
            for choice in event["choices"]:
                got = out["choices"].setdefault(choice["index"], {"text": "", "finish_reason": None, "token_ids": []})
                if "delta" in choice:
                    out["roles"] += "role" in choice["delta"]
                    text = choice["delta"].get("content") or ""
                else:
                    text = choice["text"]
                got["token_ids"] += choice.get("token_ids") or []
                got["text"] += text
                if text and progress is not None:
                    progress[i] += 1
                got["finish_reason"] = choice["finish_reason"] or got["finish_reason"]
    return out


def counts(usage: dict | None) -> dict | None:
    """A usage block's token counts (its cached tokens depend on the worker that served the request)."""
    return usage and {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def test_sigkill_mid_stream_every_stream_completes_as_undisturbed(cluster):
    model, workers, router, _ = cluster
    late = stream(workers[0].url, "/v1/completions", request_of(8, model)[1])["choices"][0]["text"]
    stop = late[len(late) * 3 // 4:][:3]
    load = [request_of(i, model, stop) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        reference = list(pool.map(lambda r: stream(router.url, *r), load))
    assert all(r["done"] and not r["errors"] for r in reference)
    assert reference[8]["choices"][0]["finish_reason"] == "stop"

    whole = {"model": model, "prompt": "Not streamed:", "max_tokens": MAX_TOKENS, "temperature": 0}
    whole_text = workers[0].post("/v1/completions", whole).json()["choices"][0]["text"]

    progress = [0] * 32
    with ThreadPoolExecutor(36) as pool:
        futures = [pool.submit(stream, router.url, path, body, progress, i) for i, (path, body) in enumerate(load)]
        plain = [pool.submit(router.post, "/v1/completions", whole) for _ in range(4)]  # retried whole
        deadline = time.monotonic() + 60
        while sum(p >= 12 for p in progress) < 24:  # most streams are well under way: kill in the middle
            assert time.monotonic() < deadline, progress
            time.sleep(0.005)
        victim = workers[1]
        assert router.workers()[victim.url]["running_requests"] > 0
        victim.proc.send_signal(signal.SIGKILL)
        results = [f.result() for f in futures]
        assert [p.result().json()["choices"][0]["text"] for p in plain] == [whole_text] * 4
    for i, (got, want) in enumerate(zip(results, reference)):
        assert got["done"] and not got["errors"], (i, got)
        assert got["choices"] == want["choices"], (i, load[i])  # text, finish reason, token ids
        assert counts(got["usage"]) == counts(want["usage"]), (i, load[i])
        assert got["roles"] == (load[i][1].get("n", 1) if "messages" in load[i][1] else 0), (i, got)
    metrics = router.metrics()
    assert metrics.get("tokenmill_router:resumptions_total", 0) > 0, metrics
    assert metrics.get("tokenmill_router:retries_total{reason=connect_error}", 0) > 0, metrics  # the plain ones
    assert router.workers()[victim.url]["state"] == "unhealthy"


class RoleThenDrop:
    """A fake (foreign) worker: /health is 200; a POST gets a stream's headers and a chat role chunk,
    then the connection closes, as a worker that dies before its first token."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("content-length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                role = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                self.wfile.write(f"data: {json.dumps(role)}\n\n".encode())
                self.wfile.flush()
                self.close_connection = True

        self.http = LocalHTTPServer(Handler)
        self.url = self.http.url


def test_worker_dying_before_first_token_is_retried_without_repeating_the_role_chunk(cluster):
    model, workers, _, logs = cluster
    fake = RoleThenDrop()
    router = RouterProcess([fake.url, workers[0].url], FAST, logs / "router_role.log").wait_up()
    try:
        router.wait_workers_healthy()
        body = {"model": model, "max_tokens": 8, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": "Hi"}]}
        want = stream(workers[0].url, "/v1/chat/completions", body)
        got = stream(router.url, "/v1/chat/completions", body)  # round robin: the fake first
        assert (got["choices"], got["roles"], got["done"]) == (want["choices"], 1, True)
        assert router.metrics()["tokenmill_router:retries_total{reason=stream_error}"] == 1
    finally:
        router.stop()
        fake.http.close()


def test_no_healthy_worker_left_is_a_clean_error_until_one_is_back(cluster):
    model, workers, router, logs = cluster
    survivor = workers[0]
    body = {"model": model, "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True,
            "prompt": "A long story"}
    progress = [0]
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream, router.url, "/v1/completions", body, progress, 0)
        deadline = time.monotonic() + 30
        while progress[0] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        survivor.proc.send_signal(signal.SIGKILL)
        broken = future.result()
    assert len(broken["errors"]) == 1 and broken["errors"][0]["code"] == 503, broken
    assert broken["choices"][0]["finish_reason"] is None
    response = httpx.post(f"{router.url}/v1/completions", json={**body, "stream": False}, timeout=30)
    assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable_error"
    assert httpx.get(f"{router.url}/health", timeout=5).status_code == 503

    # a worker that comes back on its address is re-admitted by the health checks
    log = open(logs / "worker_back.log", "w")
    back = subprocess.Popen([sys.executable, "-m", "tokenmill.cli.main", "serve", model, "--port", str(survivor.port),
                             *WORKER_ARGS], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while router.workers()[survivor.url]["state"] != "healthy":
            assert back.poll() is None and time.monotonic() < deadline, (logs / "worker_back.log").read_text()[-2000:]
            time.sleep(0.1)
        again = httpx.post(f"{router.url}/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=30)
        assert again.status_code == 200 and again.headers["x-router-worker-id"] == "worker-0", again.text
    finally:
        back.send_signal(signal.SIGTERM)
        back.wait(60)
        log.close()


# ---- data-parallel replicas -----------------------------------------------------------------------
def serve_data_parallel(model: str, backend: str, log_path) -> tuple[subprocess.Popen, str]:
    """``tokenmill serve MODEL --data-parallel-size 2`` with its router up; returns (process, router URL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli.main", "serve", model, "--port", str(port), "--data-parallel-size",
           "2", "--distributed-executor-backend", backend, "--policy", "round_robin", *WORKER_ARGS[:2],
           "--num-threads", "2", "--num-kv-blocks", "256", "--block-size", "16"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def check_serves_then_stops_cleanly(model: str, backend: str, log_path) -> None:
    proc, url = serve_data_parallel(model, backend, log_path)
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        workers = httpx.get(f"{url}/workers", timeout=10).json()["workers"]
        assert len(workers) == 2 and all(w["state"] == "healthy" and w["is_tokenmill"] for w in workers), workers
        served_by = set()
        for _ in range(2):  # round robin: one request on each replica
            response = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 4,
                                                                 "temperature": 0}, timeout=60)
            assert response.status_code == 200 and response.json()["choices"][0]["text"], response.text
            served_by.add(response.headers["x-router-worker-id"])
        assert served_by == {"worker-0", "worker-1"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log_path.read_text()[-3000:]
        deadline = time.monotonic() + 20
        while alive := [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]:
            assert time.monotonic() < deadline, f"orphans: {[(c.pid, c.cmdline()) for c in alive]}"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_data_parallel_replicas_serve_through_the_router_and_leave_no_process(cluster):
    model, _, _, logs = cluster
    check_serves_then_stops_cleanly(model, "mp", logs / "data_parallel.log")


# Ray replicas serving through the router, failing over and leaving no process: tests/test_ray_multinode.py (two
# Ray nodes, one replica each).


def test_ray_backend_without_ray_is_a_one_line_error(cluster):
    model = cluster[0]
    code = ("import sys; sys.modules['ray'] = None; from tokenmill.cli.main import main; "
            f"sys.exit(main(['serve', {model!r}, '--data-parallel-size', '2', '--distributed-executor-backend', "
            "'ray', '--dtype', 'float32']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "error: --distributed-executor-backend ray needs Ray: " \
                                                     "pip install tokenmill[ray]"


# ---- the resume bookkeeping, without workers ------------------------------------------------------
def event(obj: dict) -> SSEEvent:
    return SSEEvent(encode_event(obj), obj=obj)


def test_token_ids_the_client_did_not_ask_for_are_removed_and_recorded():
    state = StreamState("chat", {"messages": [], "n": 1})
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    role = {**head, "prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                               "logprobs": None, "finish_reason": None}]}
    assert json.loads(state.observe(event(role))[6:]) == {**head, "choices": role["choices"]}
    held = {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None, "token_ids": [5]}]}
    assert state.observe(event(held)) == b""  # only token ids (text held back by the detokenizer): dropped
    text = {**head, "choices": [{"index": 0, "delta": {"content": "ab"}, "logprobs": None, "finish_reason": None,
                                 "token_ids": [6]}]}
    assert "token_ids" not in state.observe(event(text)).decode()
    assert (state.chat_prompt_token_ids, state.choices[0].token_ids, state.choices[0].text) == ([1, 2], [5, 6], ["ab"])


def test_resumed_completion_chunks_become_the_clients_chat_chunks_minus_what_it_has():
    state = StreamState("chat", {"messages": [], "n": 2, "seed": 10, "max_tokens": 20, "min_tokens": 5,
                                 "temperature": 0.7})
    state.header = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    state.chat_prompt_token_ids = [1, 2]
    choice = state.choice(1)
    choice.token_ids, choice.text = [5, 6, 7], ["abc"]
    body = state.resume_body(choice, [1, 2], 2)
    assert {k: body[k] for k in ("prompt", "max_tokens", "min_tokens", "seed", "n", "temperature")} == {
        "prompt": [1, 2, 5, 6], "max_tokens": 18, "min_tokens": 3, "seed": 11, "n": 1, "temperature": 0.7}
    skip = [2, 1]  # token 7 ("bc..." of it) is regenerated: the client has "bc" of its text already
    out = state.translate({"choices": [{"index": 0, "text": "bcd", "token_ids": [7, 8], "finish_reason": None}]},
                          choice, skip)
    chunk = json.loads(out[6:])
    assert chunk == {**state.header, "choices": [{"index": 1, "delta": {"content": "d"}, "logprobs": None,
                                                  "finish_reason": None, "stop_reason": None}]}
    assert (skip, choice.token_ids, "".join(choice.text)) == ([0, 0], [5, 6, 7, 8], "abcd")


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_cut_regenerates_text_held_back_at_it_only_when_that_is_exact(deterministic):
    """Tokens a b c decode to "A", "AB", "AB\\ufffd" (c: half a character); the client has "AB"."""
    async def detokenize(worker, token_ids, headers) -> str:
        return {(): "", (1,): "A", (1, 2): "AB", (1, 2, 3): "AB\ufffd"}[tuple(token_ids)]

    sampling = {"temperature": 0} if deterministic else {"temperature": 1.0}
    stream = object.__new__(ClientStream)
    stream.state = StreamState("completions", {"prompt": "x", **sampling})
    stream.proxy = type("FakeProxy", (), {"detokenize": staticmethod(detokenize)})()
    stream.upstream_headers = {}
    choice = stream.state.choice(0)
    choice.token_ids, choice.text = [1, 2, 3], ["A", "B"]
    sent: list[bytes] = []

    async def send(message: dict) -> None:
        sent.append(message["body"])

    cut = asyncio.run(stream._cut(send, None, choice, [9]))
    if deterministic:  # back to "AB" after b: c is regenerated, its text comes whole with the next token
        assert cut == (2, [0, 1]) and not sent
    else:  # after c: nothing held back can be sent whole (it ends in half a character)
        assert cut == (3, [0, 0]) and not sent


def test_unseeded_sampling_sends_text_held_back_at_the_cut_at_once():
    """Tokens a b c decode to "AB", "ABC" and the client has "AB" ("C" held back as a possible stop)."""
    async def detokenize(worker, token_ids, headers) -> str:
        return {(1, 2): "AB", (1, 2, 3): "ABC"}[tuple(token_ids)]

    stream = object.__new__(ClientStream)
    stream.state = StreamState("completions", {"prompt": "x", "temperature": 1.0})
    stream.state.header = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}
    stream.proxy = type("FakeProxy", (), {"detokenize": staticmethod(detokenize)})()
    stream.upstream_headers = {}
    choice = stream.state.choice(0)
    choice.token_ids, choice.text = [1, 2, 3], ["AB"]
    sent: list[bytes] = []

    async def send(message: dict) -> None:
        sent.append(message["body"])

    assert asyncio.run(stream._cut(send, None, choice, [9])) == (3, [0, 0])
    assert [json.loads(b[6:])["choices"][0]["text"] for b in sent] == ["C"] and "".join(choice.text) == "ABC"
