"""Deterministic (batch-invariant) mode: a fixed request's token ids and log-probability bits are
identical whether it runs alone or among 1–32 random requests arriving at random steps, under
different chunk budgets, block sizes, pool sizes (preemption), thread counts and prefix-cache hits.

The same scenarios in default mode are recorded, not asserted: on this CPU, default mode's
bf16 results move with the batch (see docs/deterministic.md for the measured fact).
"""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from tests.server_fixtures import ServerProcess
from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams, csrc_build
from tokenmill.attention import cpu_decode
from tokenmill.layers import batch_invariant, silu_and_mul_kernel
from tokenmill.runner.deterministic import check_deterministic_supported, enable_batch_invariant

NUM_SCENARIOS = 8
TARGET_ID = "target"


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A bf16 tiny Llama wide enough (head_dim 64, GQA 2:1) for bf16 rounding to matter."""
    return str(
        make_tiny_model(
            "llama", tmp_path_factory.mktemp("wide_llama"), seed=11, hidden_size=256, intermediate_size=640,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05,
        )
    )


def target_prompt() -> list[int]:
    rng = random.Random(1234)
    return [rng.randrange(100, 40000) for _ in range(75)]


def fingerprint(output) -> list[tuple]:
    """Token ids plus the exact bits (float.hex) of every returned log-probability and rank."""
    completion = output.outputs[0]
    out = [tuple(completion.token_ids)]
    for position in completion.logprobs or []:
        out.append(tuple(sorted((tid, lp.logprob.hex(), lp.rank) for tid, lp in position.items())))
    for position in output.prompt_logprobs or []:
        if position is not None:
            out.append(tuple(sorted((tid, lp.logprob.hex(), lp.rank) for tid, lp in position.items())))
    return out


def run_scenario(path: str, deterministic: bool, scenario: int, target_params: SamplingParams) -> list[tuple]:
    """Run the target request in scenario ``scenario`` (0 = alone, fresh engine, whole-prompt prefill)."""
    rng = random.Random(scenario)
    alone = scenario == 0
    block_size = 16 if alone else rng.choice([4, 8, 16])
    llm = LLM(
        model=path, dtype="bfloat16", deterministic=deterministic, block_size=block_size,
        max_num_batched_tokens=512 if alone else rng.choice([7, 16, 33, 64, 200]),
        max_num_seqs=8 if alone else rng.choice([4, 9, 33]),
        num_kv_blocks=(4096 // block_size) if alone else rng.choice([200, 320, 4096]) // block_size,
        num_threads=2 if alone else rng.choice([1, 2]),
    )
    engine = llm.engine
    prompt = target_prompt()
    if not alone and rng.random() < 0.6:  # warm the prefix cache with part of the target's prompt
        cut = rng.randrange(block_size, len(prompt) - 1)
        engine.add_request("warm", {"prompt_token_ids": prompt[:cut]}, SamplingParams(temperature=0, max_tokens=3))
        while engine.has_unfinished_requests():
            engine.step()
    arrivals: dict[int, list[tuple[str, dict, SamplingParams]]] = {}
    num_others = 0 if alone else rng.randint(1, 32)
    for i in range(num_others):
        if rng.random() < 0.3:  # shares a prefix with the target: cache hits on both sides
            other = prompt[: rng.randrange(8, len(prompt))] + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 9))]
        else:
            other = [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 60))]
        params = SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randrange(1, 20), logprobs=rng.choice([None, 2]))
        arrivals.setdefault(rng.randrange(0, 12), []).append((f"other-{i}", {"prompt_token_ids": other}, params))
    target_step = 0 if alone else rng.randrange(0, 8)
    arrivals.setdefault(target_step, []).append((TARGET_ID, {"prompt_token_ids": prompt}, target_params))
    result = None
    step = 0
    while arrivals or engine.has_unfinished_requests():
        for request_id, request_prompt, params in arrivals.pop(step, []):
            engine.add_request(request_id, request_prompt, params)
        for output in engine.step():
            if output.request_id == TARGET_ID and output.finished:
                result = fingerprint(output)
        step += 1
    engine.check_integrity()
    assert result is not None
    return result


def diverging_scenarios(path: str, deterministic: bool, params: SamplingParams) -> list[int]:
    baseline = run_scenario(path, deterministic, 0, params)
    assert len(baseline[0]) == params.max_tokens
    return [s for s in range(1, NUM_SCENARIOS + 1) if run_scenario(path, deterministic, s, params) != baseline]


GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=24, logprobs=1, ignore_eos=True)
PROMPT_LOGPROBS = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED, PROMPT_LOGPROBS], ids=["greedy", "seeded_t1", "prompt_logprobs"])
def test_deterministic_mode_is_batch_invariant(wide_llama, params):
    assert diverging_scenarios(wide_llama, True, params) == []


@pytest.mark.parametrize("isa", ["portable"])
def test_deterministic_mode_is_batch_invariant_on_the_portable_path(wide_llama, isa, monkeypatch):
    """The portable path forced (the native one is the test above; each other path's kernels are
    checked for invariance in tests/test_batch_invariant_kernels.py and test_cpu_isa_paths.py): bits
    may differ between paths (docs/deterministic.md), never between batches on one path."""
    if not csrc_build.isa_supported(isa):
        pytest.skip(f"this CPU cannot run the {isa} path (missing: {', '.join(csrc_build.missing_cpu_flags(isa))})")
    if isa == csrc_build.selected_isa():
        pytest.skip(f"{isa} is this machine's own path, covered by test_deterministic_mode_is_batch_invariant")
    builds = {module: module._load(isa) for module in (batch_invariant, silu_and_mul_kernel, cpu_decode)}
    assert all(lib is not None for lib in builds.values())
    for module, lib in builds.items():
        monkeypatch.setattr(module.library, "built", lambda lib=lib: lib)
    assert batch_invariant.isa() == isa
    # A short run (the portable path is slow): the target alone, then again beside three other requests
    # under a 16-token chunk budget and with its prompt now a prefix-cache hit.
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    llm = LLM(model=wide_llama, dtype="bfloat16", deterministic=True, max_num_batched_tokens=16, num_kv_blocks=128)
    rng = random.Random(5)
    target = {"prompt_token_ids": target_prompt()}
    alone = fingerprint(llm.generate(target, params, use_tqdm=False)[0])
    others = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(5, 30))]} for _ in range(3)]
    batched = llm.generate([others[0], target, *others[1:]], params, use_tqdm=False)
    assert fingerprint(batched[1]) == alone
    llm.engine.check_integrity()


def test_deterministic_fp32_agrees_with_default_mode(tmp_path):
    """The batch-invariant kernels compute the same model: float32 greedy tokens equal default mode's."""
    path = str(make_tiny_model("qwen3", tmp_path / "qwen3"))
    prompts = [{"prompt_token_ids": [random.Random(i).randrange(100, 40000) for _ in range(10 + 7 * i)]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    default = LLM(model=path, dtype="float32").generate(prompts, params)
    det = LLM(model=path, dtype="float32", deterministic=True).generate(prompts, params)
    for a, b in zip(default, det):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tid, lp in x.items():
                assert abs(lp.logprob - y[tid].logprob) < 1e-4


def test_deterministic_mode_refuses_what_it_cannot_guarantee():
    with pytest.raises(ValueError, match="deterministic mode supports dtype"):
        check_deterministic_supported(torch.float16)
    with pytest.raises(ValueError, match="CPU backend only"):
        check_deterministic_supported(torch.bfloat16, "cuda")
    check_deterministic_supported(torch.bfloat16)  # the kernels build on this machine


def test_enable_batch_invariant_switches_every_reducing_layer(tmp_path):
    path = str(make_tiny_model("qwen3", tmp_path / "qwen3"))
    llm = LLM(model=path, dtype="float32", deterministic=True)
    model = llm.engine.runner.model
    flagged = [name for name, m in model.named_modules() if getattr(m, "batch_invariant", False)]
    # 2 layers x (qkv, o, gate_up, down, 4 norms incl. q/k norm, act, attn) + final norm + lm_head
    assert len(flagged) == 2 * 10 + 2
    assert enable_batch_invariant(model) == len(flagged)


def test_serve_deterministic_flag_over_http(wide_llama, tmp_path):
    """`tokenmill serve --deterministic`: a completion's text and log-probabilities are identical
    when sent alone and when sent among 16 concurrent requests (real server, official client)."""
    server = ServerProcess(wide_llama, ["--deterministic", "--dtype", "bfloat16", "--max-num-batched-tokens", "40"],
                           tmp_path / "server.log").wait_healthy()
    try:
        target = dict(model=wide_llama, prompt="The history of the printing press begins", max_tokens=16,
                      temperature=0, logprobs=3)

        def answer(completion) -> tuple:
            choice = completion.choices[0]
            return choice.text, choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs

        alone = answer(server.client().completions.create(**target))

        async def crowded() -> tuple:
            client = server.async_client()
            rng = random.Random(5)
            others = [
                client.completions.create(model=wide_llama, prompt=" ".join(["word"] * rng.randrange(2, 40)),
                                          max_tokens=rng.randrange(4, 24), temperature=0.7)
                for _ in range(16)
            ]
            results = await asyncio.gather(*others[:8], client.completions.create(**target), *others[8:])
            return answer(results[8])

        assert asyncio.run(crowded()) == alone
        status = server.get_json("/debug/status")  # the ISA path is visible to operators
        assert status["cpu"]["isa_path"] == csrc_build.selected_isa()
        assert status["kernels"] == f"deterministic: batch-invariant C kernels ({csrc_build.selected_isa()} path)"
        assert status["config"]["deterministic"] is True and status["dtype"] == "bfloat16"
        assert status["kv_cache"]["integrity"] == "ok" and status["kernel_plan"] is None
    finally:
        server.stop()
