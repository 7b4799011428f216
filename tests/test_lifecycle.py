"""Lifecycle of `tokenmill serve` and of a worker behind `tokenmill router` (issue 44, item 3), on real processes:

- ``/health`` is liveness (200 while the engine loop runs, draining too; 503 once the engine died) and ``/ready``
  readiness (503 while draining, loading or dead), both without the API key;
- SIGTERM drains: the stream in flight finishes, a new request gets 503 with ``Retry-After``, the router sees the
  worker draining through ``/ready`` and routes around it, the process exits 0, and the disk KV tier's segments
  written at shutdown serve the next start;
- ``POST /workers/{id}/drain`` (admin key) sends a worker no new request while its stream finishes; undrain
  brings it back;
- a model forward that raises (``TOKENMILL_FAULT_INJECT_STEP``) fails that step's requests with a 500 naming the
  error (a stream with an error event), no block of it is ever served, and the engine carries on; three failed
  steps in a row and it reports dead;
- requests still running when ``--shutdown-timeout`` runs out end with a 503 (a stream with an error event).

Servers: A (SmolLM2 with RAM + disk KV tiers) and T (tiny Llama) behind router R; B restarts on A's disk directory
with forwards 2 and 3 failing and ``--shutdown-timeout 1``; C (tiny Llama) fails forwards 1-3. B's tests run in
file order (its forwards are counted).
"""
from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx2 as httpx
import pytest

from tests.server_fixtures import ServerProcess, sse_events
from tests.test_router import RouterProcess, stop_all
from tests.tiny_models import make_tiny_model

