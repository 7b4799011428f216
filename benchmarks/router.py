"""Router benchmark: 2 replicas of 1 thread behind ``tokenmill router`` (one run per policy) against 1
replica of 2 threads served directly, on a multi-tenant shared-prefix workload and on ShareGPT; plus
the router's own overhead on time to first token.

For each configuration it prints request and token throughput, median / p90 TTFT, and the prefix-cache
hit tokens the workers report (``tokenmill:prefix_cache_hits_total``, summed over workers, difference
across the run). Router overhead: the same short requests, one at a time, sent back to back straight to a worker and
through a router in front of that worker, each path over its own persistent connection; the median of
the per-pair TTFT differences is what the router adds end to end, and the router's
``request_overhead_seconds`` histogram (dispatch + first-token relay) is its own time, without the
worker's TTFT noise. The overhead worker runs a tiny random Llama by default (``--overhead-model``), so
its TTFT is a few ms and steady and the router's share is not lost in the noise of a real model's
prefill (SmolLM2's TTFT varies by tens of ms from one request to the next on 2 cores).

Every server is a real process on 127.0.0.1 running the embedded SmolLM2 GGUF (or ``--model``); the
workers publish KV events so ``kv_aware`` can route. Run on a quiet machine: the two configurations
share its cores in turn, never at once::

    .venv/bin/python benchmarks/router.py                        # everything (~10 min on 2 cores)
    .venv/bin/python benchmarks/router.py --policies cache_aware kv_aware --num-prompts 48
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tokenmill.bench.serve_bench import LoadConfig, run_serve_benchmark  # noqa: E402
from tokenmill.bench.serve_client import ClientConfig, make_client, send_request  # noqa: E402
from tokenmill.bench.workload import DatasetConfig, build_workload, load_tokenizer  # noqa: E402

POLICIES = ["round_robin", "least_load", "power_of_two", "cache_aware", "kv_aware"]
EVENTS = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A ``tokenmill`` subcommand on a free port, logging to a file; ``wait(path)`` polls until it answers."""

    def __init__(self, args: list[str], log_dir: Path, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli.main", *args, "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)

    def wait(self, path: str, timeout: float = 300.0) -> Process:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log_path.name} exited:\n{self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.log_path.name} not up after {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_worker(model: str | None, threads: int, log_dir: Path, name: str, kv_blocks: int) -> Process:
    args = ["serve", *([model] if model else []), "--num-threads", str(threads), "--num-kv-blocks", str(kv_blocks),
            "--kv-events-config", EVENTS, "--disable-log-requests"]
    return Process(args, log_dir, name)


def prefix_hits(urls: list[str]) -> float:
    """Sum over workers of ``tokenmill:prefix_cache_hits_total`` (prompt tokens served from cache)."""
    total = 0.0
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        total += sum(float(v) for v in re.findall(r"^tokenmill:prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", text,
                                                  re.M))
    return total


def run_workload(base_url: str, workers: list[str], workload: list, tokenizer, concurrency: int) -> dict:
    """One timed run through ``base_url``; throughput, TTFT and the workers' prefix-hit tokens."""
    before = prefix_hits(workers)
    config = ClientConfig(base_url=base_url, endpoint="completions", ignore_eos=True)

    async def one_run():
        async with make_client(config) as client:  # closed inside its own event loop
            return await run_serve_benchmark(client, config, LoadConfig(max_concurrency=concurrency,
                                                                        disable_tqdm=True), workload, tokenizer)

    run = asyncio.run(one_run())
    m = run.metrics
    return {"completed": m.completed, "failed": m.failed, "req_s": m.request_throughput,
            "tok_s": m.total_token_throughput, "out_tok_s": m.output_throughput,
            "ttft_med_ms": m.ttft.median_ms, "ttft_p90_ms": m.ttft.p90_ms,
            "input_tokens": m.total_input_tokens, "hit_tokens": prefix_hits(workers) - before}


def histogram_buckets(metrics_text: str, name: str, **labels: str) -> dict[float, float]:
    """Upper bound -> cumulative count of the Prometheus histogram ``name`` whose labels include ``labels``
    (parsed with prometheus_client's own text parser)."""
    buckets = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket" and all(sample.labels.get(k) == v for k, v in labels.items()):
                buckets[float(sample.labels["le"])] = sample.value
    return buckets


def bucket_quantile(buckets: dict[float, float], q: float) -> float:
    """The ``q`` quantile of cumulative ``buckets``, interpolated inside its bucket as PromQL's
    ``histogram_quantile``; nan when there are no observations."""
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] == 0:
        return math.nan
    rank, low, below = q * ordered[-1][1], 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            return low if math.isinf(le) else low + (le - low) * (rank - below) / max(count - below, 1e-12)
        low, below = le, count
    return low


