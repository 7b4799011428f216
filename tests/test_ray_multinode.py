"""Ray across nodes, for real: two Ray nodes on this machine (two ``ray start --block`` processes, token
authentication on), ``tokenmill serve --data-parallel-size 2 --data-parallel-size-local 1
--distributed-executor-backend ray --host 127.0.0.1`` places one replica on each node, each bound to
127.0.0.1, and serves through its router. SIGKILL of every process of the node that is not the router's
(its raylet, Ray workers and replica) in the middle of greedy streams: each stream completes equal to
its undisturbed run, resumed on the other node's replica. SIGTERM then stops the command cleanly, and no
Ray process of either node outlives the module.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import psutil
import pytest

from tests.server_fixtures import REPO, free_port
from tests.tiny_models import make_tiny_model

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
NODE_ARGS = ["--block", "--num-cpus", "2", "--object-store-memory", str(80 * 1024**2), "--disable-usage-stats"]
STREAMS = 6  # greedy streams in flight at the kill, three on each replica (round robin)
MAX_TOKENS = 96


class RayNode:
    """One simulated Ray node: a ``ray start --block`` process, the parent of every process of the node."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([*RAY, "start", *args], stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=REPO)
        self.seen: set[psutil.Process] = set()

    def processes(self) -> list[psutil.Process]:
        """The node's processes now (remembered, so that stop() also reaches those reparented since)."""
        try:
            now = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            now = []
        self.seen.update(now)
        return now

    def wait_started(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in self.log_path.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log_path.read_text()[-3000:]
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL every process of the node at once, as a node that loses power."""
        for process in self.processes():
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass

    def stop(self) -> list[psutil.Process]:
        """SIGTERM ``ray start`` (it stops its node), SIGKILL whatever is left after 30 s; returns the
        processes of the node still alive after that (none, unless something escaped)."""
        self.processes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        gone, alive = psutil.wait_procs(list(self.seen), timeout=10)
        for process in alive:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(10)
        self._log.close()
        return [p for p in psutil.wait_procs(alive, timeout=10)[1] if running(p)]


def running(process: psutil.Process) -> bool:
    """Whether ``process`` still runs (a zombie has stopped: only its exit status is left to collect)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head node and a worker node of one Ray cluster on this machine; ``tokenmill serve`` over both,
    its router on 127.0.0.1. Yields (model, serve process, router URL, {"head": node, "worker": node}, logs)."""
    import ray  # noqa: F401  (the ray extra, pinned in requirements.lock: an error, not a skip, without it)
    logs = tmp_path_factory.mktemp("ray_multinode_logs")
    temp_dir = tempfile.mkdtemp(prefix="tmray-", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_USAGE_STATS_ENABLED": "0"}
    gcs = free_port()
    nodes = {"head": RayNode(["--head", "--port", str(gcs), "--include-dashboard", "false", "--temp-dir", temp_dir,
                              "--dashboard-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
                              *NODE_ARGS], env, logs / "head.log")}
    serve = None
    try:
        model = str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama")))
        nodes["head"].wait_started()
        nodes["worker"] = RayNode(["--address", f"127.0.0.1:{gcs}", "--dashboard-agent-listen-port", str(free_port()),
                                   *NODE_ARGS], env, logs / "worker.log")
        port = free_port()
        serve_log = open(logs / "serve.log", "w")
        serve = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli.main", "serve", model, "--host", "127.0.0.1", "--port", str(port),
             "--data-parallel-size", "2", "--data-parallel-size-local", "1", "--distributed-executor-backend", "ray",
             "--ray-address", f"127.0.0.1:{gcs}", "--policy", "round_robin", "--dtype", "float32",
             "--num-threads", "2", "--num-kv-blocks", "256", "--block-size", "16"],
            stdout=serve_log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            log = (logs / "serve.log").read_text
            assert serve.poll() is None and time.monotonic() < deadline, log()[-4000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield model, serve, url, nodes, logs
    finally:
        if serve is not None and serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(90)
            except subprocess.TimeoutExpired:
                serve.kill()
                serve.wait()
        left = [p for node in nodes.values() for p in node.stop()]
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes left: {[(p.pid, p.name()) for p in left]}"


def listener(port: int) -> psutil._common.sconn:
    """The socket listening on TCP ``port`` of this machine (its ``laddr`` and ``pid``)."""
    return next(c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port)


def replicas_by_node(url: str, nodes: dict) -> dict[str, dict]:
    """node name -> the router's view of the replica on that node (``id``, ``url``, ...) plus its ``pid``."""
    workers = httpx.get(f"{url}/workers", timeout=10).json()["workers"]
    pids = {name: {p.pid for p in node.processes()} for name, node in nodes.items()}
    placed: dict[str, dict] = {}
    for worker in workers:
        sock = listener(int(worker["url"].rsplit(":", 1)[1]))
        assert sock.laddr.ip == "127.0.0.1", (worker, sock)  # --host 127.0.0.1 on every node
        name = next(n for n, members in pids.items() if sock.pid in members)
        assert name not in placed, (name, workers)
        placed[name] = {**worker, "pid": sock.pid}
    return placed


def greedy_stream(url: str, i: int, progress: list[int] | None = None) -> dict:
    """Stream request ``i`` (greedy, fixed length) through the router: the worker that took it, its text,
    token ids and finish reason, and whether it ended with [DONE] and no error event."""
    body = {"prompt": f"Request {i}: the story of a", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    out = {"text": "", "token_ids": [], "finish_reason": None, "done": False, "errors": []}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        out["worker"] = response.headers["x-router-worker-id"]
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
            for choice in event["choices"]:
                out["text"] += choice["text"]
                out["token_ids"] += choice.get("token_ids") or []
                out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
                if progress is not None:
                    progress[i] += len(choice.get("token_ids") or [])
    return out


def resumptions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r"^tokenmill_router:resumptions_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_one_replica_on_each_node_bound_to_host(cluster):
    _, _, url, nodes, _ = cluster
    placed = replicas_by_node(url, nodes)
    assert set(placed) == {"head", "worker"}, placed
    assert all(w["url"].startswith("http://127.0.0.1:") and w["state"] == "healthy" for w in placed.values())


def test_killing_a_node_mid_stream_resumes_its_streams_exactly(cluster):
    _, serve, url, nodes, _ = cluster
    victim = replicas_by_node(url, nodes)["worker"]
    with ThreadPoolExecutor(STREAMS) as pool:
        reference = list(pool.map(lambda i: greedy_stream(url, i), range(STREAMS)))
    assert all(r["done"] and not r["errors"] and len(r["token_ids"]) == MAX_TOKENS for r in reference), reference

    progress = [0] * STREAMS
    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(greedy_stream, url, i, progress) for i in range(STREAMS)]
        deadline = time.monotonic() + 60
        while min(progress) < 4:  # every stream under way, none near its end
            assert time.monotonic() < deadline and not any(f.done() for f in futures), progress
            time.sleep(0.005)
        nodes["worker"].kill()
        results = [f.result() for f in futures]
    assert any(r["worker"] == victim["id"] for r in results)  # streams were in flight on the killed node
    for i, (got, want) in enumerate(zip(results, reference)):
        assert got["done"] and not got["errors"], (i, got)
        assert (got["text"], got["token_ids"], got["finish_reason"]) == \
            (want["text"], want["token_ids"], want["finish_reason"]), i
    assert resumptions(url) > 0
    assert not psutil.pid_exists(victim["pid"]) or not running(psutil.Process(victim["pid"]))
    assert serve.poll() is None  # the router (on the head node) serves on
    after = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert after.status_code == 200 and after.headers["x-router-worker-id"] != victim["id"], after.text


def test_sigterm_stops_the_command_and_the_surviving_replica(cluster):
    _, serve, url, nodes, logs = cluster
    survivor = next(w for w in httpx.get(f"{url}/workers", timeout=10).json()["workers"] if w["state"] == "healthy")
    pid = listener(int(survivor["url"].rsplit(":", 1)[1])).pid
    serve.send_signal(signal.SIGTERM)
    assert serve.wait(90) == 0, (logs / "serve.log").read_text()[-3000:]
    try:
        alive = psutil.wait_procs([psutil.Process(pid)], timeout=30)[1]
    except psutil.NoSuchProcess:
        alive = []
    assert not [p for p in alive if running(p)], "the head node's replica outlived serve"


def test_data_parallel_size_local_must_divide_the_size_and_needs_ray_below_it():
    from tokenmill.cli.replicas import replicas_per_node

    assert replicas_per_node(4, None, "ray") is None and replicas_per_node(4, 2, "ray") == 2
    assert replicas_per_node(2, 2, "mp") == 2  # every mp replica is on this node: L = N is all it can be
    with pytest.raises(ValueError, match="--data-parallel-size-local 3 must divide --data-parallel-size 4"):
        replicas_per_node(4, 3, "ray")
    with pytest.raises(ValueError, match="--data-parallel-size-local 1 < --data-parallel-size 2 needs "
                                         "--distributed-executor-backend ray"):
        replicas_per_node(2, 1, "mp")
    code = ("from tokenmill.cli.main import main; import sys; sys.exit(main(['serve', 'no-such-model', "
            "'--data-parallel-size', '2', '--data-parallel-size-local', '1']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2 and "--data-parallel-size-local 1 < --data-parallel-size 2" in \
        result.stderr.strip().splitlines()[-1], result.stderr


def test_a_replica_on_a_wildcard_host_answers_at_its_node_address():
    """``--host 0.0.0.0`` across nodes: the router reaches a replica at its node's address, so the replica's
    Host check (no ``--allowed-hosts``) must take that IP literal (it refused every IP but this machine's own)."""
    from tokenmill.cli.replicas import replica_bind
    from tokenmill.security.http import AllowedHostsMiddleware, allowed_hosts_for, host_matches, host_name

    bind, reach = replica_bind("0.0.0.0", "10.1.2.3", on_router_node=False)
    allowed = AllowedHostsMiddleware(None, allowed_hosts_for(bind, None)).allowed
    assert (bind, reach) == ("0.0.0.0", "10.1.2.3") and host_matches(host_name(f"{reach}:8000"), allowed)
    assert not host_matches(host_name("attacker.example:8000"), allowed)  # a DNS name still needs --allowed-hosts
