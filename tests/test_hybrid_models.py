"""Hybrid linear-attention models (Gated DeltaNet: Qwen3-Next, Qwen3.5) against `transformers`, and the state pool.

- The chunked gated delta rule equals the token-by-token recurrence in float64 (bound 1e-10).
- Tiny random Qwen3-Next and Qwen3.5 text checkpoints (linear and full-attention layers mixed, fp32,
  written by transformers' save_pretrained): greedy tokens equal transformers' for one request and 16
  concurrent ones, under chunk budgets 1, 7 and 64 and under forced preemption; prompt log-probabilities
  within 1e-4.
- State-pool accounting with no weights: 2,000 random requests with aborts leak no slot, and admission
  waits when the state pool is full while the KV pool has room.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig

from tests.scheduler_helpers import make_request, step
from tests.tiny_models import BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE, smollm2_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.config import SchedulerConfig
from tokenmill.kv_cache.kv_cache_manager import KVCacheManager
from tokenmill.kv_cache.state_slots import StateSlotAllocator
from tokenmill.linear_attention import chunk_gated_delta_rule, decode_step, recurrent_gated_delta_rule
from tokenmill.memory_plan import PlanConfig, plan_memory, read_model_shape
from tokenmill.runner.kv_cache_sizing import GIB
from tokenmill.models.qwen3_next import Qwen3NextForCausalLM
from tokenmill.request import RequestStatus
from tokenmill.scheduler.scheduler import Scheduler

NEW_TOKENS = 8
HYBRID = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256, rms_norm_eps=1e-6,
    initializer_range=0.2, tie_word_embeddings=False, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)
ARCHS = {
    "qwen3_next": (Qwen3NextConfig, "Qwen3NextForCausalLM", {"num_experts": 0}),
    "qwen3_5": (Qwen3_5TextConfig, "Qwen3_5ForCausalLM", {}),
}


def make_hybrid_model(arch: str, out_dir) -> str:
    """A tiny random hybrid checkpoint written by transformers' save_pretrained (fp32) + the SmolLM2 tokenizer."""
    config_cls, architecture, extra = ARCHS[arch]
    config = config_cls(architectures=[architecture], **HYBRID, **extra)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # A_log / dt_bias spread so decays differ per head (init leaves them near one value)
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-1.0, 1.0)
                layer.linear_attn.dt_bias.uniform_(-1.0, 1.0)
    model.save_pretrained(out_dir)
    smollm2_tokenizer().save_pretrained(out_dir)
    gen = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": EOS_TOKEN_ID}
    (out_dir / "generation_config.json").write_text(json.dumps(gen) + "\n")
    return str(out_dir)


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(request, tmp_path_factory):
    path = make_hybrid_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


_LLMS: dict[tuple, LLM] = {}


def engine_for(path: str, **kwargs) -> LLM:
    """One LLM per (checkpoint, settings) for the whole module (engine start-up dominates these tests)."""
    key = (path, tuple(sorted(kwargs.items())))
    if key not in _LLMS:
        _LLMS[key] = LLM(model=path, dtype="float32", block_size=4, num_threads=1, **kwargs)
    return _LLMS[key]


def random_prompts(num: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(num)]


@torch.inference_mode()
def hf_greedy_agrees(hf, prompts: list[list[int]], outputs: list[list[int]]) -> bool:
    """Whether each output is transformers' greedy continuation of its prompt: one teacher-forced forward per
    request over prompt + output, whose argmax at every position after the prompt must be the next output
    token (the same condition as generate(do_sample=False), without its token-by-token loop)."""
    for prompt, output in zip(prompts, outputs):
        assert len(output) == NEW_TOKENS
        logits = hf(torch.tensor([prompt + output])).logits[0]  # (L, vocab)
        if logits[len(prompt) - 1 : -1].argmax(-1).tolist() != output:
            return False
    return True


def tm_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


# ---- the delta rule itself -------------------------------------------------------------------


@pytest.mark.parametrize("length,chunk_size", [(1, 64), (7, 3), (64, 64), (100, 64), (130, 16)])
def test_chunked_delta_rule_equals_token_recurrence_float64(length, chunk_size):
    gen = torch.Generator().manual_seed(length)
    heads, dk, dv = 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(length, heads, dv, generator=gen, dtype=torch.float64)
    g = -3 * torch.rand(length, heads, generator=gen, dtype=torch.float64)
    beta = torch.rand(length, heads, generator=gen, dtype=torch.float64)
    s0 = torch.randn(heads, dk, dv, generator=gen, dtype=torch.float64)
    ref_out, ref_state = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk_size)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)  # stated bound: 1e-10 absolute in float64
    torch.testing.assert_close(state, ref_state, atol=1e-10, rtol=0)
    # the batched decode update is the recurrence's one-token case
    st = s0.unsqueeze(0).clone()
    o1 = decode_step(q[:1].unsqueeze(0)[:, 0], k[:1].unsqueeze(0)[:, 0], v[:1].unsqueeze(0)[:, 0], g[:1], beta[:1], st)
    r1, rs1 = recurrent_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], s0)
    torch.testing.assert_close(o1, r1, atol=1e-12, rtol=0)
    torch.testing.assert_close(st[0], rs1, atol=1e-12, rtol=0)


