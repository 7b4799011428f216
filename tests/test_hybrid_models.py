"""Hybrid linear-attention models (Gated DeltaNet: Qwen3-Next, Qwen3.5) against `transformers`, and the state pool.

- The chunked gated delta rule equals the token-by-token recurrence in float64 (bound 1e-10).
- Tiny random Qwen3-Next and Qwen3.5 text checkpoints (linear and full-attention layers mixed, fp32,
  written by transformers' save_pretrained): greedy tokens equal transformers' for one request and 16
  concurrent ones, under chunk budgets 1, 7 and 64 and under forced preemption; prompt log-probabilities
  within 1e-4.
- Prefix caching: hits at and between the block-aligned state checkpoints give the tokens and log-probabilities
  of no caching, and report the reuse they really get (cut to the checkpoint).
- Deterministic mode: a request's tokens, logprobs and prompt logprobs are bit-identical alone, among other
  requests with another chunk budget, and resumed from a prefix hit.
- State-pool accounting with no weights: 2,000 random requests with aborts leak no slot or checkpoint, and
  admission waits when either pool is full while the other has room; `tokenmill plan` matches the engine.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig

from tests.scheduler_helpers import make_request, runner_output, step
from tests.test_cpu_isa_paths import build_for_isa
from tests.tiny_models import BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE, smollm2_tokenizer
from tokenmill import LLM, SamplingParams, csrc_build
from tokenmill.config import SchedulerConfig
from tokenmill.kv_cache.kv_cache_manager import KVCacheManager
from tokenmill.kv_cache.state_slots import StateCheckpoints, StateSlotAllocator, state_pool_sizes
from tokenmill.kv_transfer.blocks import KVBlocksError
from tokenmill.kv_transfer.session import read_session, write_session
from tokenmill.linear_attention import chunk_gated_delta_rule, decode_step, invariant_ops, recurrent_gated_delta_rule
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


@pytest.mark.parametrize("length,chunk_size,position", [(1, 64, 0), (7, 3, 1), (64, 64, 0), (100, 64, 37),
                                                        (130, 16, 5)])
def test_chunked_delta_rule_equals_token_recurrence_float64(length, chunk_size, position):
    gen = torch.Generator().manual_seed(length)
    heads, dk, dv = 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(length, heads, dv, generator=gen, dtype=torch.float64)
    g = -3 * torch.rand(length, heads, generator=gen, dtype=torch.float64)
    beta = torch.rand(length, heads, generator=gen, dtype=torch.float64)
    s0 = torch.randn(heads, dk, dv, generator=gen, dtype=torch.float64)
    ref_out, ref_state = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk_size, position=position)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)  # stated bound: 1e-10 absolute in float64
    torch.testing.assert_close(state, ref_state, atol=1e-10, rtol=0)
    # the batched decode update is the recurrence's one-token case
    st = s0.unsqueeze(0).clone()
    o1 = decode_step(q[:1].unsqueeze(0)[:, 0], k[:1].unsqueeze(0)[:, 0], v[:1].unsqueeze(0)[:, 0], g[:1], beta[:1], st)
    r1, rs1 = recurrent_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], s0)
    torch.testing.assert_close(o1, r1, atol=1e-12, rtol=0)
    torch.testing.assert_close(st[0], rs1, atol=1e-12, rtol=0)


@pytest.mark.parametrize("isa", csrc_build.ISAS)
def test_invariant_kernel_is_the_recurrence_and_independent_of_batching_and_splits(isa, monkeypatch):
    """On every ISA path this CPU runs: gated_delta.c has no intrinsics, so its paths are the compiler's own
    vectorisation of the same code (the portable build is SSE2 on x86)."""
    lib = build_for_isa(invariant_ops.library.load, isa)
    monkeypatch.setattr(invariant_ops.library, "built", lambda: lib)  # the ops' calls take this build
    gen = torch.Generator().manual_seed(3)
    length, heads, dk, dv = 40, 4, 16, 8
    q = torch.nn.functional.normalize(torch.randn(2 * length, heads, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(2 * length, heads, dk, generator=gen), dim=-1)
    v, s0 = torch.randn(2 * length, heads, dv, generator=gen), torch.randn(2, heads, dk, dv, generator=gen)
    g, beta = -3 * torch.rand(2 * length, heads, generator=gen), torch.rand(2 * length, heads, generator=gen)
    state = s0.clone()
    out = invariant_ops.recurrent_rule(q, k, v, g, beta, state)  # two sequences of 40 tokens in one call
    for s in range(2):  # float64 reference within float32 rounding
        rows = slice(s * length, (s + 1) * length)
        ref_out, ref_state = recurrent_gated_delta_rule(*(x[rows].double() for x in (q, k, v, g, beta)),
                                                        s0[s].double())
        torch.testing.assert_close(out[rows].double(), ref_out, atol=1e-5, rtol=0)
        torch.testing.assert_close(state[s].double(), ref_state, atol=1e-5, rtol=0)
    split = s0[1:].clone()  # the second sequence alone, split after 13 tokens: the same bits
    first = invariant_ops.recurrent_rule(*(x[length : length + 13] for x in (q, k, v, g, beta)), split)
    rest = invariant_ops.recurrent_rule(*(x[length + 13 :] for x in (q, k, v, g, beta)), split)
    assert torch.equal(torch.cat((first, rest)), out[length:]) and torch.equal(split[0], state[1])
    pool = torch.zeros(5, heads, dk, dv)  # the decode form: one token per sequence, states in place in a pool
    pool[3], pool[1] = s0[0], s0[1]
    rows = torch.tensor([0, length])
    one = invariant_ops.recurrent_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], pool, torch.tensor([3, 1]))
    alone = s0[:1].clone()
    assert torch.equal(one[1], invariant_ops.recurrent_rule(*(x[length : length + 1] for x in (q, k, v, g, beta)),
                                                             s0[1:].clone())[0])
    assert torch.equal(one[0], invariant_ops.recurrent_rule(*(x[:1] for x in (q, k, v, g, beta)), alone)[0])
    assert torch.equal(pool[3], alone[0]) and not pool[0].any() and not pool[2].any()


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


def test_speculative_decoding_is_refused_naming_the_setting(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(model=path, dtype="float32", num_kv_blocks=64, num_threads=1,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


# ---- prefix caching: state checkpoints ---------------------------------------------------------

GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)


def run_one(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY_LOGPROBS):
    """(token ids, logprob of each, num_cached_tokens, prompt logprobs) of one request."""
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    seq = out.outputs[0]
    logprobs = [entry[t].logprob for t, entry in zip(seq.token_ids, seq.logprobs or [])]
    return seq.token_ids, logprobs, out.num_cached_tokens, out.prompt_logprobs


def test_prefix_hits_at_and_between_checkpoints_equal_no_caching(tiny):
    path, _ = tiny
    # blocks of 4 tokens, a state checkpoint every 2 blocks: after tokens 8, 16, 24, ...
    cached = engine_for(path, num_kv_blocks=256, state_checkpoint_interval=2)
    # the module's shared engine: its checkpoints come every 8 blocks (32 tokens), so nothing here hits there
    plain = engine_for(path, num_kv_blocks=256)
    base = random_prompts(1, seed=11, lo=29, hi=30)[0]
    tail = random_prompts(2, seed=12, lo=5, hi=6)
    cold = run_one(cached, base)  # computes the prompt, saving checkpoints at 8, 16 and 24
    ref = run_one(plain, base)
    assert cold[2] == 0 and cold[0] == ref[0] and max(abs(x - y) for x, y in zip(cold[1], ref[1])) < 1e-5
    for prompt, reuse in ((base[:24] + tail[0], 24),  # matches 6 blocks: resumes at the checkpoint after 24
                          (base[:22] + tail[1], 16)):  # matches 5 blocks: cut back to the checkpoint after 16
        tokens, logprobs, num_cached, _ = run_one(cached, prompt)
        ref_tokens, ref_logprobs, ref_cached, _ = run_one(plain, prompt)
        assert num_cached == reuse and ref_cached == 0 and tokens == ref_tokens
        assert max(abs(x - y) for x, y in zip(logprobs, ref_logprobs)) < 1e-5
    # prompt log-probabilities of a request that saves checkpoints (its chunks split there) equal no caching's
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    got, ref = run_one(cached, base + tail[0], params)[3], run_one(plain, base + tail[0], params)[3]
    ids = base + tail[0]
    assert max(abs(got[i][ids[i]].logprob - ref[i][ids[i]].logprob) for i in range(1, len(ids))) < 1e-5
    cached.engine.check_integrity()
    assert len(cached.engine.kv_cache_manager.state_slots.checkpoints) >= 3


def test_prefix_hit_from_the_ram_tier_resumes_from_its_checkpoint(tiny):
    path, _ = tiny
    if "qwen3_next" in path:
        pytest.skip("the tier path does not depend on the architecture: one of them is enough")
    # a 16-block pool (64 tokens) over a RAM tier: the first prompt's blocks are pushed down by the next two
    llm = engine_for(path, num_kv_blocks=16, kv_offload_memory=0.01, state_checkpoint_interval=2)
    base, *others = random_prompts(3, seed=31, lo=29, hi=30)
    tail = random_prompts(1, seed=32, lo=5, hi=6)[0]
    run_one(llm, base)
    for prompt in others:
        run_one(llm, prompt)
    tokens, logprobs, num_cached, _ = run_one(llm, base[:26] + tail)  # 6 blocks matched below the pool
    ref_tokens, ref_logprobs, _, _ = run_one(engine_for(path, num_kv_blocks=256), base[:26] + tail)
    assert llm.engine.kv_store.ram.stats.hits >= 6 and num_cached == 24 and tokens == ref_tokens
    assert max(abs(x - y) for x, y in zip(logprobs, ref_logprobs)) < 1e-5
    llm.engine.check_integrity()


def test_prefix_hit_from_the_disk_tier_after_a_restart_resumes_from_its_checkpoint(tiny, tmp_path):
    path, _ = tiny
    disk = str(tmp_path / "kv")
    base = random_prompts(1, seed=41, lo=29, hi=30)[0]
    tail = random_prompts(1, seed=42, lo=5, hi=6)[0]
    settings = dict(model=path, dtype="float32", block_size=4, num_threads=1, num_kv_blocks=64,
                    state_checkpoint_interval=2, kv_offload_disk_path=disk)
    with LLM(**settings) as first:  # checkpoints after 8, 16, 24 (and 32) tokens; closing writes the blocks to disk
        run_one(first, base)
        assert len(first.engine.kv_cache_manager.state_slots.checkpoints) == 4
    plain = engine_for(path, num_kv_blocks=256, enable_prefix_caching=False)
    with LLM(**settings) as restarted:  # a new engine over the same directory: nothing in memory
        assert len(restarted.engine.kv_cache_manager.state_slots.checkpoints) == 0
        for prompt, reuse in ((base[:26] + tail, 24),  # 6 blocks on disk, the checkpoint after 24 tokens among them
                              (base[:22] + tail, 16)):  # 5 blocks matched: cut back to the checkpoint after 16
            tokens, logprobs, num_cached, _ = run_one(restarted, prompt)
            ref_tokens, ref_logprobs, ref_cached, _ = run_one(plain, prompt)
            assert num_cached == reuse and ref_cached == 0 and tokens == ref_tokens
            assert max(abs(x - y) for x, y in zip(logprobs, ref_logprobs)) < 1e-5
        store = restarted.engine.kv_store
        assert store.disk.stats.hits >= 6 and restarted.engine.kv_cache_manager.state_slots.checkpoints.num_adopted >= 3
        # prompt log-probabilities (they skip the cache) of a prompt the disk holds equal no caching's
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        got, ref = run_one(restarted, base, params)[3], run_one(plain, base, params)[3]
        assert max(abs(got[i][base[i]].logprob - ref[i][base[i]].logprob) for i in range(1, len(base))) < 1e-5
        restarted.engine.check_integrity()


def test_disk_records_without_state_are_kv_only_hits_that_recompute(tiny, tmp_path):
    path, _ = tiny
    if "qwen3_next" in path:
        pytest.skip("the record path does not depend on the architecture: one of them is enough")
    disk = str(tmp_path / "kv")
    base = random_prompts(1, seed=43, lo=29, hi=30)[0]
    settings = dict(model=path, dtype="float32", block_size=4, num_threads=1, num_kv_blocks=64,
                    kv_offload_disk_path=disk)
    # a checkpoint every 8 blocks (32 tokens): a 29-token prompt saves none, so its blocks go to disk without state
    with LLM(**settings, state_checkpoint_interval=8) as first:
        run_one(first, base)
    plain = engine_for(path, num_kv_blocks=256, enable_prefix_caching=False)
    with LLM(**settings, state_checkpoint_interval=2) as restarted:
        tokens, logprobs, num_cached, _ = run_one(restarted, base[:26] + [7, 8, 9])
        ref_tokens, ref_logprobs, _, _ = run_one(plain, base[:26] + [7, 8, 9])
        assert restarted.engine.kv_store.disk.stats.hits >= 6  # the KV blocks were read back ...
        assert num_cached == 0 and tokens == ref_tokens  # ... but without a checkpoint the prompt is recomputed
        assert max(abs(x - y) for x, y in zip(logprobs, ref_logprobs)) < 1e-5


def test_session_save_restore_carries_state_checkpoints(tiny, tmp_path):
    path, _ = tiny
    base = random_prompts(1, seed=51, lo=29, hi=30)[0]
    tail = random_prompts(1, seed=52, lo=5, hi=6)[0]
    settings = dict(model=path, dtype="float32", block_size=4, num_threads=1, num_kv_blocks=64,
                    state_checkpoint_interval=2)
    with LLM(**settings) as source:  # checkpoints after 8, 16 and 24 tokens: blocks 1, 3 and 5
        run_one(source, base, SamplingParams(temperature=0, max_tokens=1))
        meta, blocks, state = source.engine.block_io.export_blocks(base[:28])
    assert meta.format_version == 2 and meta.state_blocks == [1, 3, 5] and len(meta.block_hashes) == 7
    assert state["state_conv"].shape[:2] == state["state_recurrent"].shape[:2] == (3, 3)  # 3 checkpoints x 3 layers
    write_session(tmp_path / "sessions", "hybrid", meta, blocks, state)
    meta, blocks, state = read_session(tmp_path / "sessions", "hybrid")
    plain = engine_for(path, num_kv_blocks=256, enable_prefix_caching=False)
    prompt = base[:28] + tail
    ref_tokens, ref_logprobs, _, _ = run_one(plain, prompt)
    with LLM(**settings) as target:  # another engine: restored blocks hit with their checkpoints
        result = target.engine.block_io.import_blocks(meta, blocks, state)
        assert result["num_imported"] == 7 and result["num_state_checkpoints"] == 3
        tokens, logprobs, num_cached, _ = run_one(target, prompt)
        assert num_cached == 24 and tokens == ref_tokens  # resumed at the checkpoint after 24 tokens
        assert max(abs(x - y) for x, y in zip(logprobs, ref_logprobs)) < 1e-5
        target.engine.check_integrity()
    kv_only = type(meta)(**{**json.loads(meta.to_json()), "format_version": 1, "state_blocks": [],
                            "state_sha256": None})
    with LLM(**settings) as target:  # a session without state (format 1): KV hits, linear layers recompute
        assert target.engine.block_io.import_blocks(kv_only, blocks)["num_state_checkpoints"] == 0
        tokens, _, num_cached, _ = run_one(target, prompt)
        assert num_cached == 0 and tokens == ref_tokens
        corrupt = {**state, "state_recurrent": state["state_recurrent"].clone()}
        corrupt["state_recurrent"].view(-1)[5] += 1.0
        for bad, param in ((corrupt, "state_sha256"), ({}, "state_blocks")):
            with pytest.raises(KVBlocksError) as info:
                target.engine.block_io.import_blocks(meta, blocks, bad)
            assert info.value.param == param and info.value.status_code == 400
    with LLM(**{**settings, "enable_prefix_caching": False}) as no_cache, pytest.raises(KVBlocksError) as info:
        no_cache.engine.block_io.import_blocks(meta, blocks, state)
    assert info.value.param == "state_blocks"


def test_kv_transfer_is_refused_naming_the_setting(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="kv_transfer_config.*linear-layer state"):
        LLM(model=path, dtype="float32", num_kv_blocks=64, num_threads=1,
            kv_transfer_config={"kv_connector": "TokenmillConnector", "kv_role": "kv_both"})


def test_deterministic_mode_is_bit_identical_across_batches_chunks_and_prefix_hits(tiny):
    path, hf = tiny
    # 7-token chunks shared by the batch: the target's prompt is cut differently alone and among others
    llm = engine_for(path, num_kv_blocks=256, deterministic=True, max_num_batched_tokens=7, max_num_seqs=4,
                     state_checkpoint_interval=2)
    target = random_prompts(1, seed=21, lo=27, hi=28)[0]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=2)

    def bits(out):
        seq = out.outputs[0]
        return (seq.token_ids, [{t: e.logprob for t, e in d.items()} for d in seq.logprobs],
                [d and {t: e.logprob for t, e in d.items()} for d in out.prompt_logprobs or []])

    alone = bits(llm.generate({"prompt_token_ids": target}, params)[0])
    resumed = llm.generate({"prompt_token_ids": target}, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                         ignore_eos=True, logprobs=2))[0]
    assert resumed.num_cached_tokens == 24 and bits(resumed)[:2] == alone[:2]  # state restored at token 24
    others = random_prompts(3, seed=22, lo=5, hi=20)
    batch = llm.generate([{"prompt_token_ids": p} for p in (others[0], target, *others[1:])], params)
    assert bits(batch[1]) == alone
    assert hf_greedy_agrees(hf, [target], [alone[0]])
    llm.engine.check_integrity()


def test_checkpoints_leave_with_their_blocks_and_bound_memory():
    checkpoints = StateCheckpoints(num_slots=2, interval=1)
    assert [checkpoints.reserve(h) for h in (11, 12)] == [0, 1] and checkpoints.reserve(11) is None
    assert checkpoints.reserve(13) is None  # both slots are written this step: none is taken from under it
    checkpoints.end_step()
    assert checkpoints.ready_slot(11) == 0
    checkpoints.use(11)  # 11 restored this step: most recently used, and busy
    assert checkpoints.reserve(13) == 1  # the least recently used (12) gives way
    checkpoints.drop(11)  # its block was evicted: the slot is free once this step has run
    assert checkpoints.ready_slot(11) is None and checkpoints.reserve(14) is None
    checkpoints.end_step()
    assert checkpoints.reserve(14) == 0
    checkpoints.clear()
    checkpoints.check_integrity()
    assert len(checkpoints) == 0


def test_moe_qwen3_next_is_refused_naming_the_field():
    config = Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], **{**HYBRID, "num_hidden_layers": 4},
                             num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="num_experts"):
        Qwen3NextForCausalLM(config)


# ---- state-pool accounting (no weights) -------------------------------------------------------


def _scheduler(num_blocks: int, num_slots: int, max_num_seqs: int = 8, budget: int = 32,
               num_checkpoints: int = 0) -> Scheduler:
    checkpoints = StateCheckpoints(num_checkpoints, interval=2) if num_checkpoints else None
    kv = KVCacheManager(num_blocks, 4, enable_caching=num_checkpoints > 0,
                        state_slots=StateSlotAllocator(num_slots, checkpoints))
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


def test_state_pool_sized_from_memory_like_the_kv_pool(tiny):
    path, _ = tiny
    per_seq = 3 * (96 * 3 * 4 + 4 * 16 * 8 * 4)  # 9,600 B: see the plan test above
    budget = 0.0001  # GiB = 107,374 B: 11 sequences' state
    assert int(budget * GIB) // per_seq == 11
    assert state_pool_sizes(None, per_seq, 8, True) == (8, 8)  # no budget: max_num_seqs of each, as before
    assert state_pool_sizes(None, per_seq, 8, False) == (8, 0)
    assert state_pool_sizes(int(budget * GIB), per_seq, 8, True) == (8, 3)  # live slots first, the rest checkpoints
    assert state_pool_sizes(int(budget * GIB), per_seq, 8, False) == (8, 0)
    assert state_pool_sizes(2 * per_seq + 100, per_seq, 8, True) == (2, 0)  # fewer live slots than max_num_seqs
    with pytest.raises(ValueError, match="state_cache_memory"):
        state_pool_sizes(per_seq - 1, per_seq, 8, True)
    shape = read_model_shape(path)
    default = plan_memory(shape, PlanConfig(memory=1.0, block_size=4, max_num_seqs=8))
    sized = plan_memory(shape, PlanConfig(memory=1.0, block_size=4, max_num_seqs=8, state_cache_memory=budget))
    assert (sized.num_state_slots, sized.num_state_checkpoints, sized.state_pool_bytes) == (8, 3, 11 * per_seq)
    assert sized.kv_budget_bytes - default.kv_budget_bytes == (16 - 11) * per_seq  # the KV pool gets the rest
    llm = engine_for(path, num_kv_blocks=256, max_num_seqs=8, state_cache_memory=budget)
    cache = llm.engine.runner.state_cache
    assert cache.slots.num_slots == 8 and cache.slots.checkpoints.num_slots == 3
    assert cache.bytes_per_sequence == per_seq and cache.checkpoint_bytes == 3 * per_seq
    with pytest.raises(ValueError, match="state_cache_memory"):
        LLM(model=path, dtype="float32", block_size=4, num_threads=1, num_kv_blocks=64,
            state_cache_memory=(per_seq - 1) / GIB)


def test_admission_waits_when_the_memory_sized_state_pool_is_full(tiny):
    path, hf = tiny
    per_seq = 3 * (96 * 3 * 4 + 4 * 16 * 8 * 4)
    llm = engine_for(path, num_kv_blocks=256, max_num_seqs=8, enable_prefix_caching=False,
                     state_cache_memory=(2 * per_seq + 100) / GIB)  # two sequences' state
    engine = llm.engine
    assert engine.runner.state_cache.slots.num_slots == 2
    prompts = random_prompts(5, seed=61, lo=5, hi=20)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", {"prompt_token_ids": prompt}, params)
    engine.step()  # two admitted; three wait for a state slot while the KV pool has room
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 3
    assert engine.kv_cache_manager.block_pool.num_free_blocks > 200
    outputs, most_running = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        most_running = max(most_running, engine.scheduler.num_running)
    assert most_running == 2 and len(outputs) == 5  # each waiting request ran once a slot was freed
    assert hf_greedy_agrees(hf, prompts, [outputs[f"s{i}"] for i in range(len(prompts))])
    engine.check_integrity()


@pytest.mark.parametrize("num_checkpoints", [0, 3])
def test_no_state_slot_leaks_after_2000_random_requests_with_aborts(num_checkpoints):
    rng = random.Random(0)
    sched = _scheduler(num_blocks=20, num_slots=5, max_num_seqs=6, budget=24, num_checkpoints=num_checkpoints)
    kv = sched.kv_cache_manager
    next_id = num_restored = 0
    while next_id < 2000 or sched.has_unfinished_requests():
        if next_id < 2000:
            for _ in range(rng.randrange(0, 3)):  # prompts 10, 11, 12, ...: shared prefixes, so prefix hits
                sched.add_request(make_request(f"r{next_id}", rng.randrange(1, 30), max_tokens=rng.randrange(1, 8)))
                next_id += 1
        computed = {r.request_id: r.num_computed_tokens for r in sched.running}
        out = sched.schedule()
        ops = kv.state_slots.take_step_ops()  # what the runner does before the forward
        chunk = {r.request_id: (r.num_computed_tokens, n) for r, n in zip(out.scheduled_requests,
                                                                         out.num_scheduled_tokens)}
        for rid, _ in ops.restores:  # only requests admitted now, resuming at a checkpoint boundary
            assert rid not in computed and chunk[rid][0] > 0 and chunk[rid][0] % 8 == 0
        num_restored += len(ops.restores)
        for rid, position, _ in ops.saves:  # block-aligned positions inside the step's chunk
            start, n = chunk[rid]
            assert position % 8 == 0 and start < position <= start + n
        sched.update_from_output(out, runner_output(out))
        if sched.requests and rng.random() < 0.2:
            sched.finish_requests([rng.choice(list(sched.requests))], RequestStatus.FINISHED_ABORTED)
        kv.check_integrity()
        assert kv.state_slots.num_slots - kv.state_slots.num_free_slots == sched.num_running
        assert all(kv.state_slots.has_slot(r.request_id) for r in sched.running)
    assert sched.num_preemptions_total > 0  # the KV pool was tight enough to preempt (state freed with it)
    assert kv.state_slots.num_free_slots == 5 and kv.block_pool.num_free_blocks == 20
    assert (num_restored > 0) == (num_checkpoints > 0)
