"""Priority scheduling benchmark: a stream of high-priority requests under a flood of low-priority ones, served
once with ``--scheduling-policy fcfs`` and once with ``priority`` (alternated, ``--repeats`` times each), same
server settings, same seeded workload.

The flood: ``--low-concurrency`` clients each sending low-priority completions back to back (priority 10 under
the priority policy; the field is left out under fcfs, where every request is equal). The stream: high-priority
chat-free completions (priority 0) arriving as a Poisson process at ``--high-rate`` per second. Both stream, so
time to first token (TTFT) is measured at the client. Printed per run and summarised: high-priority TTFT p50 /
p99, low-priority output tokens per second, preemptions and RAM-tier hits the server reports; then the ratio of
the high-priority p99 TTFT, fcfs / priority (goal: >= 5), and the low-priority throughput the priority policy
gives up (%). With a RAM tier (``--kv-offload-memory``, default 1 GiB) a preempted low-priority request resumes
from its blocks there instead of recomputing its prompt.

Run on a quiet machine (every configuration shares its cores in turn, never at once)::

    .venv/bin/python benchmarks/priority.py                      # about 8 minutes on 2 cores
    .venv/bin/python benchmarks/priority.py --duration 30 --repeats 1
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_process import ServerProcess  # noqa: E402


def start_server(policy: str, args: argparse.Namespace, log: Path) -> ServerProcess:
    """A healthy ``tokenmill serve`` with ``policy`` and the run's settings (benchmarks/server_process.py)."""
    return ServerProcess(["--scheduling-policy", policy, "--max-num-seqs", str(args.max_num_seqs),
                          "--max-model-len", "2048", "--kv-offload-memory", str(args.kv_offload_memory),
                          *(["--num-threads", str(args.num_threads)] if args.num_threads else [])],
                         log, args.model).wait_healthy(300)


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in ("tokenmill:num_preemptions_total",):
                out[sample.name] = out.get(sample.name, 0) + sample.value
            if sample.name == "tokenmill:kv_offload_hits_total":
                out["kv_offload_hits"] = out.get("kv_offload_hits", 0) + sample.value
    return out


async def one(client: httpx.AsyncClient, body: dict) -> tuple[float | None, int]:
    """(TTFT seconds or None on error, output tokens) of one streamed completion."""
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return None, 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                if ttft is None:
                    ttft = time.perf_counter() - start
                tokens += 1
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft, tokens


def words(rng: random.Random, n: int) -> str:
    vocab = ["river", "stone", "quiet", "market", "engine", "signal", "harbor", "lantern", "orbit", "meadow"]
    return " ".join(rng.choice(vocab) for _ in range(n))


async def workload(url: str, policy: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    stop_at = time.monotonic() + args.duration
    low_tokens = 0
    high_ttft: list[float] = []
    errors = 0
    common = {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def low_client(i: int) -> None:
        nonlocal low_tokens, errors
        local = random.Random(args.seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            while time.monotonic() < stop_at:
                body = {"prompt": words(local, args.low_prompt_words), "max_tokens": args.low_max_tokens, **common}
                if policy == "priority":
                    body["priority"] = 10
                ttft, tokens = await one(client, body)
                errors += ttft is None
                if time.monotonic() < stop_at:
                    low_tokens += tokens

    async def high_stream() -> None:
        nonlocal errors
        tasks = []
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            await asyncio.sleep(args.warmup)
            while time.monotonic() < stop_at:
                body = {"prompt": words(rng, 40), "max_tokens": args.high_max_tokens, **common}
                if policy == "priority":
                    body["priority"] = 0
                tasks.append(asyncio.create_task(one(client, body)))
                await asyncio.sleep(rng.expovariate(args.high_rate))
            for ttft, _ in await asyncio.gather(*tasks):
                if ttft is None:
                    errors += 1
                else:
                    high_ttft.append(ttft)

    before = scrape(url)
    t0 = time.monotonic()
    await asyncio.gather(high_stream(), *(low_client(i) for i in range(args.low_concurrency)))
    elapsed = time.monotonic() - t0
    after = scrape(url)
    high_ttft.sort()
    return {
        "policy": policy,
        "high_requests": len(high_ttft),
        "high_ttft_p50_ms": 1000 * statistics.median(high_ttft) if high_ttft else None,
        "high_ttft_p99_ms": 1000 * high_ttft[min(len(high_ttft) - 1, int(0.99 * len(high_ttft)))] if high_ttft else None,
        "low_output_tok_s": low_tokens / args.duration,
        "preemptions": after.get("tokenmill:num_preemptions_total", 0) - before.get("tokenmill:num_preemptions_total", 0),
        "kv_offload_hits": after.get("kv_offload_hits", 0) - before.get("kv_offload_hits", 0),
        "errors": errors,
        "elapsed_s": elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--kv-offload-memory", type=float, default=1.0, help="GiB of the RAM tier (0: off)")
    parser.add_argument("--low-concurrency", type=int, default=32)
    parser.add_argument("--low-prompt-words", type=int, default=150)
    parser.add_argument("--low-max-tokens", type=int, default=96)
    parser.add_argument("--high-rate", type=float, default=0.5, help="high-priority requests per second")
    parser.add_argument("--high-max-tokens", type=int, default=16)
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of load per run")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of flood before the first high request")
    parser.add_argument("--repeats", type=int, default=2, help="runs per policy, alternated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="write the runs as JSON here")
    args = parser.parse_args()
    runs = []
    logs = Path(tempfile.mkdtemp(prefix="tokenmill-priority-"))
    for r in range(args.repeats):
        for policy in ("fcfs", "priority"):
            server = start_server(policy, args, logs / f"{policy}-{r}.log")
            try:
                run = asyncio.run(workload(server.url, policy, args))
            finally:
                server.stop()
            runs.append(run)
            print(json.dumps(run), flush=True)
    by = {p: [x for x in runs if x["policy"] == p] for p in ("fcfs", "priority")}

    def mean(policy: str, key: str) -> float:
        return statistics.mean(x[key] for x in by[policy] if x[key] is not None)

    ratio = mean("fcfs", "high_ttft_p99_ms") / mean("priority", "high_ttft_p99_ms")
    lost = 1 - mean("priority", "low_output_tok_s") / mean("fcfs", "low_output_tok_s")
    print(f"\n{'policy':<10}{'high p50 ms':>13}{'high p99 ms':>13}{'low tok/s':>11}{'preempt':>9}{'tier hits':>11}")
    for policy in ("fcfs", "priority"):
        print(f"{policy:<10}{mean(policy, 'high_ttft_p50_ms'):>13.0f}{mean(policy, 'high_ttft_p99_ms'):>13.0f}"
              f"{mean(policy, 'low_output_tok_s'):>11.1f}{mean(policy, 'preemptions'):>9.0f}"
              f"{mean(policy, 'kv_offload_hits'):>11.0f}")
    print(f"high-priority p99 TTFT, fcfs / priority: {ratio:.1f}x (goal >= 5x); low-priority throughput given up: "
          f"{100 * lost:.1f}%; errors: {sum(x['errors'] for x in runs)}")
    if args.output:
        args.output.write_text(json.dumps({"runs": runs, "p99_ratio": ratio, "low_lost": lost}, indent=1))
    return 0 if ratio >= 5 and not any(x["errors"] for x in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
