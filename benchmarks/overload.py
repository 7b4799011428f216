"""Overload: one ``tokenmill serve`` (embedded SmolLM2 GGUF) offered 10× the request rate it can sustain,
with a waiting-queue limit (``--max-queued-requests``), for ``--duration`` seconds (issue 44, item 2).

1. Calibration: ShareGPT prompts (up to ``--max-prompt-len`` tokens, exactly ``--output-len`` tokens each,
   greedy, ``ignore_eos``) sent closed-loop with ``--max-num-seqs`` in flight, so every engine slot stays
   busy: the completed requests per second is the sustainable rate, their p99 E2EL the service time
   (``--sustainable-rate`` skips this and then needs ``--service-time``).
2. Overload: Poisson arrivals at ``--overload-factor`` (10) × that rate, the same prompts in turn, each a
   streamed completions request (``tokenmill.bench.serve_client``), while the server's resident memory is
   sampled every second (psutil) and ``/health`` is polled every 0.5 s from a separate process.
3. After the last reply: the server must go idle with every KV block free and the pool's integrity check ok.

Goals (exit 1 if one fails, each printed with its measured value):
- every accepted request completes: an answer other than 200 or 503, a broken stream, an error event or
  a timeout is a lost request, and 0 are allowed; and some requests were refused (else no overload);
- accepted requests' p99 TTFT ≤ the bound ``(ceil(Q / S) + 1) × service time × --ttft-slack`` (Q queued
  sequences at most, S running: a request admitted behind Q others starts after about ceil(Q / S) of
  them finish in each slot, then runs its own prefill); without the limit TTFT grows with the run;
- resident memory stays under ``--rss-ceiling-mib`` (default: 1.25 × the server's after calibration, once
  idle with its KV pool faulted in);
- ``/health`` answers 200 within ``--health-limit-ms`` (100) every time.

    .venv/bin/python benchmarks/overload.py [--duration 120] [--max-num-seqs 8] [--max-queued-requests 16]
        [--output-json benchmarks/out/overload.json]

Client and server share the machine: on 2 cores the load generator's CPU (aiohttp, one connection per
request) is taken from the server; run it on a quiet machine for figures to keep.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_process import HealthPoller, ServerProcess, percentile  # noqa: E402

from tokenmill.bench.datasets import sample_sharegpt  # noqa: E402
from tokenmill.bench.serve_client import ClientConfig, Reply, make_client, send_request  # noqa: E402
from tokenmill.bench.workload import load_tokenizer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of overload (default 120)")
    p.add_argument("--overload-factor", type=float, default=10.0, help="offered rate ÷ sustainable rate (default 10)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="the server's running sequences (default 8)")
    p.add_argument("--max-queued-requests", type=int, default=16, help="the server's waiting-queue limit (default 16)")
    p.add_argument("--num-threads", type=int, default=None, help="the server's --num-threads (default: its own)")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--max-prompt-len", type=int, default=256, help="longest ShareGPT prompt in tokens (default 256)")
    p.add_argument("--num-prompts", type=int, default=200, help="distinct prompts, sent in turn (default 200)")
    p.add_argument("--calibration-requests", type=int, default=None,
                   help="requests of the calibration (default 4 × --max-num-seqs)")
    p.add_argument("--sustainable-rate", type=float, default=None,
                   help="requests/s the server sustains (skips calibration; needs --service-time)")
    p.add_argument("--service-time", type=float, default=None, help="seconds one request takes at full load")
    p.add_argument("--ttft-slack", type=float, default=2.0, help="factor on the TTFT bound (default 2)")
    p.add_argument("--rss-ceiling-mib", type=float, default=None,
                   help="resident memory ceiling (default 1.25 × the server's after calibration)")
    p.add_argument("--health-limit-ms", type=float, default=100.0, help="slowest /health allowed (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", type=Path, default=None)
    args = p.parse_args(argv)
    if (args.sustainable_rate is None) != (args.service_time is None):
        p.error("--sustainable-rate and --service-time go together")
    return args


async def calibrate(config: ClientConfig, prompts: list[str], args: argparse.Namespace) -> tuple[float, float]:
    """Closed loop with ``max_num_seqs`` in flight; returns (completed requests per second, p99 E2EL in s).

    Raises:
        RuntimeError: a calibration request failed.
    """
    total = args.calibration_requests or 4 * args.max_num_seqs
    queue = list(range(total))
    replies: list[Reply] = []

    async with make_client(config) as client:
        await send_request(client, config, prompts[0], args.output_len, time.perf_counter())  # warm-up

        async def worker() -> None:
            while queue:
                i = queue.pop()
                replies.append(await send_request(client, config, prompts[i % len(prompts)], args.output_len, start))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.max_num_seqs)))
        elapsed = time.perf_counter() - start
    failed = [r.result.error for r in replies if not r.result.success]
    if failed:
        raise RuntimeError(f"{len(failed)} calibration requests failed, e.g. {failed[0]}")
    return total / elapsed, percentile([r.result.e2el for r in replies], 99)


async def overload(config: ClientConfig, server: ServerProcess, prompts: list[str], rate: float,
                   args: argparse.Namespace) -> tuple[list[Reply], list[tuple[float, float]], float]:
    """Poisson arrivals at ``rate`` for ``args.duration`` s; returns (replies, RSS samples (t, MiB), seconds taken)."""
    rng = random.Random(args.seed)
    rss: list[tuple[float, float]] = []
    tasks: list[asyncio.Task] = []

    async def sample_rss(stop: asyncio.Event) -> None:
        while not stop.is_set():
            rss.append((time.perf_counter() - start, server.resources()["rss_mib"]))
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass

    async with make_client(config) as client:
        start = time.perf_counter()
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_rss(stop))
        next_at = 0.0
        i = 0
        while next_at < args.duration:
            delay = start + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send_request(client, config, prompts[i % len(prompts)],
                                                          args.output_len, start)))
            i += 1
            next_at += rng.expovariate(rate)
        replies = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        stop.set()
        await sampler
    return list(replies), rss, elapsed


def ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds rounded to 0.1 (None stays None)."""
    return None if seconds is None else round(seconds * 1000, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = load_tokenizer(None)
    requests = sample_sharegpt(tokenizer, args.num_prompts, args.seed, max_prompt_len=args.max_prompt_len,
                               max_total_len=args.max_prompt_len + args.output_len, fixed_output_len=args.output_len)
    prompts = [r.prompt for r in requests]
    log_dir = Path(tempfile.mkdtemp(prefix="tokenmill-overload-"))
    server_args = ["--max-num-seqs", str(args.max_num_seqs), "--max-queued-requests", str(args.max_queued_requests),
                   "--max-model-len", "2048", "--disable-log-requests",
                   *(["--num-threads", str(args.num_threads)] if args.num_threads else [])]
    server = ServerProcess(server_args, log_dir / "server.log")
    try:
        server.wait_healthy()
        config = ClientConfig(base_url=server.url, endpoint="completions", ignore_eos=True, timeout_s=600.0)
        if args.sustainable_rate is None:
            rate, service_time = asyncio.run(calibrate(config, prompts, args))
        else:
            rate, service_time = args.sustainable_rate, args.service_time
        server.wait_idle()
        rss_start = server.settled_rss_mib()  # the KV pool's pages faulted in: what is left to grow is growth
        ceiling = args.rss_ceiling_mib or 1.25 * rss_start
        offered = args.overload_factor * rate
        print(f"sustainable rate {rate:.2f} req/s (service time p99 {service_time:.2f} s); offering {offered:.2f} "
              f"req/s for {args.duration:g} s; server RSS {rss_start:.0f} MiB", flush=True)

        poller = HealthPoller(server.url, 0.5).start()
        time.sleep(1.0)  # the poller's process is up before the load starts
        try:
            replies, rss, elapsed = asyncio.run(overload(config, server, prompts, offered, args))
        finally:
            health = poller.stop()
        kv = server.wait_idle()
    finally:
        exit_code = server.stop()

    rejected = [r for r in replies if r.result.error.startswith("HTTP 503")]
    accepted = [r for r in replies if not r.result.error.startswith("HTTP 503")]
    lost = [r for r in accepted if not r.result.success]
    ttfts = [r.result.ttft for r in accepted if r.result.success]
    half = args.duration / 2
    ttft_first = [r.result.ttft for r in accepted if r.result.success and r.result.start_time < half]
    ttft_second = [r.result.ttft for r in accepted if r.result.success and r.result.start_time >= half]
    ttft_bound = (math.ceil(args.max_queued_requests / args.max_num_seqs) + 1) * service_time * args.ttft_slack
    health_latencies = [latency for _, latency, _ in health]
    health_bad = [s for s in health if s[2] != 200]
    rss_max = max((m for _, m in rss), default=rss_start)
    result = {
        "duration_s": args.duration, "elapsed_s": elapsed, "sustainable_rate": rate, "service_time_s": service_time,
        "offered_rate": offered, "max_num_seqs": args.max_num_seqs, "max_queued_requests": args.max_queued_requests,
        "sent": len(replies), "accepted": len(accepted), "rejected_503": len(rejected), "lost": len(lost),
        "lost_errors": sorted({r.result.error[:200] for r in lost})[:5],
        "accepted_throughput": (len(accepted) - len(lost)) / elapsed,
        "ttft_p50_ms": ms(percentile(ttfts, 50)), "ttft_p99_ms": ms(percentile(ttfts, 99)),
        "ttft_p99_first_half_ms": ms(percentile(ttft_first, 99)),
        "ttft_p99_second_half_ms": ms(percentile(ttft_second, 99)), "ttft_bound_ms": ms(ttft_bound),
        "rss_start_mib": rss_start, "rss_max_mib": rss_max, "rss_ceiling_mib": ceiling,
        "health_probes": len(health), "health_not_200": len(health_bad),
        "health_p50_ms": ms(percentile(health_latencies, 50)), "health_p99_ms": ms(percentile(health_latencies, 99)),
        "health_max_ms": ms(max(health_latencies, default=None)),
        "idle_after": {k: kv[k] for k in ("num_running", "num_waiting", "num_free_blocks", "num_blocks", "integrity")},
        "server_exit_code": exit_code,
    }
    goals = {
        "0 accepted requests lost": not lost,
        "requests refused with 503 (the server was overloaded)": bool(rejected),
        f"accepted p99 TTFT ≤ {ms(ttft_bound)} ms": bool(ttfts) and percentile(ttfts, 99) <= ttft_bound,
        f"RSS ≤ {ceiling:.0f} MiB": rss_max <= ceiling,
        f"/health 200 within {args.health_limit_ms:g} ms": bool(health) and not health_bad
        and max(health_latencies) * 1000 < args.health_limit_ms,
        "idle afterwards with every KV block free, integrity ok": kv["num_running"] == 0 and kv["num_waiting"] == 0
        and kv["num_free_blocks"] == kv["num_blocks"] and kv["integrity"] == "ok",
        "server exits 0 on SIGTERM": exit_code == 0,
    }
    result["goals"] = goals
    print(json.dumps(result, indent=2))
    for goal, met in goals.items():
        print(f"{'PASS' if met else 'FAIL'}  {goal}")
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps({**result, "health_samples": health, "rss_samples": rss}, indent=1))
    if not all(goals.values()):
        print(f"server log: {server.log_path}")
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