SMOLLM2_ARGS = ["--max-model-len", "512", "--num-threads", "1", "--kv-cache-memory", "0.25"]
TINY_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256"]
ADMIN_KEY = "lifecycle-admin"
# ~120 tokens: seven full 16-token blocks that A saves to disk at shutdown and B reads back
DISK_PROMPT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(9))
FAULT_PROMPT = "Failing step: " + " ".join(f"item {i}," for i in range(20))  # > 3 full blocks
LONG = {"max_tokens": 128, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def with_env(name: str, value: str, start):
    """``start()`` (which spawns a server) with ``name=value`` in the environment the child inherits."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(name, value)
        return start()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A and T behind R (round robin, admin key, health checks every 0.3 s), C on its own; A has seen
    DISK_PROMPT. Everything starts at once; B (below) needs A stopped."""
    logs = tmp_path_factory.mktemp("lifecycle_logs")
    disk = tmp_path_factory.mktemp("kv_disk")
    tiers = ["--kv-offload-memory", "0.01", "--kv-offload-disk-path", str(disk), "--kv-offload-disk-size", "0.05",
             "--kv-offload-disk-drive-size", "1"]
    tiny = str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama")))
    a = ServerProcess(None, [*SMOLLM2_ARGS, *tiers, "--shutdown-timeout", "60"], logs / "a.log")
    t = ServerProcess(tiny, TINY_ARGS, logs / "t.log")
    c = with_env("TOKENMILL_FAULT_INJECT_STEP", "1,2,3", lambda: ServerProcess(tiny, TINY_ARGS, logs / "c.log"))
    r = RouterProcess([a.url, t.url], ["--policy", "round_robin", "--health-check-interval", "0.3"], logs / "r.log",
                      admin_api_key=ADMIN_KEY)
    procs = [r, a, t, c]
    try:
        for proc in (a, t, c):
            proc.wait_healthy()
        assert a.post("/v1/completions", {"prompt": DISK_PROMPT, "max_tokens": 1}).status_code == 200
        r.wait_up().wait_workers_healthy()
        yield {"a": a, "t": t, "c": c, "r": r, "tiers": tiers, "logs": logs}
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def restarted(cluster):
    """B: SmolLM2 on A's disk directory (A stopped first), forwards 2 and 3 raising, --shutdown-timeout 1; its
    first forward answered DISK_PROMPT (kept as ``disk_answer``)."""
    a = cluster["a"]
    if a.proc.poll() is None:
        a.stop()
    b = with_env("TOKENMILL_FAULT_INJECT_STEP", "2,3", lambda: ServerProcess(
        None, [*SMOLLM2_ARGS, *cluster["tiers"], "--shutdown-timeout", "1"], cluster["logs"] / "b.log"))
    try:
        b.wait_healthy()
        answer = b.post("/v1/completions", {"prompt": DISK_PROMPT, "max_tokens": 1})
        yield b, answer
    finally:
        b.stop()


class Stream(threading.Thread):
    """One streamed completion read to its end on a thread: ``started`` is set at its first event; ``events``
    are the payloads (dicts and "[DONE]"), ``headers`` the response headers."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.started = threading.Event()
        self.events: list = []
        self.headers: dict = {}
        self.status: int | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json={**self.body, "stream": True},
                              timeout=120) as response:
                self.status, self.headers = response.status_code, dict(response.headers)
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.started.set()
        finally:
            self.started.set()

    def result(self, timeout: float = 120) -> tuple[str, int, list[dict]]:
        """(finish reason, tokens streamed, error events) once the stream ended with [DONE]."""
        self.join(timeout)
        assert not self.is_alive() and self.status == 200 and self.events[-1] == "[DONE]", self.events[-3:]
        chunks = [e for e in self.events[:-1] if "choices" in e]
        reasons = [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]]
        tokens = sum(len(c.get("token_ids") or []) for e in chunks for c in e["choices"])
        return (reasons[-1] if reasons else None), tokens, [e["error"] for e in self.events[:-1] if "error" in e]


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.05)
    return value


def workers_of(r: RouterProcess) -> dict[str, dict]:
    return {w["id"]: w for w in r.workers().values()}


def test_shutdown_timeout_flag_and_its_older_name():
    from tokenmill.cli.main import build_parser

    def parsed(*argv: str) -> float:
        return build_parser().parse_args(["serve", *argv]).shutdown_timeout

    assert (parsed(), parsed("--shutdown-timeout", "5"), parsed("--timeout-graceful-shutdown", "7")) == (30.0, 5.0, 7.0)


# ---- router: drain a worker ---------------------------------------------------------------------------------
def test_router_drain_sends_no_new_work_while_the_workers_stream_finishes(cluster):
    r, a = cluster["r"], cluster["a"]
    ids = {w["url"]: w["id"] for w in r.workers().values()}
    a_id, t_id = ids[a.url], ids[cluster["t"].url]
    stream = Stream(r.url, {"prompt": "Once upon a time", **LONG})
    stream.start()
    assert stream.started.wait(60)
    assert stream.headers["x-router-worker-id"] == a_id  # round robin: the first request goes to worker-0

    json_header = {"content-type": "application/json"}
    assert_openai_error(httpx.post(f"{r.url}/workers/{a_id}/drain", headers=json_header, timeout=30), 401)
    drained = httpx.post(f"{r.url}/workers/{a_id}/drain", headers={**r.admin_headers(), **json_header}, timeout=30)
    assert drained.status_code == 200 and drained.json()["state"] == "draining", drained.text
    assert drained.json()["drain_requested"] is True
    for _ in range(3):  # every new request goes to the other worker
        response = httpx.post(f"{r.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert response.status_code == 200 and response.headers["x-router-worker-id"] == t_id
    listed = workers_of(r)[a_id]
    assert listed["state"] == "draining"
    time.sleep(0.5)  # health checks (every 0.3 s) keep an administrator's drain
    assert workers_of(r)[a_id]["state"] == "draining"

    reason, tokens, errors = stream.result()
    assert (reason, tokens, errors) == ("length", LONG["max_tokens"], [])  # the stream in flight finished whole

    back = httpx.post(f"{r.url}/workers/{a_id}/undrain", headers={**r.admin_headers(), **json_header}, timeout=30)
    assert back.status_code == 200 and back.json()["state"] == "healthy", back.text
    served = {httpx.post(f"{r.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                         timeout=60).headers["x-router-worker-id"] for _ in range(2)}
    assert served == {a_id, t_id}
    missing = httpx.post(f"{r.url}/workers/worker-9/drain", headers={**r.admin_headers(), **json_header}, timeout=30)
    assert assert_openai_error(missing, 404)["param"] == "worker_id"


# ---- SIGTERM: drain, exit 0, disk tier for the next start ---------------------------------------------------
def test_sigterm_lets_the_stream_finish_refuses_new_requests_and_exits_0(cluster):
    a, r = cluster["a"], cluster["r"]
    assert httpx.get(f"{a.url}/ready", timeout=10).json() == {"status": "ready"}
    stream = Stream(a.url, {"prompt": DISK_PROMPT, **LONG})
    stream.start()
    assert stream.started.wait(60)
    a.proc.send_signal(signal.SIGTERM)

    wait_for(lambda: httpx.get(f"{a.url}/ready", timeout=10).status_code == 503, what="/ready 503")
    assert "draining" in assert_openai_error(httpx.get(f"{a.url}/ready", timeout=10), 503)["message"]
    assert httpx.get(f"{a.url}/health", timeout=10).status_code == 200  # alive: liveness probes must not kill it
    refused = a.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert_openai_error(refused, 503)
    assert refused.headers["retry-after"] == "1"
    a_id = next(w["id"] for w in r.workers().values() if w["url"] == a.url)
    wait_for(lambda: workers_of(r)[a_id]["state"] == "draining", what="the router seeing A draining")
    routed = httpx.post(f"{r.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert routed.status_code == 200 and routed.headers["x-router-worker-id"] != a_id

    reason, tokens, errors = stream.result()
    assert (reason, tokens, errors) == ("length", LONG["max_tokens"], [])
    assert a.proc.wait(60) == 0
    log = a.log()
    saved = re.search(r"saved (\d+) blocks to disk at shutdown", log)
    assert saved and int(saved.group(1)) >= 7, log[-3000:]  # DISK_PROMPT's full blocks at least
    assert "Traceback" not in log
    assert httpx.post(f"{r.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                      timeout=60).headers["x-router-worker-id"] != a_id


def test_next_start_reads_the_disk_segments_written_at_the_drain(restarted):
    b, answer = restarted
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 7 * 16
    assert b.metrics()["tokenmill:kv_offload_hits_total{tier=disk}"] >= 7


# ---- a failed engine step ---------------------------------------------------------------------------------------
def test_blocks_a_failed_step_was_to_write_leave_the_prefix_cache():
    """CPU only: ``allocate_slots`` indexes a step's full blocks when the step is planned; if its forward fails,
    ``discard_unwritten`` unindexes them (blocks computed by earlier steps stay hits), then the request is freed."""
    from tests.scheduler_helpers import make_request
    from tokenmill.kv_cache import KVCacheManager

    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    done = make_request("done", list(range(100, 108)) + [1, 2])  # computed by an earlier step: 2 full blocks
    kv.allocate_slots(done, 10)
    done.num_computed_tokens = 10
    failed = make_request("failed", list(range(100, 108)) + list(range(200, 209)))  # 17 tokens
    hits, num_hit = kv.get_computed_blocks(failed)
    kv.allocate_slots(failed, 17 - num_hit, hits)
    failed.num_computed_tokens = num_hit  # the failed step was to compute the rest
    probe = make_request("probe", failed.prompt_token_ids + [5])
    assert kv.get_computed_blocks(probe)[1] == 16  # indexed before any forward ran
    kv.discard_unwritten(failed)
    kv.free(failed)
    assert kv.get_computed_blocks(make_request("probe2", failed.prompt_token_ids + [5]))[1] == 8  # earlier blocks only
    kv.free(done)
    kv.check_integrity(idle=True)


def test_offline_generate_raises_the_step_failure_and_leaves_no_request(tmp_path, monkeypatch):
    from tokenmill import LLM, SamplingParams
    from tokenmill.engine.llm_engine import InjectedFault, StepFailedError

    monkeypatch.setenv("TOKENMILL_FAULT_INJECT_STEP", "2")
    llm = LLM(str(make_tiny_model("llama", tmp_path / "tiny")), dtype="float32", num_threads=1, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(StepFailedError) as failed:
        llm.generate(["a b c d e f g h i j k l m n o p q r", "x y z"], params)  # forward 2 is their first decode
    assert isinstance(failed.value.cause, InjectedFault) and len(failed.value.request_ids) == 2
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity(idle=True)
    assert len(llm.generate(["a b c d e f g h i j k l m n o p q r"], params)[0].outputs[0].token_ids) == 4


def test_failed_step_fails_its_requests_with_500_and_the_engine_carries_on(restarted):
    b, _ = restarted
    # forward 2 raises: the stream ends with an error event naming it
    response = httpx.post(f"{b.url}/v1/completions", timeout=60,
                          json={"prompt": FAULT_PROMPT, "max_tokens": 8, "temperature": 0, "stream": True})
    events = sse_events(response)
    assert response.status_code == 200 and events[-1] == "[DONE]", events
    errors = [e["error"] for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == 500 and errors[0]["type"] == "internal_server_error"
    assert "InjectedFault" in errors[0]["message"] and "TOKENMILL_FAULT_INJECT_STEP" in errors[0]["message"]
    # forward 3 raises: a non-streamed request gets a 500 with an OpenAI error body
    failed = b.post("/v1/completions", {"prompt": "Another prompt", "max_tokens": 4})
    error = assert_openai_error(failed, 500)
    assert error["type"] == "internal_server_error" and "InjectedFault" in error["message"]

    assert httpx.get(f"{b.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{b.url}/ready", timeout=10).status_code == 200
    # The failed step's full blocks were prefix-cache entries before its forward ran: none is hit now.
    body = {"prompt": FAULT_PROMPT, "max_tokens": 8, "temperature": 0}
    first = b.post("/v1/completions", body)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = b.post("/v1/completions", body).json()  # blocks written by a step that ran are cached as usual
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    assert again["choices"][0]["text"] == first.json()["choices"][0]["text"]
    kv = b.wait_idle()
    assert kv["integrity"] == "ok" and kv["num_free_blocks"] == kv["num_blocks"], kv


def test_shutdown_timeout_ends_requests_still_running_with_503(restarted):
    b, _ = restarted
    stream = Stream(b.url, {"prompt": "Tell me a long story.", **LONG, "max_tokens": 480})
    stream.start()
    result: dict = {}
    blocking = threading.Thread(target=lambda: result.update(response=b.post(
        "/v1/completions", {"prompt": "Another long story.", **LONG, "max_tokens": 480})), daemon=True)
    blocking.start()
    assert stream.started.wait(60)
    wait_for(lambda: b.kv_cache()["num_running"] == 2, what="both requests running")
    b.proc.send_signal(signal.SIGTERM)  # --shutdown-timeout 1: neither can finish in time

    reason, tokens, errors = stream.result()
    assert reason is None and 0 < tokens < 480
    assert len(errors) == 1 and errors[0]["code"] == 503 and "--shutdown-timeout" in errors[0]["message"], errors
    blocking.join(60)
    error = assert_openai_error(result["response"], 503)
    assert error["type"] == "service_unavailable_error" and "--shutdown-timeout" in error["message"]
    assert b.proc.wait(60) == 0
    drain = b.log().split("draining: ")[-1]  # what happened from the signal on
    assert "request(s) still running were ended" in drain and "Traceback" not in drain, drain[-3000:]


# ---- repeated failures: dead ----------------------------------------------------------------------------------
def test_three_failed_steps_in_a_row_report_the_engine_dead(cluster):
    c = cluster["c"]
    body = {"prompt": "Hi there", "max_tokens": 4}
    for _ in range(2):
        assert "InjectedFault" in assert_openai_error(c.post("/v1/completions", body), 500)["message"]
    assert "3 engine steps in a row failed" in assert_openai_error(c.post("/v1/completions", body), 503)["message"]
    for path in ("/health", "/ready"):
        assert "not running" in assert_openai_error(httpx.get(f"{c.url}{path}", timeout=10), 503)["message"]
    assert_openai_error(c.post("/v1/completions", body), 503)
    assert c.stop() == 0