# ---- end to end against transformers ----------------------------------------------------------


def test_single_request_matches_transformers(tiny):
    path, hf = tiny
    llm = engine_for(path, num_kv_blocks=256)
    prompt = random_prompts(1, seed=1, lo=20, hi=21)[0]
    got = tm_greedy(llm, [prompt])
    ids = torch.tensor([prompt])
    with torch.inference_mode():  # transformers' own generate (its cached recurrent decode) once, too
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                          pad_token_id=0)
    assert got == [ref[0, len(prompt):].tolist()]
    assert len(set(got[0])) > 1  # not a degenerate repetition


def test_16_concurrent_match_transformers(tiny):
    path, hf = tiny
    llm = engine_for(path, num_kv_blocks=256)
    prompts = random_prompts(16, seed=2)
    assert hf_greedy_agrees(hf, prompts, tm_greedy(llm, prompts))
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_manager.state_slots.num_free_slots == llm.engine.kv_cache_manager.state_slots.num_slots


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunk_budgets_carry_state_across_chunks(tiny, budget):
    path, hf = tiny
    llm = engine_for(path, num_kv_blocks=256, max_num_batched_tokens=budget, max_num_seqs=min(budget, 4))
    prompts = random_prompts(3 if budget > 1 else 2, seed=3 + budget, lo=10, hi=30)
    assert hf_greedy_agrees(hf, prompts, tm_greedy(llm, prompts))


def test_forced_preemption_matches_transformers(tiny):
    path, hf = tiny
    # 14 blocks of 4 tokens (1 full-attention layer) for 6 requests of up to ~27 tokens each.
    llm = engine_for(path, num_kv_blocks=14, max_num_batched_tokens=64)
    prompts = random_prompts(6, seed=4, lo=8, hi=20)
    got = tm_greedy(llm, prompts)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert hf_greedy_agrees(hf, prompts, got)
    llm.engine.check_integrity()
    kv = llm.engine.kv_cache_manager
    assert kv.block_pool.num_free_blocks == 14 and kv.state_slots.num_free_slots == kv.state_slots.num_slots


@torch.inference_mode()
def test_prompt_logprobs_match_transformers(tiny):
    path, hf = tiny
    llm = engine_for(path, num_kv_blocks=256, max_num_batched_tokens=7, max_num_seqs=4)  # prompt in 4 chunks
    prompt = random_prompts(1, seed=5, lo=25, hi=26)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[pos][prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4


def test_n_greater_than_one_gives_each_sequence_its_own_state(tiny):
    path, hf = tiny
    llm = engine_for(path, num_kv_blocks=256)
    prompt = random_prompts(1, seed=6, lo=12, hi=13)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, n=3,
                                                                    ignore_eos=True))[0]
    tokens = [o.token_ids for o in out.outputs]
    assert len(tokens) == 3 and hf_greedy_agrees(hf, [prompt] * 3, tokens)
    kv = llm.engine.kv_cache_manager
    assert kv.state_slots.num_free_slots == kv.state_slots.num_slots


@pytest.mark.parametrize("setting", [{"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
                                     {"deterministic": True}])
def test_features_without_state_support_are_refused(tiny, setting):
    path, _ = tiny
    with pytest.raises(ValueError, match=next(iter(setting))):
        LLM(model=path, dtype="float32", num_kv_blocks=64, num_threads=1, **setting)


def test_moe_qwen3_next_is_refused_naming_the_field():
    config = Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], **{**HYBRID, "num_hidden_layers": 4},
                             num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="num_experts"):
        Qwen3NextForCausalLM(config)


# ---- state-pool accounting (no weights) -------------------------------------------------------


def _scheduler(num_blocks: int, num_slots: int, max_num_seqs: int = 8, budget: int = 32) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_caching=False)
    kv.state_slots = StateSlotAllocator(num_slots)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=128)
    return Scheduler(config, kv)


def test_admission_waits_for_a_state_slot():
    sched = _scheduler(num_blocks=100, num_slots=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 5, max_tokens=3))
    out = step(sched)
    assert [r.request_id for r in out.scheduled_requests] == ["r0", "r1"]  # KV has room; the state pool has not
    assert sched.num_waiting == 1 and sched.kv_cache_manager.block_pool.num_free_blocks > 90
    sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    out = step(sched)
    assert "r2" in [r.request_id for r in out.scheduled_requests]
    assert sched.kv_cache_manager.state_slots.slot_of("r2") == 0  # r0's slot, handed on


