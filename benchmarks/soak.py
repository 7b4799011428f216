"""Soak: one ``tokenmill serve`` (embedded SmolLM2 GGUF) under a mixed workload for ``--duration`` seconds
(default 600; the issue's hour is ``--duration 3600``), checked for slow leaks (issue 44, item 6).

The server runs every feature at once: prefix caching, a RAM and a disk KV tier below a small pool (so
blocks are evicted down and hit back up), two LoRA adapters (rank 4, written by peft for the model's
shapes into a temporary directory), structured outputs and n-gram speculative decoding. Closed-loop
clients (``--concurrency``) draw each request's kind at random:

- ``prefix``: one of four long shared system prompts + a short question (prefix hits; tier hits once evicted);
- ``sharegpt``: a ShareGPT prompt (churns the pool, pushing blocks into the tiers);
- ``lora``: a prefixed prompt through adapter ``soak-a`` or ``soak-b``;
- ``json``: chat with ``response_format`` ``json_schema``;
- ``repeat``: a prompt that repeats itself (n-gram drafts get accepted);
- ``cancel``: streamed, dropped after two chunks (a client disconnect mid-stream);
- ``abort``: dropped after 50-300 ms, often before the first token (a disconnect while queued or prefilling).

Every ``--sample-interval`` (30) seconds the clients pause, the server goes idle, and a sample is taken with
psutil on the server's pid (resident memory, open descriptors, threads) and ``/debug/kv_cache`` (blocks in use,
the pool's integrity check; blocks that only hold prefix cache sit in the free list, so at idle 0 are in use),
with the window's p50 / p99 TTFT and E2EL of the completed requests (cancels and aborts excluded) and the
tiers', adapters' and speculation's counters from ``/debug/status``. After warm-up (the first 20% of the run)
the goals are (exit 1 if one fails):

- resident memory: the median of the last 3 samples ≤ 1.02 × the median of the first 3 after warm-up;
- 0 blocks in use and integrity ``ok`` at every idle sample;
- descriptors and threads flat: the last sample ≤ the most of the first 3 after warm-up;
- p99 latency flat: the median of the last 3 windows' p99 E2EL ≤ 1.5 × that of the first 3 after warm-up
  (medians of 3 windows, since one window's p99 on a shared machine jumps by itself);
- no request other than cancels and aborts fails.

Samples go to ``--output-json`` (default benchmarks/out/soak.json) and a plot to ``--plot``
(benchmarks/out/soak.png). A router is not part of this run (benchmarks/chaos.py covers one).

    .venv/bin/python benchmarks/soak.py [--duration 600] [--concurrency 6]
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
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402
import httpx2 as httpx  # noqa: E402
from server_process import ServerProcess, percentile  # noqa: E402

from tokenmill.bench.datasets import sample_sharegpt  # noqa: E402
from tokenmill.bench.workload import load_tokenizer  # noqa: E402

KINDS = {"prefix": 3, "sharegpt": 2, "lora": 2, "json": 1, "repeat": 1, "cancel": 1, "abort": 1}
ADAPTERS = ("soak-a", "soak-b")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'
STATUS_COUNTERS = ("prefix_cache_hits", "kv_offload", "spec_decode", "lora", "num_preemptions", "request_success")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--sample-interval", type=float, default=30.0, help="seconds between samples (default 30)")
    p.add_argument("--warmup-fraction", type=float, default=0.2, help="share of the run before goals apply (0.2)")
    p.add_argument("--concurrency", type=int, default=6, help="closed-loop clients (default 6)")
    p.add_argument("--num-threads", type=int, default=None, help="the server's --num-threads (default: its own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", type=Path, default=REPO / "benchmarks" / "out" / "soak.json")
    p.add_argument("--plot", type=Path, default=REPO / "benchmarks" / "out" / "soak.png")
    return p.parse_args(argv)


def write_adapters(root: Path) -> dict[str, str]:
    """Two rank-4 adapters (random A and B) for the embedded model's shapes, saved by peft under ``root``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tokenmill.models.default_model import default_model_path
    from tokenmill.models.gguf_loader import gguf_to_hf_config, open_gguf

    config = gguf_to_hf_config(open_gguf(default_model_path()))
    paths = {}
    for seed, name in enumerate(ADAPTERS):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # only the shapes matter
        peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
        peft.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


@dataclass
class Window:
    """What the clients saw between two samples."""

    ttft: list[float] = field(default_factory=list)
    e2el: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


