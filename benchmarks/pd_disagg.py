"""Prefill/decode disaggregation benchmark: decode smoothness under long-prompt arrivals.

Workload, the same for both configurations: ``--concurrency`` clients each send short decode-heavy
requests back to back (``--short-input`` prompt tokens, ``--short-output`` tokens, streamed), and
every ``--long-every`` seconds one long prompt arrives (``--long-input`` tokens, ``--long-output``
tokens). It runs for ``--duration`` seconds after a warm-up.

- colocated: one worker with 2 threads, requests sent to it directly;
- disaggregated: a prefill worker and a decode worker with 1 thread each, behind
  ``tokenmill router --pd-disaggregation``.

Printed per configuration: the short requests' inter-token latency (ITL) p50/p99 and TTFT p50/p99, the
long requests' TTFT p50, output tokens/s, and for the disaggregated run the KV bytes moved per
request and the mean transfer time (from the decode worker's ``/debug/status``). Every server is a
real process on 127.0.0.1 running the embedded SmolLM2 GGUF (or ``--model``). Run on a quiet machine::

    .venv/bin/python benchmarks/pd_disagg.py                 # ~3 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from router import Process  # noqa: E402  (benchmarks/router.py: a tokenmill subcommand on a free port)

from tokenmill.bench.serve_client import ClientConfig, make_client, send_request  # noqa: E402
from tokenmill.bench.workload import DatasetConfig, build_workload, load_tokenizer  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def drive(base_url: str, shorts: list, longs: list, args) -> dict:
    """Run the workload against ``base_url``; returns the measured latencies (ms) and token counts."""
    config = ClientConfig(base_url=base_url, endpoint="completions", ignore_eos=True, timeout_s=600)
    client = make_client(config)
    short_iter, long_iter = itertools.cycle(shorts), itertools.cycle(longs)
    out = {"short_ttft": [], "short_itl": [], "long_ttft": [], "tokens": 0, "failed": 0}
    start = time.perf_counter()
    warm_until = start + args.warmup
    stop_at = warm_until + args.duration

    async def one(request, max_tokens: int, kind: str) -> None:
        reply = await send_request(client, config, request.prompt, max_tokens, start)
        if time.perf_counter() < warm_until:
            return
        if not reply.result.success:
            out["failed"] += 1
            return
        out["tokens"] += reply.usage_completion_tokens or 0
        out[f"{kind}_ttft"].append(reply.result.ttft * 1e3)
        if kind == "short":
            out["short_itl"].extend(gap * 1e3 for gap in reply.result.itls)

    async def short_client() -> None:
        while time.perf_counter() < stop_at:
            await one(next(short_iter).turns[0], args.short_output, "short")

    async def long_arrivals() -> None:
        tasks = []
        await asyncio.sleep(args.long_every / 2)
        while time.perf_counter() < stop_at:
            tasks.append(asyncio.ensure_future(one(next(long_iter).turns[0], args.long_output, "long")))
            await asyncio.sleep(args.long_every)
        await asyncio.gather(*tasks)

    await asyncio.gather(*(short_client() for _ in range(args.concurrency)), long_arrivals())
    out["seconds"] = time.perf_counter() - warm_until
    await client.close()
    return out


def summary(name: str, m: dict) -> dict:
    return {"configuration": name, "short_itl_p50_ms": percentile(m["short_itl"], 50),
            "short_itl_p99_ms": percentile(m["short_itl"], 99), "short_ttft_p50_ms": percentile(m["short_ttft"], 50),
            "short_ttft_p99_ms": percentile(m["short_ttft"], 99), "long_ttft_p50_ms": percentile(m["long_ttft"], 50),
            "output_tok_s": m["tokens"] / m["seconds"], "long_requests": len(m["long_ttft"]),
            "failed": m["failed"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds per configuration")
    parser.add_argument("--warmup", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=4, help="short-request clients")
    parser.add_argument("--short-input", type=int, default=64)
    parser.add_argument("--short-output", type=int, default=96)
    parser.add_argument("--long-input", type=int, default=1500)
    parser.add_argument("--long-output", type=int, default=8)
    parser.add_argument("--long-every", type=float, default=8.0, help="seconds between long prompts")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.model)
    shorts = build_workload(DatasetConfig(name="random", num_prompts=64, random_input_len=args.short_input,
                                          random_output_len=args.short_output, seed=3), tokenizer)
    longs = build_workload(DatasetConfig(name="random", num_prompts=16, random_input_len=args.long_input,
                                         random_output_len=args.long_output, seed=4), tokenizer)
    log_dir = Path(tempfile.mkdtemp(prefix="pd_bench_"))
    print(f"logs in {log_dir}", flush=True)
    model = [args.model] if args.model else []
    common = ["--num-kv-blocks", "2048", "--disable-log-requests", "--max-num-batched-tokens", "512"]
    rows = []

    worker = Process(["serve", *model, "--num-threads", "2", *common], log_dir, "colocated").wait("/health")
    try:
        rows.append(summary("colocated (1 worker x 2 threads)", asyncio.run(drive(worker.url, shorts, longs, args))))
    finally:
        worker.stop()
    print(rows[-1], flush=True)

    producer = Process(["serve", *model, "--num-threads", "1", *common, "--kv-transfer-config",
                        json.dumps({"kv_role": "kv_producer"})], log_dir, "prefill")
    consumer = Process(["serve", *model, "--num-threads", "1", *common, "--kv-transfer-config",
                        json.dumps({"kv_role": "kv_consumer"})], log_dir, "decode")
    router = None
    try:
        producer.wait("/health")
        consumer.wait("/health")
        router = Process(["router", "--pd-disaggregation", "--prefill", producer.url, "--decode", consumer.url],
                         log_dir, "router").wait("/health", timeout=60)
        row = summary("disaggregated (1P + 1D x 1 thread)", asyncio.run(drive(router.url, shorts, longs, args)))
        status = httpx.get(f"{consumer.url}/debug/status", timeout=30).json()["kv_transfer"]
        n = max(1, status["remote_prefill_requests"])
        row.update(kv_mib_per_request=status["bytes_received"] / n / 2**20,
                   transfer_ms_per_request=status["transfer_seconds"] / n * 1e3,
                   remote_prefill_requests=status["remote_prefill_requests"], local_fallbacks=status["local_fallbacks"])
        rows.append(row)
    finally:
        if router is not None:
            router.stop()
        producer.stop()
        consumer.stop()
    print(rows[-1], flush=True)

    print()
    print("| configuration | short ITL p50 ms | short ITL p99 ms | short TTFT p50 ms | short TTFT p99 ms | "
          "long TTFT p50 ms | output tok/s | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['configuration']} | {r['short_itl_p50_ms']:.1f} | {r['short_itl_p99_ms']:.1f} | "
              f"{r['short_ttft_p50_ms']:.0f} | {r['short_ttft_p99_ms']:.0f} | {r['long_ttft_p50_ms']:.0f} | "
              f"{r['output_tok_s']:.1f} | {r['failed']} |")
    d = rows[-1]
    print(f"\nITL p99 ratio colocated / disaggregated: {rows[0]['short_itl_p99_ms'] / d['short_itl_p99_ms']:.2f}x; "
          f"KV moved {d['kv_mib_per_request']:.2f} MiB per request, {d['transfer_ms_per_request']:.1f} ms per "
          f"transfer, {d['remote_prefill_requests']} remote prefills, fallbacks {d['local_fallbacks']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
