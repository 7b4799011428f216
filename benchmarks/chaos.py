"""Chaos benchmark: a router over workers under steady mixed load while workers are killed or hung.

Default mode: ``tokenmill router`` over ``--workers`` (3) ``tokenmill serve`` workers. ``--pd``: the router
with ``--pd-disaggregation`` over ``--prefill`` (2) prefill and ``--decode`` (2) decode workers. Every server
is a real process on 127.0.0.1 running the embedded SmolLM2 GGUF (or ``--model``), in ``--deterministic``
(batch-invariant) mode so a request's tokens do not depend on what ran beside it.

Load: ``--concurrency`` clients send requests back to back for ``--duration`` seconds, each drawn from a
mix: greedy and seeded completions streams (token ids asked for), a seeded ``n = 2`` stream, seeded chat
streams, non-streamed completions, non-streamed structured outputs (a JSON schema), streams the client
cancels after a few chunks, and non-streamed requests the client abandons after a short timeout.

Faults: after ``--warmup`` seconds, and then every 20–30 s (``--fault-every``), a random worker (of either
role with ``--pd``) is SIGKILLed (restarted at once on the same port) or SIGSTOPped (hung: its port still
takes connections) and SIGCONTed ``--stop-seconds`` later; kills and stops alternate. In PD mode a prefill
worker is killed or stopped while transfers run (the load keeps it busy), a decode worker mid-stream.

Reported (printed table, and JSON with ``--json``):
- requests accepted (answered 200), completed, cancelled by the client, lost (failed as the client saw it
  without cancelling it: must be 0), and the router's retries before the first token by reason
  (``tokenmill_router:retries_total``: each was retried on another worker);
- streams resumed (``tokenmill_router:resumptions_total``), disturbed streams (their worker was faulted
  while they ran), and whether each greedy or seeded disturbed stream equals its undisturbed run (the same
  request sent afterwards straight to a worker nobody disturbs), plus a sample of undisturbed ones as a
  control;
- for each hung worker: seconds from SIGSTOP until the router marked it unhealthy (detected) and until no
  request of the router was left on it (routed around), goal <= 5 s; and requests sent to it after it
  was detected (must be 0).

Run on a quiet machine (it loads every core)::

    .venv/bin/python benchmarks/chaos.py                       # 5 minutes, router + 3 workers
    .venv/bin/python benchmarks/chaos.py --pd                  # 5 minutes, router + 2 prefill + 2 decode
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
KINDS = ("stream_greedy", "stream_seeded", "stream_n2", "chat_stream", "plain", "structured", "cancel", "abandon")
WEIGHTS = (4, 3, 1, 3, 2, 1, 1, 1)
DETERMINISTIC_KINDS = ("stream_greedy", "stream_seeded", "stream_n2", "chat_stream", "plain", "structured")
TOPICS = ("a lighthouse keeper", "a lost robot", "the first snow", "a market at dawn", "an old violin",
          "a river town", "the last train", "a garden on Mars")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``tokenmill`` subcommand on a fixed port (kept across restarts), logging to a file."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name, self.args, self.log_dir = name, args, log_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.stopped = False  # SIGSTOPped now
        self.restarting = False  # SIGKILLed, not up again yet

    def start(self) -> Server:
        self.starts += 1
        log = open(self.log_dir / f"{self.name}.{self.starts}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli.main", *self.args, "--port", str(self.port)],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        return self

    def wait(self, path: str = "/health", timeout: float = 600.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log_dir}")
            try:
                if httpx.get(self.url + path, timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not up after {timeout} s")

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Record:
    """One request as the client saw it."""

    kind: str
    key: tuple  # what determines its output (deterministic kinds)
    path: str
    body: dict
    start: float
    end: float = 0.0
    status: int | None = None
    worker: str | None = None  # x-router-worker-id (PD: the decode worker)
    choices: dict = field(default_factory=dict)  # index -> {"text", "token_ids", "finish_reason"}
    done: bool = False
    error: str | None = None
    cancelled: bool = False

    @property
    def lost(self) -> bool:
        return not self.cancelled and (self.status != 200 or self.error is not None or not self.done)


def request_for(rng: random.Random, model: str | None) -> tuple[str, tuple, str, dict]:
    """A random request of the mix: (kind, key, path, body)."""
    kind = rng.choices(KINDS, WEIGHTS)[0]
    topic, seed = rng.randrange(len(TOPICS)), rng.randrange(4)
    max_tokens = rng.choice((48, 96, 160))
    body: dict = {"max_tokens": max_tokens, **({"model": model} if model else {})}
    prompt = f"Write a short story about {TOPICS[topic]}. Chapter {seed + 1}:"
    messages = [{"role": "user", "content": f"Tell me about {TOPICS[topic]} (part {seed + 1})."}]
    if kind in ("stream_greedy", "cancel"):
        path, body = "/v1/completions", {**body, "prompt": prompt, "temperature": 0, "stream": True}
    elif kind == "stream_seeded":
        path, body = "/v1/completions", {**body, "prompt": prompt, "temperature": 0.8, "seed": seed, "stream": True}
    elif kind == "stream_n2":
        path, body = "/v1/completions", {**body, "prompt": prompt, "temperature": 1.0, "seed": seed, "n": 2,
                                         "stream": True}
    elif kind == "chat_stream":
        path, body = "/v1/chat/completions", {**body, "messages": messages, "temperature": 0.7, "seed": seed,
                                              "stream": True}
    elif kind == "structured":
        path = "/v1/chat/completions"
        body = {**body, "max_tokens": 64, "temperature": 0, "messages": [
            {"role": "user", "content": f"Invent a person who loves {TOPICS[topic]}; answer in JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    else:  # plain, abandon
        path, body = "/v1/completions", {**body, "prompt": prompt, "temperature": 0}
    if body.get("stream") and path == "/v1/completions":
        body["return_token_ids"] = True  # the token ids the undisturbed run must repeat
    key = (path, json.dumps({k: v for k, v in body.items() if k != "stream"}, sort_keys=True))
    return kind, key, path, body


def absorb(record: Record, event: dict) -> None:
    for choice in event.get("choices") or ():
        got = record.choices.setdefault(choice.get("index", 0), {"text": "", "token_ids": [], "finish_reason": None})
        if "delta" in choice:
            got["text"] += choice["delta"].get("content") or ""
        elif "message" in choice:
            got["text"] += choice["message"].get("content") or ""
        else:
            got["text"] += choice.get("text") or ""
        got["token_ids"] += choice.get("token_ids") or []
        got["finish_reason"] = choice.get("finish_reason") or got["finish_reason"]


async def send(client: httpx.AsyncClient, base: str, record: Record, rng: random.Random | None = None) -> Record:
    """Send ``record``'s request to ``base`` and fill in what came back (``rng`` draws where a cancel
    or abandon happens; None: never)."""
    cancel_after = rng.randint(1, 6) if rng is not None and record.kind == "cancel" else None
    try:
        if record.body.get("stream"):
            async with client.stream("POST", base + record.path, json=record.body, timeout=300) as response:
                record.status, record.worker = response.status_code, response.headers.get("x-router-worker-id")
                if response.status_code != 200:
                    record.error = (await response.aread())[:300].decode(errors="replace")
                    return record
                chunks = 0
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        record.done = True
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        record.error = json.dumps(event["error"])[:300]
                        continue
                    absorb(record, event)
                    chunks += 1
                    if cancel_after is not None and chunks >= cancel_after:
                        record.cancelled = True
                        return record
        else:
            timeout = rng.uniform(0.2, 1.5) if rng is not None and record.kind == "abandon" else 300
            try:
                response = await client.post(base + record.path, json=record.body, timeout=timeout)
            except httpx.TimeoutException:
                if record.kind != "abandon" or rng is None:
                    raise
                record.cancelled = True
                return record
            record.status, record.worker = response.status_code, response.headers.get("x-router-worker-id")
            if response.status_code != 200:
                record.error = response.text[:300]
                return record
            absorb(record, response.json())
            record.done = True
    except (httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.end = time.monotonic()
    return record


@dataclass
class Fault:
    kind: str  # kill | stop
    server: str
    role: str
    at: float
    resumed_at: float | None = None  # SIGCONT sent, or restart up
    detected_s: float | None = None
    routed_around_s: float | None = None
    sent_after_detection: int = 0


class Monitor:
    """Polls the router's ``GET /workers`` every ``interval`` seconds: (time, {url: (state, running)})."""

    def __init__(self, router_url: str, interval: float = 0.1) -> None:
        self.router_url, self.interval = router_url, interval
        self.samples: list[tuple[float, dict[str, tuple[str, int]]]] = []
        self.ids: dict[str, str] = {}  # worker id -> url

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            try:
                listed = (await client.get(self.router_url + "/workers", timeout=5)).json()
                workers = listed.get("workers", []) + listed.get("prefill_workers", [])
                self.samples.append((time.monotonic(), {w["url"]: (w["state"], w["running_requests"])
                                                        for w in workers}))
                self.ids.update({w["id"]: w["url"] for w in listed.get("workers", [])})
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(self.interval)

    def first(self, url: str, since: float, until: float, test) -> float | None:
        for t, states in self.samples:
            if since <= t <= until and url in states and test(*states[url]):
                return t - since
        return None


