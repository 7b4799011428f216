"""Helpers for server tests: run `tokenmill serve` as a real subprocess, wait for /health, stop it
with SIGTERM, and small HTTP/SSE/metrics readers shared by the server test modules.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx2 as httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]


_PORTS_FILE = Path(tempfile.gettempdir()) / "tokenmill-test-ports.json"
_PORT_HOLD_S = 600.0


def free_port() -> int:
    """A TCP port nobody listens on right now, and not handed to another test process in the last
    ``_PORT_HOLD_S`` seconds. pytest-xdist workers pick ports at the same moment, and the kernel can
    give two of them the same free port before either server has bound it: one server then fails to
    bind while its test talks to the other's (seen in CI: a worker's /debug/status answered by a router).
    The ports handed out are kept in a file under an exclusive lock, shared by every test process."""
    import fcntl

    with open(f"{_PORTS_FILE}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = time.time()
        try:
            taken = {int(p): t for p, t in json.loads(_PORTS_FILE.read_text()).items() if now - t < _PORT_HOLD_S}
        except (OSError, ValueError, AttributeError):
            taken = {}
        for _ in range(1000):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            if port not in taken:
                break
        taken[port] = now
        _PORTS_FILE.write_text(json.dumps(taken))
        return port


class ServerProcess:
    """``python -m tokenmill.cli.main serve [model] --port P *args`` with its output in ``log_path``."""

    def __init__(self, model: str | None, args: list[str], log_path: Path, api_key: str | None = None) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.log_path = log_path
        cmd = [sys.executable, "-m", "tokenmill.cli.main", "serve", *([model] if model else []),
               "--port", str(self.port), *args, *(["--api-key", api_key] if api_key else [])]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)
        self.url = f"http://127.0.0.1:{self.port}"
        self.loading_responses: dict[str, httpx.Response] = {}  # first /health and /v1/completions answers while loading

    def wait_healthy(self, timeout: float = 300.0) -> ServerProcess:
        """Poll /health until 200 (recording the first answers given while loading); returns self."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=2)
                if health.status_code == 200:
                    return self
                if not self.loading_responses:
                    self.loading_responses = {"health": health, "completions": self.post(
                        "/v1/completions", {"prompt": "Hi", "max_tokens": 1})}
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log()[-3000:]}")

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kwargs)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, body: dict, **kwargs) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, headers=self.headers(), timeout=120, **kwargs)

    def get_json(self, path: str) -> dict:
        response = httpx.get(f"{self.url}{path}", headers=self.headers(), timeout=30)
        response.raise_for_status()
        return response.json()

    def kv_cache(self) -> dict:
        return self.get_json("/debug/kv_cache")

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Poll /debug/kv_cache until nothing runs or waits and every block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            kv = self.kv_cache()
            idle = kv["num_running"] == 0 and kv["num_waiting"] == 0 and kv["num_free_blocks"] == kv["num_blocks"]
            if idle or time.monotonic() > deadline:
                return kv
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as ``name{label=value,...}`` -> value (labels sorted, model_name dropped)."""
        response = httpx.get(f"{self.url}/metrics", headers=self.headers(), timeout=30)
        response.raise_for_status()
        samples = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit code (killed with SIGKILL after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")


def sse_events(response: httpx.Response) -> list[dict | str]:
    """The payloads of a finished SSE response: dicts, and the string "[DONE]"."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def health_latencies_during(server: ServerProcess, path: str, body: dict) -> tuple[httpx.Response, float, list]:
    """Send one request while polling /health; returns (response, its duration, /health latencies)."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                start = time.perf_counter()
                assert client.get(f"{server.url}/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.1)
    start = time.perf_counter()
    response = server.post(path, body)
    duration = time.perf_counter() - start
    done.set()
    poller.join(30)
    return response, duration, latencies


def assert_health_kept_answering(duration: float, latencies: list, context: object = None) -> None:
    """/health answered all along a request that took ``duration`` seconds: polled at least 3 times and
    never waited 0.5 s, or, on a loaded machine where the request itself ran slow, never more than half
    the request's time (an event loop blocked by the request's CPU work waits about all of it)."""
    limit = max(0.5, duration / 2)
    assert len(latencies) >= 3 and max(latencies) < limit, (context, duration, sorted(latencies)[-3:])


class LocalHTTPServer:
    """A ``ThreadingHTTPServer`` on 127.0.0.1 (a free port) serving ``handler`` (a BaseHTTPRequestHandler
    class) from a daemon thread: the fake workers of the router tests. ``url``; ``close()`` stops it."""

    def __init__(self, handler: type) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
