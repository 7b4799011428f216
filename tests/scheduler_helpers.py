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