async def router_metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(url + "/metrics", timeout=10)).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("tokenmill_router:") and sample.name.endswith("_total"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


async def chaos(args, router: Server, roles: dict[str, list[Server]], worker_args: dict[str, list[str]]) -> dict:
    rng = random.Random(args.seed)
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None), trust_env=False)
    monitor = Monitor(router.url)
    monitor_task = asyncio.ensure_future(monitor.run(client))
    before = await router_metrics(client, router.url)
    records: list[Record] = []
    faults: list[Fault] = []
    start = time.monotonic()
    stop_at = start + args.duration

    async def load_client(i: int) -> None:
        crng = random.Random(args.seed * 1000 + i)
        while time.monotonic() < stop_at:
            kind, key, path, body = request_for(crng, args.model)
            record = Record(kind, key, path, body, time.monotonic())
            records.append(record)
            await send(client, router.url, record, crng)

    async def restart(server: Server, fault: Fault) -> None:
        await asyncio.to_thread(server.proc.wait)
        server.start()
        await asyncio.to_thread(server.wait)
        server.restarting = False
        fault.resumed_at = time.monotonic()

    async def injector() -> None:
        background = []
        next_at = start + args.warmup
        kinds = ["stop", "kill"]
        while True:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if time.monotonic() >= stop_at - 5:
                break
            kind = kinds[len(faults) % 2]
            up = {role: [s for s in servers if not s.stopped and not s.restarting] for role, servers in roles.items()}
            candidates = sorted(r for r, servers in up.items() if len(servers) > 1)  # one of each role stays up
            if not candidates:
                next_at = time.monotonic() + 1.0
                continue
            role = rng.choice(candidates)
            server = rng.choice(up[role])
            fault = Fault(kind, server.name, role, time.monotonic())
            faults.append(fault)
            print(f"[{fault.at - start:6.1f} s] {kind} {server.name} ({role})", flush=True)
            if kind == "kill":
                server.restarting = True
                server.signal(signal.SIGKILL)
                background.append(asyncio.ensure_future(restart(server, fault)))
            else:
                server.signal(signal.SIGSTOP)
                server.stopped = True
                await asyncio.sleep(args.stop_seconds)
                server.signal(signal.SIGCONT)
                server.stopped = False
                fault.resumed_at = time.monotonic()
            next_at = fault.at + rng.uniform(*args.fault_every)
        await asyncio.gather(*background)

    inject = asyncio.ensure_future(injector())
    await asyncio.gather(*(load_client(i) for i in range(args.concurrency)))
    await inject
    await asyncio.sleep(2 * args.health_wait)  # the last fault's worker is taken back
    after = await router_metrics(client, router.url)
    monitor_task.cancel()
    await client.aclose()

    urls = {s.name: s.url for servers in roles.values() for s in servers}
    for fault in faults:
        url = urls[fault.server]
        until = fault.resumed_at or time.monotonic()
        fault.detected_s = monitor.first(url, fault.at, until, lambda state, _: state != "healthy")
        fault.routed_around_s = monitor.first(url, fault.at, until, lambda state, running: state != "healthy"
                                              and running == 0)
        if fault.detected_s is not None:
            detected_at = fault.at + fault.detected_s
            back = monitor.first(url, detected_at, until, lambda state, _: state == "healthy")
            until = until if back is None else detected_at + back
            fault.sent_after_detection = sum(1 for r in records if monitor.ids.get(r.worker) == url
                                             and detected_at + 0.2 < r.start < until)

    # disturbed: the worker that took it (PD: its decode worker; any prefill fault) was faulted while it ran
    def disturbed(record: Record) -> bool:
        for fault in faults:
            if not record.start <= fault.at <= record.end:
                continue
            if fault.role == "prefill" or monitor.ids.get(record.worker) == urls[fault.server]:
                return True
        return False

    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    return {"records": records, "faults": faults, "disturbed": [r for r in records if disturbed(r)],
            "metrics": delta, "seconds": time.monotonic() - start}


