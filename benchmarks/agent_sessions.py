"""Agent sessions benchmark: do agents find their KV again after a tool call? ``--agents`` multi-turn agent
sessions (each its own system prompt and growing history, an ``X-Session-Id``) wait ``--gap-min``–``--gap-max``
seconds between turns (a tool running), while ``--background`` clients send unrelated prompts back to back and
churn the KV pool. The same seeded run is served with plain LRU eviction (``--session-kv-ttl 0``) and with
sessions kept (``--session-kv-ttl``, default 120 s), alternated ``--repeats`` times.

Printed per run and summarised: for every turn after the first, the share of its prompt served from the prefix
cache (``usage.prompt_tokens_details.cached_tokens`` / ``prompt_tokens``) and its time to first token (p50 /
p90), and the background's output tokens per second (what keeping sessions costs the rest). The pool is sized
(``--kv-cache-memory``) to hold the agents' working set but not that and the background's churn over a gap.

Run on a quiet machine::

    .venv/bin/python benchmarks/agent_sessions.py                 # about 6 minutes on 2 cores
    .venv/bin/python benchmarks/agent_sessions.py --agents 8 --turns 3 --repeats 1
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_process import ServerProcess  # noqa: E402
VOCAB = ["river", "stone", "quiet", "market", "engine", "signal", "harbor", "lantern", "orbit", "meadow", "copper",
         "violet", "canyon", "ledger", "pilot", "glacier", "thimble", "saddle", "quartz", "willow"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def start_server(ttl: float, args: argparse.Namespace, log: Path) -> ServerProcess:
    """A healthy ``tokenmill serve`` with session TTL ``ttl`` and the run's pool (benchmarks/server_process.py)."""
    return ServerProcess(["--session-kv-ttl", str(ttl), "--kv-cache-memory", str(args.kv_cache_memory),
                          "--max-model-len", "4096", "--max-num-seqs", str(args.max_num_seqs)],
                         log, args.model).wait_healthy(300)


async def chat(client: httpx.AsyncClient, messages: list[dict], max_tokens: int, headers: dict) -> dict:
    """Stream one chat completion: {"ttft": s, "text": str, "prompt": n, "cached": n}."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, text, usage = time.perf_counter(), None, [], None
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                text.append(chunk["choices"][0]["delta"]["content"])
            usage = chunk.get("usage") or usage
    return {"ttft": ttft, "text": "".join(text), "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}


async def workload(url: str, args: argparse.Namespace) -> dict:
    later_turns: list[dict] = []
    background_tokens = 0
    done = asyncio.Event()

    async def agent(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        headers = {"X-Session-Id": f"agent-{args.seed}-{i}"}
        messages = [{"role": "system", "content": f"Agent {i}. " + words(rng, args.system_words)},
                    {"role": "user", "content": words(rng, 30)}]
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            await asyncio.sleep(rng.uniform(0, args.gap_min))  # agents start spread out
            for turn in range(args.turns):
                reply = await chat(client, messages, args.agent_max_tokens, headers)
                if turn:
                    later_turns.append(reply)
                messages += [{"role": "assistant", "content": reply["text"]},
                             {"role": "tool", "content": words(rng, args.tool_words)}]
                if turn + 1 < args.turns:
                    await asyncio.sleep(rng.uniform(args.gap_min, args.gap_max))

    async def background(i: int) -> None:
        nonlocal background_tokens
        rng = random.Random(args.seed * 7919 + i)
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            while not done.is_set():
                response = await client.post("/v1/completions", json={
                    "prompt": words(rng, args.background_words), "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True})
                response.raise_for_status()
                background_tokens += response.json()["usage"]["completion_tokens"]

    t0 = time.monotonic()
    workers = [asyncio.create_task(background(i)) for i in range(args.background)]
    await asyncio.gather(*(agent(i) for i in range(args.agents)))
    elapsed = time.monotonic() - t0
    done.set()
    await asyncio.gather(*workers)
    shares = [r["cached"] / r["prompt"] for r in later_turns]
    ttfts = sorted(r["ttft"] for r in later_turns)
    return {"turns": len(later_turns), "cached_share_mean": statistics.mean(shares),
            "ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
            "background_tok_s": background_tokens / elapsed, "elapsed_s": elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--gap-min", type=float, default=5.0)
    parser.add_argument("--gap-max", type=float, default=30.0)
    parser.add_argument("--system-words", type=int, default=220)
    parser.add_argument("--tool-words", type=int, default=60)
    parser.add_argument("--agent-max-tokens", type=int, default=24)
    parser.add_argument("--background", type=int, default=4, help="background clients")
    parser.add_argument("--background-words", type=int, default=350)
    parser.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB of KV pool")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--session-kv-ttl", type=float, default=120.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="tokenmill-agents-"))
    runs = []
    for r in range(args.repeats):
        for mode, ttl in (("lru", 0.0), ("sessions", args.session_kv_ttl)):
            server = start_server(ttl, args, logs / f"{mode}-{r}.log")
            try:
                run = {"mode": mode, **asyncio.run(workload(server.url, args))}
            finally:
                server.stop()
            runs.append(run)
            print(json.dumps(run), flush=True)

    def mean(mode: str, key: str) -> float:
        return statistics.mean(x[key] for x in runs if x["mode"] == mode)

    print(f"\n{'mode':<10}{'cached share':>14}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'background tok/s':>18}")
    for mode in ("lru", "sessions"):
        print(f"{mode:<10}{mean(mode, 'cached_share_mean'):>14.2f}{mean(mode, 'ttft_p50_ms'):>13.0f}"
              f"{mean(mode, 'ttft_p90_ms'):>13.0f}{mean(mode, 'background_tok_s'):>18.1f}")
    print(f"next-turn TTFT p50, lru / sessions: {mean('lru', 'ttft_p50_ms') / mean('sessions', 'ttft_p50_ms'):.2f}x; "
          f"background throughput kept: {mean('sessions', 'background_tok_s') / mean('lru', 'background_tok_s'):.2f}")
    if args.output:
        args.output.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