def router_overhead(worker_url: str, router_url: str, tokenizer, num: int) -> dict:
    """What the router adds to TTFT, two ways, on the same 16-token prompts sent one at a time:

    - paired: each prompt goes straight to the worker and through the router back to back (the order
      alternates, so drift cancels); the median of the per-pair differences (routed - direct) is the
      added TTFT. One persistent client per path, so neither pays connection setup.
    - the router's own ``request_overhead_seconds`` histogram over the routed requests: the median of
      its ``dispatch`` stage (arrival to upstream send) plus that of ``first_token_relay``.
    """
    requests = build_workload(DatasetConfig(name="random", num_prompts=num, random_input_len=16,
                                            random_output_len=1, seed=7), tokenizer)
    name = "tokenmill_router:request_overhead_seconds"

    async def run() -> tuple[list[float], list[float]]:
        configs = [ClientConfig(base_url=url, endpoint="completions", ignore_eos=True)
                   for url in (worker_url, router_url)]
        clients = [make_client(c) for c in configs]
        direct, routed = [], []
        try:
            for i, conv in enumerate(requests):
                turn = conv.turns[0]
                pair = [(0, direct), (1, routed)]
                for k, out in (pair if i % 2 == 0 else pair[::-1]):
                    reply = await send_request(clients[k], configs[k], turn.prompt, turn.expected_output_len,
                                               time.perf_counter())
                    assert reply.result.success, reply.result.error
                    out.append(reply.result.ttft * 1e3)
        finally:
            for c in clients:
                await c.close()
        return direct, routed

    before = httpx.get(f"{router_url}/metrics", timeout=10).text
    direct, routed = asyncio.run(run())
    after = httpx.get(f"{router_url}/metrics", timeout=10).text

    def stage_median(stage: str) -> float:
        """Median of this run's own observations: the bucket counts after minus before, in ms."""
        b, a = (histogram_buckets(text, name, stage=stage) for text in (before, after))
        return bucket_quantile({le: count - b.get(le, 0.0) for le, count in a.items()}, 0.5) * 1e3

    pairs = [r - d for d, r in zip(direct, routed)]
    dispatch, relay = stage_median("dispatch"), stage_median("first_token_relay")
    return {"direct_med_ms": statistics.median(direct), "routed_med_ms": statistics.median(routed),
            "added_med_ms": statistics.median(pairs), "added_mean_ms": statistics.fmean(pairs),
            "router_dispatch_med_ms": dispatch, "router_relay_med_ms": relay,
            "router_med_ms": dispatch + relay}


