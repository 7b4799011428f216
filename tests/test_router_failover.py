"""Router failover end to end: real tokenmill workers (tiny Llama) die under load and no stream is lost.

SIGKILL one of two workers in the middle of 32 concurrent streams (completions and chat, greedy and
seeded): every stream completes, each equals an undisturbed run (text and finish_reason), and the
router's metrics count the resumptions. A worker that fails after a chat stream's role chunk, before the
first token, is retried with nothing repeated. With no healthy worker left the client gets a clean error:
a 503 before the stream starts, an SSE error event mid-stream.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx2 as httpx
import pytest

from tests.server_fixtures import ServerProcess
from tests.test_router import RouterProcess, stop_all
from tests.tiny_models import make_tiny_model

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


def request_of(i: int, model: str) -> tuple[str, dict]:
    """Request ``i`` of the load: completions or chat, greedy or seeded, all streamed."""
    sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": 1000 + i}
    body = {"model": model, "max_tokens": MAX_TOKENS, "stream": True, **sampling}
    if i % 4 < 2:
        return "/v1/completions", {**body, "prompt": f"Request {i}: the story of a"}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Tell story {i}."}]}


def stream(url: str, path: str, body: dict, progress: list[int] | None = None, i: int = 0) -> dict:
    """Read one SSE stream: text, finish reason, role chunks, errors and whether it ended with [DONE]."""
    out = {"text": "", "finish_reason": None, "roles": 0, "errors": [], "done": False}
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
            for choice in event["choices"]:
                if "delta" in choice:
                    out["roles"] += "role" in choice["delta"]
                    text = choice["delta"].get("content") or ""
                else:
                    text = choice["text"]
                assert "token_ids" not in choice and "prompt_token_ids" not in event, event
                out["text"] += text
                if text and progress is not None:
                    progress[i] += 1
                out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


def test_sigkill_mid_stream_every_stream_completes_as_undisturbed(cluster):
    model, workers, router, _ = cluster
    load = [request_of(i, model) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        reference = list(pool.map(lambda r: stream(router.url, *r), load))
    assert all(r["done"] and r["finish_reason"] and not r["errors"] for r in reference)

    progress = [0] * 32
    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(stream, router.url, path, body, progress, i) for i, (path, body) in enumerate(load)]
        deadline = time.monotonic() + 60
        while sum(p >= 3 for p in progress) < 24:  # most streams have sent text: kill in the middle
            assert time.monotonic() < deadline, progress
            time.sleep(0.005)
        victim = workers[1]
        assert router.workers()[victim.url]["running_requests"] > 0
        victim.proc.send_signal(signal.SIGKILL)
        results = [f.result() for f in futures]
    for i, (got, want) in enumerate(zip(results, reference)):
        assert got["done"] and not got["errors"], (i, got)
        assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"]), (i, load[i])
        assert got["roles"] == (1 if "messages" in load[i][1] else 0), (i, got)  # no repeated role chunk
    metrics = router.metrics()
    assert metrics.get("tokenmill_router:resumptions_total", 0) > 0, metrics
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

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


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
        assert (got["text"], got["finish_reason"], got["roles"], got["done"]) == (
            want["text"], want["finish_reason"], 1, True)
        assert router.metrics()["tokenmill_router:retries_total{reason=stream_error}"] == 1
    finally:
        router.stop()
        fake.server.shutdown()


def test_no_healthy_worker_left_is_a_clean_error(cluster):
    model, workers, router, _ = cluster
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
    assert broken["finish_reason"] is None
    response = httpx.post(f"{router.url}/v1/completions", json={**body, "stream": False}, timeout=30)
    assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable_error"
    assert httpx.get(f"{router.url}/health", timeout=5).status_code == 503