async def reference_check(args, reference: Server, result: dict) -> dict:
    """Replay the disturbed deterministic requests (and a control sample of undisturbed ones) straight to
    ``reference`` and compare outputs."""
    rng = random.Random(args.seed + 1)
    done = [r for r in result["records"] if r.kind in DETERMINISTIC_KINDS and r.done and not r.lost]
    disturbed_ids = {id(r) for r in result["disturbed"]}
    disturbed = [r for r in done if id(r) in disturbed_ids]
    undisturbed = [r for r in done if id(r) not in disturbed_ids]
    control = rng.sample(undisturbed, min(args.control_sample, len(undisturbed)))
    keys = {r.key: r for r in disturbed + control}
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None), trust_env=False)
    semaphore = asyncio.Semaphore(4)
    wanted: dict[tuple, Record] = {}

    async def one(key: tuple, record: Record) -> None:
        async with semaphore:
            wanted[key] = await send(client, reference.url, Record(record.kind, key, record.path, record.body,
                                                                   time.monotonic()))

    await asyncio.gather(*(one(k, r) for k, r in keys.items()))
    await client.aclose()

    def same(record: Record) -> bool:
        want = wanted[record.key]
        return want.done and not want.lost and want.choices == record.choices

    mismatches = [{"kind": r.kind, "body": r.body, "got": r.choices, "want": wanted[r.key].choices}
                  for r in disturbed + control if not same(r)]
    return {"disturbed_compared": len(disturbed), "disturbed_equal": sum(same(r) for r in disturbed),
            "control_compared": len(control), "control_equal": sum(same(r) for r in control),
            "mismatches": mismatches[:5]}


