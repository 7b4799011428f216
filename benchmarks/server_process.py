"""What the reliability benchmarks (``overload.py``, ``soak.py``) share: one ``tokenmill serve`` as a real
child process on 127.0.0.1, its resource use read with psutil (resident memory, open descriptors,
threads), its KV pool read from ``/debug/kv_cache``, and a ``/health`` poller in a separate process
(so the load generator's own event loop never delays a probe and is never mistaken for the server's).

Imports no torch and no tokenmill engine code: the poller's process starts fast under ``spawn``.
"""
from __future__ import annotations

import math
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import psutil

REPO = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, linear between order statistics; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class ServerProcess:
    """``python -m tokenmill.cli.main serve [model] --port P *args``, its output in ``log_path``."""

    def __init__(self, args: list[str], log_path: Path, model: str | None = None) -> None:
        from tokenmill.procs import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli.main", "serve", *([model] if model else []),
                                      "--port", str(self.port), *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)
        self.ps = psutil.Process(self.proc.pid)

    def wait_healthy(self, timeout: float = 600.0) -> ServerProcess:
        """Poll ``/health`` until 200; returns self.

        Raises:
            RuntimeError: the server exited (its log's tail is in the message).
            TimeoutError: not healthy after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout:g} s:\n{self.log_tail()}")

    def resources(self) -> dict:
        """Resident memory (MiB), open file descriptors and threads of the server process now."""
        with self.ps.oneshot():
            return {"rss_mib": self.ps.memory_info().rss / 2**20, "num_fds": self.ps.num_fds(),
                    "num_threads": self.ps.num_threads()}

    def settled_rss_mib(self, stable_s: float = 3.0, tolerance_mib: float = 2.0, timeout: float = 120.0) -> float:
        """Resident memory once it has stopped changing for ``stable_s`` seconds (or ``timeout`` passed).

        An idle CPU server faults its KV pool's pages in from a background thread (docs/kv_offload.md), so
        its RSS climbs toward the whole pool's size after load; the settled value is the baseline growth is
        measured against."""
        deadline = time.monotonic() + timeout
        last, since = self.resources()["rss_mib"], time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.resources()["rss_mib"]
            if abs(now - last) > tolerance_mib:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= stable_s:
                break
        return self.resources()["rss_mib"]

    def kv_cache(self) -> dict:
        """``GET /debug/kv_cache`` (read on the engine thread between steps, with the pool's integrity check)."""
        response = httpx.get(f"{self.url}/debug/kv_cache", timeout=60)
        response.raise_for_status()
        return response.json()

    def wait_idle(self, timeout: float = 120.0) -> dict:
        """Poll ``/debug/kv_cache`` until nothing runs or waits and every block is free (or ``timeout``
        passes); returns the last snapshot (its ``integrity`` is the pool check's result)."""
        deadline = time.monotonic() + timeout
        while True:
            kv = self.kv_cache()
            if (kv["num_running"] == 0 and kv["num_waiting"] == 0 and kv["num_free_blocks"] == kv["num_blocks"]) \
                    or time.monotonic() > deadline:
                return kv
            time.sleep(0.2)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait (SIGKILL after ``timeout``); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _poll_health(url: str, interval_s: float, stop, out) -> None:
    """Child process body: GET ``url`` every ``interval_s`` over one kept-alive connection; each probe's
    (seconds since start, latency in seconds, status code or 0 for a transport error) goes to ``out`` at the end."""
    samples = []
    start = time.monotonic()
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            sent = time.perf_counter()
            try:
                status = client.get(url).status_code
            except httpx.TransportError:
                status = 0
            samples.append((time.monotonic() - start, time.perf_counter() - sent, status))
            stop.wait(max(0.0, interval_s - (time.perf_counter() - sent)))
    out.send(samples)
    out.close()


class HealthPoller:
    """Polls ``{url}/health`` every ``interval_s`` from a separate (spawned) process between ``start()`` and
    ``stop()``, which returns ``[(t_s, latency_s, status), ...]``."""

    def __init__(self, url: str, interval_s: float = 0.5) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_poll_health, args=(f"{url}/health", interval_s, self._stop, send),
                                 daemon=True)

    def start(self) -> HealthPoller:
        self._proc.start()
        return self

    def stop(self) -> list[tuple[float, float, int]]:
        self._stop.set()
        samples = self._recv.recv() if self._recv.poll(60) else []
        self._proc.join(10)
        return samples
