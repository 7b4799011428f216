"""A hung worker behind the router: real tokenmill workers (tiny Llama), one SIGSTOPped mid-stream.

A stopped process still completes TCP handshakes (the kernel's backlog) but never answers, so nothing
breaks on the router's side by itself. Two routers over the same two workers find it each their own way:
``hung`` by its health check timing out (``--health-check-timeout-secs``; stall bound off), ``stall`` by
its streams going quiet (``--stream-stall-timeout-secs``; a health check that would wait for ever).
Every stream on the stopped worker completes exactly as its undisturbed run (text, finish reason, token
ids, usage), a request sent to it before it was found is retried whole elsewhere, new requests go to the
other worker, and once SIGCONTed the worker is taken back and holds no request or block.
"""
from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest

from tests.server_fixtures import ServerProcess
from tests.test_router import RouterProcess, stop_all
from tests.tiny_models import make_tiny_model

WORKER_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "1024", "--block-size", "16"]
ROUTERS = {
    "hung": ["--policy", "round_robin", "--health-check-interval-secs", "0.3", "--health-check-timeout-secs", "2",
             "--stream-stall-timeout-secs", "0"],
    "stall": ["--policy", "round_robin", "--health-check-interval-secs", "0.3", "--health-check-timeout-secs",
              "600", "--stream-stall-timeout-secs", "1"],
}
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two workers, the two routers over both (worker 0 registered first), and the tiny model path."""
    logs = tmp_path_factory.mktemp("chaos_logs")
    routers = {name: RouterProcess([], args, logs / f"router_{name}.log") for name, args in ROUTERS.items()}
    workers: list[ServerProcess] = []
    try:
        model = str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama")))
        workers.extend(ServerProcess(model, WORKER_ARGS, logs / f"worker{i}.log") for i in range(2))
        for router in routers.values():
            router.wait_up()
        for worker in workers:
            worker.wait_healthy()
            for router in routers.values():
                assert router.add_worker(worker.url).status_code == 201
        for router in routers.values():
            router.wait_workers_healthy()
        yield model, workers, routers
    finally:
        for worker in workers:  # a stopped process would not see the SIGTERM
            if worker.proc.poll() is None:
                worker.proc.send_signal(signal.SIGCONT)
        stop_all([*routers.values(), *workers])


def request_of(i: int, model: str) -> tuple[str, dict]:
    """Stream ``i``: completions or chat, greedy or seeded (n = 2 for one), token ids or usage for some."""
    body = {"model": model, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            **({"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": 50 + i})}
    if i == 1:
        body["n"] = 2
    if i in (0, 3):
        body["return_token_ids"] = True
    if i in (1, 2):
        body["stream_options"] = {"include_usage": True}
    if i < 2:
        return "/v1/completions", {**body, "prompt": f"Chaos {i}: once upon a"}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Tell tale {i}."}]}


def read_stream(url: str, path: str, body: dict, progress: list[int] | None = None, i: int = 0) -> dict:
    """One SSE stream: the worker that took it, per choice text, finish reason and token ids, usage
    counts, error events and whether it ended with [DONE]."""
    out = {"worker": None, "choices": {}, "usage": None, "errors": [], "done": False}
    with httpx.stream("POST", url + path, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        out["worker"] = response.headers.get("x-router-worker-id")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                out["errors"].append(event["error"])
                continue
            if event.get("usage"):
                out["usage"] = {k: event["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
            for choice in event["choices"]:
                got = out["choices"].setdefault(choice["index"], {"text": "", "finish_reason": None, "token_ids": []})
                text = choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
                got["text"] += text
                got["token_ids"] += choice.get("token_ids") or []
                got["finish_reason"] = choice["finish_reason"] or got["finish_reason"]
                if text and progress is not None:
                    progress[i] += 1
    return out


def wait_state(router: RouterProcess, url: str, state: str) -> None:
    deadline = time.monotonic() + 60
    while router.workers()[url]["state"] != state:
        assert time.monotonic() < deadline, router.workers()
        time.sleep(0.05)


def test_sigstopped_worker_is_routed_around_and_its_streams_complete_as_undisturbed(cluster):
    model, workers, routers = cluster
    survivor, victim = workers
    load = [(name, *request_of(i, model)) for name in routers for i in range(4)]
    with ThreadPoolExecutor(len(load)) as pool:
        reference = list(pool.map(lambda r: read_stream(survivor.url, r[1], r[2]), load))
    assert all(r["done"] and not r["errors"] for r in reference)
    whole = {"model": model, "prompt": "Not streamed:", "max_tokens": 24, "temperature": 0}
    whole_text = survivor.post("/v1/completions", whole).json()["choices"][0]["text"]
    ids = {name: {url: w["id"] for url, w in router.workers().items()} for name, router in routers.items()}

    progress = [0] * len(load)
    with ThreadPoolExecutor(len(load) + 2) as pool:
        futures = [pool.submit(read_stream, routers[name].url, path, body, progress, i)
                   for i, (name, path, body) in enumerate(load)]
        deadline = time.monotonic() + 60
        while min(progress) < 2:  # every stream has its first tokens: stop the worker in the middle
            assert time.monotonic() < deadline, progress
            time.sleep(0.005)
        assert all(routers[name].workers()[victim.url]["running_requests"] > 0 for name in routers)
        victim.proc.send_signal(signal.SIGSTOP)
        try:
            # round robin: one of the two goes to the stopped worker, which is not found out yet
            plain = [pool.submit(routers["hung"].post, "/v1/completions", whole) for _ in range(2)]
            results = [f.result() for f in futures]
            assert [p.result().json()["choices"][0]["text"] for p in plain] == [whole_text] * 2
            for name, router in routers.items():
                assert router.workers()[victim.url]["state"] == "unhealthy"
                for _ in range(3):  # new requests go to the survivor only
                    response = router.post("/v1/completions", whole)
                    assert response.json()["choices"][0]["text"] == whole_text
                    assert response.headers["x-router-worker-id"] == ids[name][survivor.url]
            assert "no stream event for 1 s" in routers["stall"].workers()[victim.url]["last_error"]
        finally:
            victim.proc.send_signal(signal.SIGCONT)
    on_victim = 0
    for i, (got, want) in enumerate(zip(results, reference)):
        assert got["done"] and not got["errors"], (i, got)
        assert (got["choices"], got["usage"]) == (want["choices"], want["usage"]), (i, load[i])
        on_victim += got["worker"] == ids[load[i][0]][victim.url]
    assert on_victim >= 2, results  # round robin: each router put streams on the stopped worker
    hung, stall = (routers[name].metrics() for name in ("hung", "stall"))
    assert hung.get("tokenmill_router:retries_total{reason=worker_hung}", 0) >= 1, hung
    for metrics in (hung, stall):
        assert metrics.get("tokenmill_router:resumptions_total", 0) >= 1, metrics
    for router in routers.values():  # taken back once it answers again
        wait_state(router, victim.url, "healthy")
    kv = victim.wait_idle()  # the requests it held were aborted when the router let go of them
    assert (kv["num_running"], kv["num_waiting"], kv["num_free_blocks"]) == (0, 0, kv["num_blocks"]), kv