def test_admission_waits_for_kv_blocks_while_state_slots_are_free():
    sched = _scheduler(num_blocks=6, num_slots=4)  # 6 blocks of 4 tokens; r0 takes 5 of them
    sched.add_request(make_request("r0", 17, max_tokens=2))
    sched.add_request(make_request("r1", 9, max_tokens=2))
    out = step(sched)
    assert [r.request_id for r in out.scheduled_requests] == ["r0"]  # r1 needs 3 blocks, 1 is free
    kv = sched.kv_cache_manager
    assert sched.num_waiting == 1 and kv.state_slots.num_free_slots == 3 and not kv.state_slots.has_slot("r1")
    while "r0" in sched.requests:
        step(sched)
    out = step(sched)
    assert [r.request_id for r in out.scheduled_requests] == ["r1"] and kv.state_slots.has_slot("r1")


def test_plan_counts_full_attention_kv_and_state_bytes_like_the_engine(tiny, capsys):
    path, _ = tiny
    shape = read_model_shape(path)
    assert (shape.num_layers, shape.num_linear_layers, shape.num_kv_layers) == (4, 3, 1)
    plan = plan_memory(shape, PlanConfig(memory=1.0, kv_cache_memory=0.001, block_size=4, max_num_seqs=8,
                                         max_model_len=64))
    # KV: 2 x 1 full-attention layer x 2 kv heads x 16 head_dim x 4 B; state: 3 linear layers x (conv 96 channels
    # x 3 taps x 4 B + recurrent 4 heads x 16 x 8 x 4 B)
    assert plan.kv_bytes_per_token == 2 * 1 * 2 * 16 * 4 == 256
    assert plan.state_bytes_per_sequence == 3 * (96 * 3 * 4 + 4 * 16 * 8 * 4) == 9600
    assert plan.num_kv_blocks == int(0.001 * GIB) // (4 * 256)
    assert (plan.num_state_slots, plan.num_state_checkpoints, plan.state_pool_bytes) == (8, 8, 16 * 9600)
    assert plan.num_sequences_both_pools == min(plan.num_kv_blocks // 16, 8) == 8
    assert plan.total_bytes == plan.weight_bytes + plan.reserve_bytes + plan.kv_pool_bytes + 16 * 9600
    no_cache = plan_memory(shape, PlanConfig(memory=1.0, block_size=4, max_num_seqs=8, enable_prefix_caching=False))
    cached = plan_memory(shape, PlanConfig(memory=1.0, block_size=4, max_num_seqs=8))
    assert no_cache.kv_budget_bytes - cached.kv_budget_bytes == 8 * 9600  # the checkpoints come out of the budget
    llm = engine_for(path, num_kv_blocks=256)  # the engine's own pools, built from the weights
    assert llm.engine.runner.bytes_per_token == plan.kv_bytes_per_token
    assert llm.engine.runner.state_cache.bytes_per_sequence == plan.state_bytes_per_sequence
    from tokenmill.cli.main import main

    assert main(["plan", path, "--memory", "1", "--max-num-seqs", "8", "--block-size", "4"]) == 0
    text = capsys.readouterr().out
    assert "KV bytes per token: 2 x 1 full-attention layers x 2 kv heads" in text
    assert "state bytes per sequence: 3 linear layers x" in text and "= 9,600 B" in text
    assert "8 live slots (max_num_seqs) + 8 prefix-cache checkpoints" in text


def test_no_state_slot_leaks_after_2000_random_requests_with_aborts():
    rng = random.Random(0)
    sched = _scheduler(num_blocks=20, num_slots=5, max_num_seqs=6, budget=24)
    kv = sched.kv_cache_manager
    next_id = 0
    while next_id < 2000 or sched.has_unfinished_requests():
        if next_id < 2000:
            for _ in range(rng.randrange(0, 3)):
                sched.add_request(make_request(f"r{next_id}", rng.randrange(1, 30), max_tokens=rng.randrange(1, 8)))
                next_id += 1
        step(sched)
        if sched.requests and rng.random() < 0.2:
            sched.finish_requests([rng.choice(list(sched.requests))], RequestStatus.FINISHED_ABORTED)
        kv.check_integrity()
        assert kv.state_slots.num_slots - kv.state_slots.num_free_slots == sched.num_running
        assert all(kv.state_slots.has_slot(r.request_id) for r in sched.running)
    assert sched.num_preemptions_total > 0  # the KV pool was tight enough to preempt (state freed with it)
    assert kv.state_slots.num_free_slots == 5 and kv.block_pool.num_free_blocks == 20