def summarize(mode: str, args, result: dict, check: dict) -> dict:
    records = result["records"]
    metrics = result["metrics"]
    hung = [f for f in result["faults"] if f.kind == "stop"]
    structured = [r for r in records if r.kind == "structured" and r.done and not r.lost]

    def valid_json(r: Record) -> bool:
        try:
            json.loads(r.choices[0]["text"])
            return True
        except (KeyError, ValueError):
            return False

    return {
        "mode": mode, "duration_s": round(result["seconds"], 1), "concurrency": args.concurrency,
        "requests_sent": len(records),
        "accepted": sum(r.status == 200 for r in records),
        "completed": sum(r.done and not r.lost for r in records),
        "cancelled_by_client": sum(r.cancelled for r in records),
        "lost": sum(r.lost for r in records),
        "lost_examples": [{"kind": r.kind, "status": r.status, "error": r.error} for r in records if r.lost][:5],
        "retried_before_first_token": {k.split("reason=")[1].rstrip("}"): int(v) for k, v in metrics.items()
                                       if k.startswith("tokenmill_router:retries_total")},
        "resumptions": int(metrics.get("tokenmill_router:resumptions_total", 0)),
        "router_errors": {k: int(v) for k, v in metrics.items() if k.startswith("tokenmill_router:request_errors")},
        "pd_requests": {k: int(v) for k, v in metrics.items() if k.startswith("tokenmill_router:pd_requests")},
        "disturbed_requests": len(result["disturbed"]),
        **check,
        "structured_valid_json": f"{sum(valid_json(r) for r in structured)}/{len(structured)}",
        "faults": [{"kind": f.kind, "server": f.server, "at_s": round(f.at - result["faults"][0].at, 1),
                    "detected_s": f.detected_s and round(f.detected_s, 2),
                    "routed_around_s": f.routed_around_s and round(f.routed_around_s, 2),
                    "sent_after_detection": f.sent_after_detection} for f in result["faults"]],
        "hung_detected_max_s": max((f.detected_s for f in hung if f.detected_s is not None), default=None),
        "hung_routed_around_max_s": max((f.routed_around_s for f in hung if f.routed_around_s is not None),
                                        default=None),
        "hung_undetected": sum(f.detected_s is None for f in hung),
    }


