"""``bench offline``: the workload through an in-process ``LLM`` (no HTTP), timed from ``RequestOutput.metrics``.

Every request is greedy with ``ignore_eos`` so each generates exactly its target length. All
requests of a round are queued at once (multi-turn conversations advance one round per turn,
each turn rendered with the chat template over the history and previous answers). TTFT is
first token - arrival (queueing included), E2EL finished - arrival; there is no per-token ITL.
Requests that cannot fit ``max_model_len`` are recorded as failed instead of aborting the run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.metrics import BenchmarkMetrics, RequestResult, calculate_metrics
from tokenmill.bench.workload import Conversation


@dataclass
class OfflineRun:
    """Results in workload order (conversation-major), the generate wall time and the metrics."""

    results: list[RequestResult]
    duration_s: float
    metrics: BenchmarkMetrics


def _result_of(output: Any, run_start: float) -> RequestResult:
    """A RequestResult from a finished RequestOutput (times are ``time.monotonic`` seconds)."""
    m = output.metrics
    arrival = m["arrival_time"]
    return RequestResult(
        success=True,
        prompt_len=len(output.prompt_token_ids),
        output_len=len(output.outputs[0].token_ids),
        ttft=m["first_token_time"] - arrival,
        e2el=m["finished_time"] - arrival,
        start_time=arrival - run_start,
    )


def run_offline(llm: Any, workload: list[Conversation], use_tqdm: bool = True) -> OfflineRun:
    """Run ``workload`` on ``llm`` (a ``tokenmill.LLM``) round by round; returns the timed results."""
    from tokenmill.sampling_params import SamplingParams

    max_model_len = llm.engine.max_model_len
    chat = any(c.is_multi_turn for c in workload)
    histories: list[list[dict[str, str]]] = [[] for _ in workload]
    results: list[list[RequestResult]] = [[] for _ in workload]
    alive = [True] * len(workload)
    run_start = time.monotonic()
    wall = 0.0
    for turn_index in range(max(len(c.turns) for c in workload)):
        batch: list[tuple[int, list[int], int]] = []  # (conversation index, prompt ids, max tokens)
        for i, conv in enumerate(workload):
            if turn_index >= len(conv.turns):
                continue
            turn = conv.turns[turn_index]
            if not alive[i]:
                results[i].append(RequestResult(False, error="not sent: an earlier turn of this conversation failed"))
                continue
            if chat:
                histories[i].append({"role": "user", "content": turn.prompt})
                ids = llm.apply_chat_template(histories[i])
            else:
                ids = list(turn.prompt_token_ids)
            if len(ids) + turn.expected_output_len > max_model_len:
                alive[i] = False
                results[i].append(RequestResult(False, prompt_len=len(ids), error=(
                    f"prompt ({len(ids)}) + max_tokens ({turn.expected_output_len}) exceeds max_model_len "
                    f"({max_model_len})")))
                continue
            batch.append((i, ids, turn.expected_output_len))
        if not batch:
            continue
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, _, n in batch]
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for _, ids, _ in batch], params, use_tqdm=use_tqdm)
        wall += time.perf_counter() - start
        for (i, _, _), output in zip(batch, outputs):
            results[i].append(_result_of(output, run_start))
            if chat:
                histories[i].append({"role": "assistant", "content": output.outputs[0].text})
    flat = [r for conv in results for r in conv]
    duration = max(wall, 1e-9)
    return OfflineRun(flat, duration, calculate_metrics(flat, duration))


def generate_sampled(llm: Any, requests: list) -> dict[str, float]:
    """Generate sampled dataset requests (``SampledRequest``s) greedily with ``ignore_eos`` in one
    ``llm.generate`` call, each to its ``expected_output_len``.

    Returns {"prompt_tokens", "output_tokens", "wall_s" (seconds of the generate call),
    "output_tok_s"}.
    """
    from tokenmill.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.expected_output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"prompt_tokens": sum(len(r.prompt_token_ids) for r in requests), "output_tokens": out_tokens,
            "wall_s": wall, "output_tok_s": out_tokens / wall}