class Workload:
    """Builds request bodies of each kind and sends them (aiohttp; one connection per request)."""

    def __init__(self, url: str, model: str, seed: int) -> None:
        tokenizer = load_tokenizer(None)
        self.url = url
        self.model = model
        self.rng = random.Random(seed)
        sharegpt = sample_sharegpt(tokenizer, 300, seed, max_prompt_len=384, max_total_len=448, fixed_output_len=32)
        self.sharegpt = [r.prompt for r in sharegpt]
        self.prefixes = [" ".join(r.prompt for r in sharegpt[i * 3:(i + 1) * 3])[:2000] for i in range(4)]

    def body(self, kind: str) -> tuple[str, dict]:
        rng = self.rng
        question = rng.choice(self.sharegpt)[:200]
        if kind in ("prefix", "lora", "cancel", "abort"):
            prompt = f"{rng.choice(self.prefixes)}\n\nQuestion: {question}\nAnswer:"
        elif kind == "repeat":
            line = question[:120]
            prompt = f"Copy the text three times.\n{line}\n{line}\n{line}\n"
        else:
            prompt = rng.choice(self.sharegpt)
        if kind == "json":
            return "/v1/chat/completions", {
                "model": self.model, "messages": [{"role": "user", "content": f"Make up a person. {question}"}],
                "max_tokens": 48, "temperature": 0.7, "stream": True,
                "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
        model = rng.choice(ADAPTERS) if kind == "lora" else self.model
        return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 32, "stream": True,
                                   "temperature": rng.choice([0.0, 0.8]), "ignore_eos": kind != "repeat"}

    async def send(self, session: aiohttp.ClientSession, window: Window) -> None:
        kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        path, body = self.body(kind)
        start = time.perf_counter()
        ttft = None
        try:
            async with asyncio.timeout(self.rng.uniform(0.05, 0.3) if kind == "abort" else 600):
                async with session.post(self.url + path, json=body) as response:
                    if response.status != 200:
                        window.errors.append(f"{kind}: HTTP {response.status} {(await response.text())[:200]}")
                        window.count("failed")
                        return
                    chunks = 0
                    async for line in response.content:
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            window.errors.append(f"{kind}: stream error {chunk['error']}")
                            window.count("failed")
                            return
                        chunks += 1
                        if ttft is None and chunk.get("choices"):
                            ttft = time.perf_counter() - start
                        if kind == "cancel" and chunks >= 2:
                            window.count("cancelled")
                            return  # leaving the block closes the connection mid-stream
        except TimeoutError:
            if kind == "abort":
                window.count("aborted")
                return
            window.errors.append(f"{kind}: timed out")
            window.count("failed")
            return
        except aiohttp.ClientError as exc:
            window.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
            window.count("failed")
            return
        window.count(kind)
        if ttft is not None:
            window.ttft.append(ttft)
        window.e2el.append(time.perf_counter() - start)


async def run_window(workload: Workload, concurrency: int, seconds: float) -> Window:
    """``concurrency`` closed-loop clients for ``seconds``; in-flight requests finish before it returns."""
    window = Window()
    end = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        async def client() -> None:
            while time.monotonic() < end:
                await workload.send(session, window)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return window


def status_counters(url: str) -> dict:
    """The /debug/status metrics whose names mention the tiers, prefix cache, adapters or speculation."""
    metrics = httpx.get(f"{url}/debug/status", params={"check_integrity": "false"}, timeout=60).json()["metrics"]
    return {k: v for k, v in metrics.items() if any(s in k for s in STATUS_COUNTERS)}


