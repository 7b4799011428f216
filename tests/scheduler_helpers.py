"""Helpers for CPU-only scheduler tests: requests without a model and hand-written runner outputs."""
from __future__ import annotations

from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import ModelRunnerOutput, SchedulerOutput

EOS = 2


def make_request(request_id: str, prompt: list[int] | int, max_tokens: int = 4, **params) -> Request:
    """A greedy request; ``prompt`` is token ids or a length (ids 10, 11, ...)."""
    token_ids = list(range(10, 10 + prompt)) if isinstance(prompt, int) else prompt
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params).with_defaults({})
    return Request(request_id, token_ids, sp, {EOS}, max_tokens)


def runner_output(out: SchedulerOutput, token: int | dict[str, int] = 7) -> ModelRunnerOutput:
    """What a runner returns: a token for each request whose scheduled tokens reach its end."""
    sampled = []
    for request, n in zip(out.scheduled_requests, out.num_scheduled_tokens):
        reaches_end = request.num_computed_tokens + n >= request.num_tokens
        tok = token.get(request.request_id, 7) if isinstance(token, dict) else token
        sampled.append(tok if reaches_end else None)
    return ModelRunnerOutput(sampled_token_ids=sampled)


def step(scheduler, token: int | dict[str, int] = 7) -> SchedulerOutput:
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, token))
    return out


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(out.scheduled_requests, out.num_scheduled_tokens)}


def block_value(block_hash: int) -> float:
    """What ``fake_forward`` writes into a block of this hash."""
    return float(block_hash % 1_000_003)


def fake_forward(out: SchedulerOutput, kv_cache, block_size: int) -> int:
    """A forward that checks and writes block contents instead of computing: every block a scheduled request
    already counts as computed (prefix hits from any tier included) must hold ``block_value(its hash)``, and each
    block this step completes gets it. ``kv_cache``: (layers, 2, blocks, block_size, ...) tensor. Returns the
    blocks checked."""
    checked = 0
    for request, num_new, block_ids in zip(out.scheduled_requests, out.num_scheduled_tokens, out.block_ids):
        start = request.num_computed_tokens
        for b in range(start // block_size):
            assert (kv_cache[:, :, block_ids[b]] == block_value(request.block_hashes[b])).all(), (request, b)
            checked += 1
        for b in range(start // block_size, (start + num_new) // block_size):
            kv_cache[:, :, block_ids[b]] = block_value(request.block_hashes[b])
    return checked