def table(rows: list[tuple[str, str, dict]]) -> str:
    head = ("| workload | configuration | req/s | total tok/s | TTFT median ms | TTFT p90 ms | prefix-hit tokens "
            "(of input) | failed |")
    lines = [head, "|" + "---|" * 8]
    for workload, name, r in rows:
        lines.append(f"| {workload} | {name} | {r['req_s']:.2f} | {r['tok_s']:.0f} | {r['ttft_med_ms']:.0f} | "
                     f"{r['ttft_p90_ms']:.0f} | {r['hit_tokens']:.0f} ({r['input_tokens']}) | {r['failed']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=POLICIES)
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per workload")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-groups", type=int, default=8, help="tenants (shared prefixes) of the prefix workload")
    parser.add_argument("--prefix-len", type=int, default=384)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks per worker")
    parser.add_argument("--overhead-requests", type=int, default=100)
    parser.add_argument("--overhead-model", default="tiny",
                        help="the worker model of the overhead runs: 'tiny' (a random 2-layer Llama built here, whose "
                             "few-ms TTFT leaves the router's share visible), 'default' (the SmolLM2 GGUF) or a path")
    parser.add_argument("--overhead-policies", nargs="+", choices=POLICIES, default=["cache_aware", "kv_aware"],
                        help="policies whose added TTFT is measured (kv_aware also tokenizes each prompt)")
    parser.add_argument("--workloads", nargs="*", choices=["shared-prefix", "sharegpt"],
                        default=["shared-prefix", "sharegpt"])
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.model)
    workloads = {
        "shared-prefix": build_workload(DatasetConfig(
            name="shared-prefix", num_prompts=args.num_prompts, shared_prefix_num_groups=args.num_groups,
            shared_prefix_len=args.prefix_len, shared_prefix_suffix_len=32, shared_prefix_output_len=args.output_len,
            seed=1), tokenizer),
        "sharegpt": build_workload(DatasetConfig(name="sharegpt", num_prompts=args.num_prompts,
                                                 sharegpt_output_len=args.output_len, sharegpt_max_prompt_len=512,
                                                 seed=1), tokenizer),
    }
    rows: list[tuple[str, str, dict]] = []
    overhead = None
    log_dir = Path(tempfile.mkdtemp(prefix="router_bench_"))
    print(f"logs in {log_dir}", flush=True)

    # 1 replica x 2 threads, served directly (fresh process per workload: a cold prefix cache each time).
    for name in args.workloads:
        single = start_worker(args.model, 2, log_dir, f"single_{name}", args.kv_blocks).wait("/health")
        try:
            result = run_workload(single.url, [single.url], workloads[name], tokenizer, args.concurrency)
        finally:
            single.stop()
        rows.append((name, "1 replica x 2 threads (direct)", result))
        print(rows[-1], flush=True)

    # 2 replicas x 1 thread behind the router, per policy (fresh workers per run: cold caches).
    for policy in args.policies:
        for name in args.workloads:
            workers = [start_worker(args.model, 1, log_dir, f"{policy}_{name}_w{i}", args.kv_blocks) for i in range(2)]
            router = None
            try:
                for w in workers:
                    w.wait("/health")
                router = Process(["router", "--policy", policy, "--worker-urls", *[w.url for w in workers]],
                                 log_dir, f"router_{policy}_{name}").wait("/health", timeout=60)
                result = run_workload(router.url, [w.url for w in workers], workloads[name], tokenizer,
                                      args.concurrency)
            finally:
                if router is not None:
                    router.stop()
                for w in workers:
                    w.stop()
            rows.append((name, f"2 replicas x 1 thread, router {policy}", result))
            print(rows[-1], flush=True)

    # Router overhead: one worker (2 threads), a router in front of it per policy, requests one at a time.
    overhead = {}
    overhead_model = args.model if args.overhead_model == "default" else args.overhead_model
    if overhead_model == "tiny":
        from tests.tiny_models import make_tiny_model

        overhead_model = str(make_tiny_model("llama", log_dir / "tiny_llama"))
    worker = start_worker(overhead_model, 2, log_dir, "overhead_worker", args.kv_blocks).wait("/health")
    try:
        for policy in args.overhead_policies:
            router = Process(["router", "--policy", policy, "--worker-urls", worker.url], log_dir,
                             f"overhead_router_{policy}").wait("/health", timeout=60)
            try:
                router_overhead(worker.url, router.url, tokenizer, 4)  # warm both paths
                overhead[policy] = router_overhead(worker.url, router.url, tokenizer, args.overhead_requests)
            finally:
                router.stop()
    finally:
        worker.stop()

    print()
    print(table(rows))
    print()
    for policy, o in overhead.items():
        print(f"router overhead, {policy} ({args.overhead_requests} requests, 16-token prompts, 1 output token, one at "
              f"a time, worker model {args.overhead_model}): direct median TTFT {o['direct_med_ms']:.2f} ms, through the router {o['routed_med_ms']:.2f} ms;"
              f" paired difference median {o['added_med_ms']:+.2f} ms (mean {o['added_mean_ms']:+.2f} ms); the router's "
              f"own time (histogram medians): dispatch {o['router_dispatch_med_ms']:.3f} ms + first-token relay "
              f"{o['router_relay_med_ms']:.3f} ms = {o['router_med_ms']:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [{"workload": w, "configuration": c, **r} for w, c, r in rows],
                                               "overhead": overhead, "args": vars(args)}, indent=2, default=str))
    return 0 if all(r["failed"] == 0 and not math.isnan(r["tok_s"]) for _, _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