def sample(server: ServerProcess, t: float, window: Window) -> dict:
    """One idle sample: the server's resources, its KV pool and the window's latencies (ms)."""
    kv = server.wait_idle()
    return {
        "t_s": round(t, 1), **server.resources(),
        "blocks_in_use": kv["num_blocks"] - kv["num_free_blocks"], "num_blocks": kv["num_blocks"],
        "integrity": kv["integrity"], "num_running": kv["num_running"], "num_waiting": kv["num_waiting"],
        "ttft_p50_ms": _ms(percentile(window.ttft, 50)), "ttft_p99_ms": _ms(percentile(window.ttft, 99)),
        "e2el_p50_ms": _ms(percentile(window.e2el, 50)), "e2el_p99_ms": _ms(percentile(window.e2el, 99)),
        "requests": window.counts, "errors": window.errors[:5], "counters": status_counters(server.url),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def judge(samples: list[dict], warmup_s: float) -> dict[str, bool]:
    """The goals over the samples taken after ``warmup_s`` (every sample for blocks and failures)."""
    post = [s for s in samples if s["t_s"] >= warmup_s] or samples[-1:]
    first, last = post[:3], post[-3:]

    def median(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows if r[key] is not None)

    rss_growth = median(last, "rss_mib") / median(first, "rss_mib") - 1
    p99_ratio = median(last, "e2el_p99_ms") / median(first, "e2el_p99_ms")
    return {
        f"RSS growth after warm-up {rss_growth:+.2%} < 2%": rss_growth < 0.02,
        "0 KV blocks in use at every idle sample, integrity ok": all(
            s["blocks_in_use"] == 0 and s["integrity"] == "ok" for s in samples),
        f"open fds flat ({first[0]['num_fds']} -> {post[-1]['num_fds']})":
            post[-1]["num_fds"] <= max(s["num_fds"] for s in first),
        f"threads flat ({first[0]['num_threads']} -> {post[-1]['num_threads']})":
            post[-1]["num_threads"] <= max(s["num_threads"] for s in first),
        f"p99 E2EL flat (last / first after warm-up = {p99_ratio:.2f} ≤ 1.5)": p99_ratio <= 1.5,
        "no request failed (cancels and aborts aside)": all(not s["requests"].get("failed") for s in samples),
    }


def plot(samples: list[dict], warmup_s: float, path: Path) -> None:
    """Six panels over time: RSS, fds, threads, blocks in use at idle, p50/p99 latency, requests per window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] for s in samples]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), sharex=True)
    panels = [("rss_mib", "resident memory (MiB)"), ("num_fds", "open file descriptors"),
              ("num_threads", "threads"), ("blocks_in_use", "KV blocks in use at idle")]
    for ax, (key, title) in zip(axes.flat, panels):
        ax.plot(t, [s[key] for s in samples], marker="o")
        ax.set_title(title)
    ax = axes.flat[4]
    for key in ("ttft_p50_ms", "ttft_p99_ms", "e2el_p50_ms", "e2el_p99_ms"):
        ax.plot(t, [s[key] for s in samples], marker=".", label=key.removesuffix("_ms"))
    ax.set_title("window latency (ms)")
    ax.legend(fontsize=7)
    ax = axes.flat[5]
    ax.plot(t, [sum(s["requests"].values()) for s in samples], marker="o")
    ax.set_title("requests per window")
    for ax in axes.flat:
        ax.axvline(warmup_s, color="grey", linestyle=":")
        ax.set_xlabel("seconds")
    fig.suptitle("tokenmill soak (dotted line: end of warm-up)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="tokenmill-soak-"))
    adapters = write_adapters(root)
    server_args = ["--served-model-name", "smollm2", "--max-num-seqs", "8", "--num-kv-blocks", "512",
                   "--max-model-len", "2048", "--kv-offload-memory", "0.02", "--kv-offload-disk-path",
                   str(root / "kv"), "--kv-offload-disk-size", "0.25", "--enable-lora", "--max-loras", "2",
                   "--max-lora-rank", "8", "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()),
                   "--speculative-config", SPEC, "--disable-log-requests",
                   *(["--num-threads", str(args.num_threads)] if args.num_threads else [])]
    server = ServerProcess(server_args, root / "server.log")
    samples: list[dict] = []
    warmup_s = args.warmup_fraction * args.duration
    try:
        server.wait_healthy()
        workload = Workload(server.url, "smollm2", args.seed)
        start = time.monotonic()
        loaded = 0.0  # seconds of load so far (the idle pauses for sampling not counted)
        while loaded < args.duration - 1e-6:
            seconds = min(args.sample_interval, args.duration - loaded)
            window = asyncio.run(run_window(workload, args.concurrency, seconds))
            loaded += seconds
            samples.append(sample(server, loaded, window))
            s = samples[-1]
            print(f"t={loaded:5.0f}s (wall {time.monotonic() - start:5.0f}s) rss={s['rss_mib']:.0f}MiB "
                  f"fds={s['num_fds']} threads={s['num_threads']} blocks_in_use={s['blocks_in_use']} "
                  f"integrity={s['integrity']} e2el p50/p99={s['e2el_p50_ms']}/{s['e2el_p99_ms']}ms "
                  f"requests={s['requests']} {s['errors'] or ''}", flush=True)
    finally:
        exit_code = server.stop()
    goals = judge(samples, warmup_s)
    goals["server exits 0 on SIGTERM"] = exit_code == 0
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                            "server_args": server_args, "samples": samples, "goals": goals},
                                           indent=1))
    plot(samples, warmup_s, args.plot)
    print(f"counters at the end: {json.dumps(samples[-1]['counters'])}")
    for goal, met in goals.items():
        print(f"{'PASS' if met else 'FAIL'}  {goal}")
    print(f"samples: {args.output_json}; plot: {args.plot}; server log: {server.log_path}")
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