def print_table(row: dict) -> None:
    print(f"\n## chaos: {row['mode']} ({row['duration_s']} s, {row['concurrency']} clients)")
    print("| requests | accepted | completed | cancelled | lost | retried before 1st token | resumptions | "
          "disturbed (det.) equal | control equal | hung detected max s | routed around max s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    retried = sum(row["retried_before_first_token"].values())

    def fmt(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    print(f"| {row['requests_sent']} | {row['accepted']} | {row['completed']} | {row['cancelled_by_client']} | "
          f"{row['lost']} | {retried} {row['retried_before_first_token']} | {row['resumptions']} | "
          f"{row['disturbed_equal']}/{row['disturbed_compared']} | {row['control_equal']}/{row['control_compared']} | "
          f"{fmt(row['hung_detected_max_s'])} | {fmt(row['hung_routed_around_max_s'])} |")
    print("\n| fault | server | at s | detected s | routed around s | sent to it after detection |")
    print("|---|---|---|---|---|---|")
    for f in row["faults"]:
        print(f"| {f['kind']} | {f['server']} | {f['at_s']} | {fmt(f['detected_s'])} | {fmt(f['routed_around_s'])} "
              f"| {f['sent_after_detection']} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--pd", action="store_true", help="prefill/decode workers behind --pd-disaggregation")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=2, help="--pd: prefill workers")
    parser.add_argument("--decode", type=int, default=2, help="--pd: decode workers")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the first fault")
    parser.add_argument("--fault-every", type=float, nargs=2, default=(20.0, 30.0), metavar=("MIN", "MAX"))
    parser.add_argument("--stop-seconds", type=float, default=8.0, help="how long a SIGSTOPped worker stays hung")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="--num-threads of each worker")
    parser.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                        help="workers in default mode (resumed streams then may differ at near-ties)")
    parser.add_argument("--router-args", default="", help="extra router flags, one string")
    parser.add_argument("--control-sample", type=int, default=20, help="undisturbed requests replayed as a control")
    parser.add_argument("--health-wait", type=float, default=3.0, help="seconds to let the router re-admit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="chaos_"))
    print(f"logs in {log_dir}", flush=True)
    common = [*([args.model] if args.model else []), "--num-threads", str(args.threads), "--num-kv-blocks", "2048",
              "--disable-log-requests", *(["--deterministic"] if args.deterministic else [])]
    roles: dict[str, list[Server]] = {}
    worker_args: dict[str, list[str]] = {}
    if args.pd:
        for role, n, kv_role in (("prefill", args.prefill, "kv_producer"), ("decode", args.decode, "kv_consumer")):
            worker_args[role] = ["serve", *common, "--kv-transfer-config", json.dumps({"kv_role": kv_role})]
            roles[role] = [Server(f"{role}{i}", worker_args[role], log_dir) for i in range(n)]
    else:
        worker_args["worker"] = ["serve", *common]
        roles["worker"] = [Server(f"worker{i}", worker_args["worker"], log_dir) for i in range(args.workers)]
    # the reference: one more worker, never disturbed, started only after the chaos
    reference = Server("reference", ["serve", *common], log_dir)
    everyone = [s for servers in roles.values() for s in servers]
    router = None
    try:
        for server in everyone:
            server.start()
        for server in everyone:
            server.wait()
        if args.pd:
            router_cmd = ["router", "--pd-disaggregation", "--prefill", *(s.url for s in roles["prefill"]),
                          "--decode", *(s.url for s in roles["decode"])]
        else:
            router_cmd = ["router", "--worker-urls", *(s.url for s in roles["worker"])]
        router = Server("router", [*router_cmd, *args.router_args.split()], log_dir).start()
        router.wait("/health", timeout=120)
        print(f"{len(everyone)} workers and the router up; {args.duration:.0f} s of load", flush=True)
        result = asyncio.run(chaos(args, router, roles, worker_args))
        for server in [*everyone, router]:
            server.stop()
        reference.start().wait()
        check = asyncio.run(reference_check(args, reference, result))
    finally:
        for server in [*everyone, reference, *([router] if router else [])]:
            server.stop()
    row = summarize("pd" if args.pd else f"{args.workers} workers", args, result, check)
    print_table(row)
    print(json.dumps(row, indent=2, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps({"report": row, "args": vars(args)}, indent=2, default=str))
    ok = row["lost"] == 0 and row["disturbed_equal"] == row["disturbed_compared"] and row["hung_undetected"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
