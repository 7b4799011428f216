"""``bench serve`` load generation: Poisson arrivals, a concurrency cap, multi-turn chains, warm-ups, token counting.

Conversations arrive at ``request_rate`` (exponential gaps, seeded; ``inf`` sends all at once)
and at most ``max_concurrency`` run at a time; a conversation's turns are sent one after
another with the answers appended to the history. Token counts come from the server's usage,
else from the client tokenizer after the run (never on the event loop while timing).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from dataclasses import dataclass, replace
from typing import Any

from tqdm import tqdm

from tokenmill.bench.metrics import BenchmarkMetrics, RequestResult, calculate_metrics
from tokenmill.bench.serve_client import ClientConfig, Reply, send_request
from tokenmill.bench.workload import Conversation

logger = logging.getLogger(__name__)

NOT_SENT = "not sent: an earlier turn of this conversation failed"


@dataclass(frozen=True)
class LoadConfig:
    """How the workload is offered to the server.

    Args:
        request_rate: conversations started per second (Poisson); ``math.inf`` starts all at once.
        max_concurrency: most conversations in flight at once (None: no cap).
        num_warmups: untimed requests sent first (the first turns of the first conversations).
        seed: arrival-time seed.
        disable_tqdm: no progress bar.
    """

    request_rate: float = math.inf
    max_concurrency: int | None = None
    num_warmups: int = 0
    seed: int = 0
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")


@dataclass
class ServeRun:
    """One timed run: per-request results (conversation-major order), its duration and metrics."""

    results: list[RequestResult]
    duration_s: float
    metrics: BenchmarkMetrics
    usage_source: str  # "server", "tokenizer" or "mixed": where token counts came from
    max_concurrency: int | None


def arrival_gaps(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each conversation: 0 first, then exponential gaps of mean 1/rate (0 at inf)."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(request_rate) for _ in range(num - 1)]


def chat_prompt_len(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    """Tokens of ``messages`` rendered with the tokenizer's chat template (plain concatenation without one)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer.encode(text, add_special_tokens=False))
    return sum(len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in messages)


class _Pending:
    """A finished request waiting for token counts: its reply and what was sent."""

    def __init__(self, reply: Reply, sent: str | list[int] | list[dict[str, str]], client_prompt_len: int) -> None:
        self.reply = reply
        self.sent = sent
        self.client_prompt_len = client_prompt_len


def _count_tokens(pending: list[_Pending], tokenizer: Any) -> tuple[list[RequestResult], str]:
    """Fill prompt/output lengths (server usage first, else the tokenizer); returns results and the source."""
    sources = set()
    for p in pending:
        r = p.reply.result
        if not r.success:
            continue
        if p.reply.usage_completion_tokens is not None:
            r.output_len = p.reply.usage_completion_tokens
            sources.add("server")
        else:
            r.output_len = len(tokenizer.encode(p.reply.text, add_special_tokens=False))
            sources.add("tokenizer")
        if p.reply.usage_prompt_tokens is not None:
            r.prompt_len = p.reply.usage_prompt_tokens
        elif isinstance(p.sent, list) and p.sent and isinstance(p.sent[0], dict):
            r.prompt_len = chat_prompt_len(tokenizer, p.sent)
        else:
            r.prompt_len = p.client_prompt_len
    source = "mixed" if len(sources) > 1 else (sources.pop() if sources else "none")
    return [p.reply.result for p in pending], source


async def _run_conversation(client: Any, config: ClientConfig, conv: Conversation, run_start: float,
                            bar: tqdm) -> list[_Pending]:
    """Send a conversation's turns in order; after a failed turn the rest are recorded as not sent."""
    messages: list[dict[str, str]] = []
    done: list[_Pending] = []
    for turn in conv.turns:
        if done and not done[-1].reply.result.success:
            skipped = RequestResult(False, start_time=time.perf_counter() - run_start, error=NOT_SENT)
            done.append(_Pending(Reply(skipped), turn.prompt, turn.prompt_len))
            bar.update(1)
            continue
        if config.endpoint == "chat":
            messages.append({"role": "user", "content": turn.prompt})
            sent: str | list[int] | list[dict[str, str]] = list(messages)
        elif config.send_token_ids and turn.prompt_token_ids:
            sent = list(turn.prompt_token_ids)
        else:
            sent = turn.prompt
        reply = await send_request(client, config, sent, turn.expected_output_len, run_start)
        messages.append({"role": "assistant", "content": reply.text})
        done.append(_Pending(reply, sent, turn.prompt_len))
        bar.update(1)
    return done


async def _offer(client: Any, config: ClientConfig, load: LoadConfig, workload: list[Conversation],
                 desc: str) -> tuple[list[_Pending], float]:
    """Offer ``workload`` under ``load``; returns the pending results (workload order) and the duration."""
    semaphore = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    bar = tqdm(total=sum(len(c.turns) for c in workload), desc=desc, disable=load.disable_tqdm)
    run_start = time.perf_counter()

    async def limited(conv: Conversation) -> list[_Pending]:
        async with semaphore if semaphore else contextlib.nullcontext():
            return await _run_conversation(client, config, conv, run_start, bar)

    tasks = []
    for conv, gap in zip(workload, arrival_gaps(len(workload), load.request_rate, load.seed)):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(limited(conv)))
    per_conv = await asyncio.gather(*tasks)
    duration = time.perf_counter() - run_start
    bar.close()
    return [p for conv in per_conv for p in conv], duration


async def run_serve_benchmark(client: Any, config: ClientConfig, load: LoadConfig, workload: list[Conversation],
                              tokenizer: Any) -> ServeRun:
    """Warm up, then run the timed benchmark and compute its metrics.

    Raises:
        ValueError: a multi-turn workload on the completions endpoint, or an empty workload.
    """
    if not workload:
        raise ValueError("num_prompts: the workload is empty")
    if config.endpoint != "chat" and any(c.is_multi_turn for c in workload):
        raise ValueError("endpoint: multi-turn conversations need --endpoint chat")
    if load.num_warmups:
        firsts = [Conversation(workload[i % len(workload)].turns[:1]) for i in range(load.num_warmups)]
        warm, _ = await _offer(client, config, replace(load, request_rate=math.inf), firsts, "warmup")
        failed = sum(not p.reply.result.success for p in warm)
        logger.info("warm-up: %d requests, %d failed", len(warm), failed)
    pending, duration = await _offer(client, config, load, workload, "benchmark")
    results, source = _count_tokens(pending, tokenizer)
    return ServeRun(results, duration, calculate_metrics(results, duration), source, load.max_concurrency)
