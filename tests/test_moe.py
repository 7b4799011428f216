"""Mixture of experts: routing rules against transformers' routers, routing edge cases, the grouped expert step
against the reference loop, tiny Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE models against transformers (logits,
greedy through the LLM with prefix caching and chunked prefill), deterministic mode alone vs in a batch of 16,
preemption with n-gram speculation, LoRA on attention (expert adapters refused), and the expert-load metrics of a
real server.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

from tests.moe_models import MOE_ARCHS, make_moe_model
from tests.server_fixtures import ServerProcess
from tests.test_models import BLOCK_IDS, TOKEN_IDS, hf_logits, new_kv_caches, run_step
from tokenmill import LLM, SamplingParams
from tokenmill.layers import batch_invariant
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.linear import Linear
from tokenmill.lora_request import LoRARequest
from tokenmill.models import load_model
from tokenmill.moe import (BUCKETS, ExpertLoad, ExpertMLP, MoEConfig, RouterConfig, SparseMoeBlock,
                           dense_expert_step, grouped_expert_step, reference_expert_step, select_experts,
                           sparse_layer_mask)

T = 24  # tokens in the unit tests' batches
H = 32  # hidden size there


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) of each row sorted by expert id, so unordered top-k results compare."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


# --- routing rules -----------------------------------------------------------------------------------------------

def _hf_router(name: str):
    """A transformers router module with random weights, and the RouterConfig that should agree with it."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig

    if name == "mixtral":
        hf = MixtralTopKRouter(MixtralConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=2))
        ours = RouterConfig(8, 2, norm_topk_prob=True)
    elif name == "qwen2_moe":
        hf = Qwen2MoeTopKRouter(Qwen2MoeConfig(hidden_size=H, num_experts=16, num_experts_per_tok=4,
                                               norm_topk_prob=False))
        ours = RouterConfig(16, 4)
    elif name == "olmoe_norm":
        hf = OlmoeTopKRouter(OlmoeConfig(hidden_size=H, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True))
        ours = RouterConfig(16, 4, norm_topk_prob=True)
    elif name.startswith("deepseek_v2"):
        grouped = name.endswith("grouped")
        config = DeepseekV2Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                                  topk_group=2, routed_scaling_factor=2.5,
                                  topk_method="group_limited_greedy" if grouped else "greedy")
        hf = DeepseekV2TopkRouter(config)
        ours = RouterConfig(16, 3, num_groups=4 if grouped else 1, topk_groups=2 if grouped else 1,
                            routed_scaling_factor=2.5)
    else:
        config = DeepseekV3Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                  routed_scaling_factor=2.5, norm_topk_prob=True)
        hf = DeepseekV3TopkRouter(config)
        ours = RouterConfig(16, 4, scoring="sigmoid", norm_topk_prob=True, num_groups=4, topk_groups=2,
                            group_scoring="top2_sum", routed_scaling_factor=2.5, correction_bias=True)
    with torch.no_grad():
        hf.weight.normal_(0, 1)
        if hasattr(hf, "e_score_correction_bias"):
            hf.e_score_correction_bias.normal_(0, 0.3)
    return hf, ours


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe_norm", "deepseek_v2", "deepseek_v2_grouped",
                                    "deepseek_v3"])
def test_router_rule_matches_transformers(family):
    """Each family's rule (softmax / sigmoid, renormalization, grouped top-k, routed scaling, correction bias)
    picks transformers' experts with its weights."""
    hf, config = _hf_router(family)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, hf_weights, hf_ids = hf(x)
    logits = x.float() @ hf.weight.float().t()
    bias = getattr(hf, "e_score_correction_bias", None)
    weights, ids = select_experts(logits, config, bias)
    got_ids, got_w = _by_expert(weights, ids)
    want_ids, want_w = _by_expert(hf_weights.float(), hf_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    assert (weights[:, :-1] >= weights[:, 1:]).all() or config.correction_bias  # rank order: best first


def test_softmax_after_topk_equals_renormalized_softmax_topk():
    logits = torch.randn(T, 8, generator=torch.Generator().manual_seed(2))
    w1, i1 = select_experts(logits, RouterConfig(8, 3, softmax_after_topk=True))
    w2, i2 = select_experts(logits, RouterConfig(8, 3, norm_topk_prob=True))
    assert torch.equal(i1, i2)
    torch.testing.assert_close(w1, w2)


def test_grouped_topk_only_chooses_from_the_best_groups():
    logits = torch.full((1, 8), -5.0)
    logits[0, 0], logits[0, 5], logits[0, 6] = 3.0, 2.0, 1.0  # groups of 2: best groups are 0 (expert 0) and 2, 3
    _, ids = select_experts(logits, RouterConfig(8, 2, num_groups=4, topk_groups=1))
    assert set(ids[0].tolist()) == {0, 1}  # only group 0 is eligible: its second expert beats the others


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_experts=8, top_k=9), "num_experts_per_tok"),
    (dict(num_experts=8, top_k=0), "num_experts_per_tok"),
    (dict(num_experts=8, top_k=2, num_groups=3), "n_group"),
    (dict(num_experts=8, top_k=4, num_groups=4, topk_groups=1), "topk_group"),
])
def test_bad_router_config_is_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**kwargs)


# --- routing edge cases ------------------------------------------------------------------------------------------

def test_ties_pick_the_lowest_index_whatever_the_batch():
    """Exact ties across the top-k boundary choose the lowest expert indices, in index order, alone or in a batch;
    ties wholly inside the top-k give transformers' (torch.topk's) set."""
    tied = torch.zeros(1, 8)
    tied[0, [1, 4, 6]] = 2.0  # three equal best experts for k = 2: 1 and 4 win
    _, ids = select_experts(tied, RouterConfig(8, 2))
    assert ids.tolist() == [[1, 4]]
    batch = torch.cat([torch.randn(15, 8, generator=torch.Generator().manual_seed(3)), tied])
    w_batch, ids_batch = select_experts(batch, RouterConfig(8, 2))
    assert ids_batch[-1].tolist() == [1, 4]
    w_alone, _ = select_experts(tied, RouterConfig(8, 2))
    assert torch.equal(w_batch[-1], w_alone[0])
    inside = torch.zeros(1, 8)
    inside[0, [2, 5]] = 1.0  # tied pair, both chosen at k = 2
    _, hf_ids = torch.topk(torch.softmax(inside, -1), 2)
    assert sorted(select_experts(inside, RouterConfig(8, 2))[1][0].tolist()) == sorted(hf_ids[0].tolist())


def _experts(num_experts: int = 8, intermediate: int = 16, seed: int = 0) -> torch.nn.ModuleList:
    gen = torch.Generator().manual_seed(seed)
    experts = torch.nn.ModuleList(ExpertMLP(H, intermediate) for _ in range(num_experts))
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return experts


def _steps_agree(x, weights, ids, experts) -> torch.Tensor:
    grouped = grouped_expert_step(x, weights, ids, experts)
    torch.testing.assert_close(grouped, reference_expert_step(x, weights, ids, experts), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped, dense_expert_step(x, weights, ids, experts), rtol=1e-5, atol=1e-5)
    return grouped


@pytest.mark.parametrize("case", ["random", "one_expert", "idle_experts", "k_equals_e", "one_token", "no_tokens"])
def test_grouped_step_matches_reference_loop(case):
    """The grouped step (sort by expert, one GEMM per active expert, index_copy back, rank-order combine) equals the
    per-token reference loop and the masked dense step, including every token on one expert, experts with no token,
    k = E and empty batches."""
    gen = torch.Generator().manual_seed(4)
    experts = _experts()
    num_tokens = {"one_token": 1, "no_tokens": 0}.get(case, T)
    x = torch.randn(num_tokens, H, generator=gen)
    logits = torch.randn(num_tokens, 8, generator=gen)
    k = 8 if case == "k_equals_e" else 2
    if case == "one_expert":
        logits[:, 3] += 100.0
        k = 1
    if case == "idle_experts":
        logits[:, 4:] -= 100.0  # experts 4..7 get no token
    weights, ids = select_experts(logits, RouterConfig(8, k, norm_topk_prob=True))
    out = _steps_agree(x, weights, ids, experts)
    assert out.shape == (num_tokens, H)
    if case == "one_expert":
        assert (ids == 3).all()
        torch.testing.assert_close(out, experts[3](x))
    if case == "k_equals_e":
        assert (ids.sort(dim=-1).values == torch.arange(8)).all()
    if case == "idle_experts":
        assert not (ids >= 4).any()


needs_kernels = pytest.mark.skipif(not batch_invariant.available(), reason="batch-invariant kernels not built here")


@needs_kernels
def test_grouped_step_is_bit_identical_alone_and_in_a_batch_of_16_in_deterministic_mode():
    """With the experts' Linears and SiLU on their batch-invariant kernels, a token's output from the grouped step
    is bit-identical alone and among 15 others, and equal to the one-row reference loop."""
    experts = _experts()
    for module in experts.modules():
        if isinstance(module, (Linear, SiluAndMul)):
            module.batch_invariant = True
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(16, H, generator=gen)
    weights, ids = select_experts(torch.randn(16, 8, generator=gen), RouterConfig(8, 3))
    batch = grouped_expert_step(x, weights, ids, experts)
    for t in range(16):
        alone = grouped_expert_step(x[t:t + 1], weights[t:t + 1], ids[t:t + 1], experts)
        assert torch.equal(alone[0], batch[t]), t
    assert torch.equal(batch, reference_expert_step(x, weights, ids, experts))


@needs_kernels
def test_invariant_sigmoid_gives_each_element_the_same_bits_wherever_it_sits():
    """torch.sigmoid runs tail elements through a scalar exp (other bits); the deterministic mode's sigmoid does not."""
    from tokenmill.moe.routing import invariant_sigmoid

    x = torch.randn(37, 1, generator=torch.Generator().manual_seed(7)) * 4
    full = invariant_sigmoid(x)
    assert all(torch.equal(invariant_sigmoid(x[i:i + 1]), full[i:i + 1]) for i in range(37))
    assert all(torch.equal(invariant_sigmoid(x[i:]), full[i:]) for i in range(37))
    torch.testing.assert_close(full, torch.sigmoid(x))
    assert invariant_sigmoid(torch.zeros(1, 1)).item() == 0.5


def test_sparse_layer_mask_follows_each_familys_fields():
    assert sparse_layer_mask(4, 8) == (True,) * 4
    assert sparse_layer_mask(4, 8, mlp_only_layers=[1]) == (True, False, True, True)
    assert sparse_layer_mask(4, 8, decoder_sparse_step=2) == (False, True, False, True)
    assert sparse_layer_mask(5, 8, first_k_dense_replace=2, moe_layer_freq=1) == (False, False, True, True, True)
    assert sparse_layer_mask(3, 0) == (False,) * 3
    with pytest.raises(ValueError, match="mlp_only_layers"):
        sparse_layer_mask(2, 8, mlp_only_layers=[5])


def test_shared_expert_gate_and_expert_load():
    """A block with a gated shared expert adds sigmoid(gate(x)) * shared(x); its tokens per expert are counted
    into the totals and the per-step histogram."""
    config = MoEConfig(RouterConfig(8, 2), H, 16, shared_expert_intermediate_size=24, shared_expert_gate=True)
    load = ExpertLoad(1, 8)
    block = SparseMoeBlock(config, 0, load)
    torch.manual_seed(6)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(T, H)
    weights, ids = block.gate.route(x)
    want = reference_expert_step(x, weights, ids, block.experts)
    want = want + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)
    snap = load.snapshot()
    assert snap.sum == T * 2 and snap.count == 8
    assert snap.tokens_per_expert == tuple(torch.bincount(ids.flatten(), minlength=8).tolist())
    assert snap.buckets[-1] == (float("inf"), 8) and len(snap.buckets) == len(BUCKETS) + 1


# --- tiny models against transformers ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """arch -> (path, transformers model) for the four families."""
    root = tmp_path_factory.mktemp("moe")
    return {arch: (str(root / arch), make_moe_model(arch, root / arch)) for arch in MOE_ARCHS}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_prefill_then_decode_logits_match_transformers(tiny_moe, arch):
    path, hf = tiny_moe[arch]
    loaded = load_model(path, dtype="float32")
    assert type(loaded.model).__name__ == hf.config.architectures[0]
    kv = new_kv_caches(loaded)
    prefill = run_step(loaded, kv, [TOKEN_IDS[:-1]], [0], [BLOCK_IDS[:5]])
    decode = run_step(loaded, kv, [TOKEN_IDS[-1:]], [len(TOKEN_IDS) - 1], [BLOCK_IDS[:5]])
    ref = hf_logits(hf, TOKEN_IDS)
    torch.testing.assert_close(torch.cat([prefill, decode]), ref, rtol=1e-4, atol=1e-4)
    snap = loaded.model.expert_load.snapshot()
    assert snap.sum == len(TOKEN_IDS) * hf.config.num_experts_per_tok * len(snap.layer_imbalance)
    assert len([e for e in snap.tokens_per_expert if e]) >= 4  # the tokens really spread over the experts


def _hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [[(37 * i + 11 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate((9, 41))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_llm_greedy_matches_transformers_with_prefix_caching_and_chunked_prefill(tiny_moe, arch):
    """LLM.generate's greedy tokens equal transformers' per prompt, with chunks of 16 tokens and, on the second
    pass, prompts whose first blocks come from the prefix cache."""
    path, hf = tiny_moe[arch]
    llm = LLM(model=path, dtype="float32", quantization="none", max_num_batched_tokens=16, block_size=4,
              enable_prefix_caching=True, enable_chunked_prefill=True, num_kv_blocks=128)
    try:
        want = [_hf_greedy(hf, p, 6) for p in PROMPTS]
        for _ in range(2):
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
            assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.kv_cache_manager.prefix_cache_hits > 0
        assert max(len(set(w)) for w in want) >= 3
    finally:
        llm.close()


@needs_kernels
def test_deterministic_mode_alone_equals_in_a_batch_of_16(tiny_moe):
    """Deterministic mode: a request's tokens and log-probabilities are bit-identical alone and among 15 others."""
    path, _ = tiny_moe["qwen2_moe"]
    prompts = [[(13 * i + 7 * j) % 30000 + 200 for j in range(5 + 3 * i)] for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    llm = LLM(model=path, dtype="float32", deterministic=True, num_kv_blocks=256)
    try:
        batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for i in (0, 7, 15):
            alone = llm.generate([{"prompt_token_ids": prompts[i]}], params)[0]
            assert alone.outputs[0].token_ids == batch[i].outputs[0].token_ids
            assert alone.outputs[0].logprobs == batch[i].outputs[0].logprobs
    finally:
        llm.close()


def test_preemption_and_speculation_keep_transformers_greedy(tiny_moe):
    """A KV pool too small for the batch (requests preempted and recomputed) and drafts verified in the step (the
    MoE model drafting for itself, so every step verifies drafts: the n-gram proposer's verification path, which a
    random tiny model, never repeating itself, would leave unexercised) still give transformers' greedy tokens."""
    path, hf = tiny_moe["mixtral"]
    # four prompts of 19 tokens + 16 new (9 blocks of 4 each; the pool holds 16): decoding runs out of blocks
    prompts = [[(41 * i + 7 * j) % 30000 + 300 for j in range(19)] for i in range(4)]
    llm = LLM(model=path, dtype="float32", quantization="none", num_kv_blocks=16, block_size=4,
              max_num_batched_tokens=16,
              speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3})
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 16) for p in prompts]
        assert llm.engine.scheduler.num_preemptions_total > 0
        assert llm.engine.speculator.stats.snapshot()["num_accepted_tokens"] > 0
    finally:
        llm.close()


def test_ngram_speculation_keeps_greedy(tiny_moe):
    """n-gram speculation on a MoE model changes no greedy token (prompts that repeat themselves)."""
    path, hf = tiny_moe["qwen3_moe"]
    prompts = [p * 3 for p in PROMPTS]
    llm = LLM(model=path, dtype="float32", quantization="none", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "enable_adaptive_verification": False})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 6) for p in prompts]
    finally:
        llm.close()


# --- LoRA ---------------------------------------------------------------------------------------------------------

def test_attention_lora_matches_peft_and_expert_adapters_are_refused(tiny_moe, tmp_path):
    """An adapter on q/k/v/o of a MoE model gives peft's greedy tokens; one on an expert's projection is refused
    with a ValueError that says so."""
    from peft import LoraConfig, PeftModel, get_peft_model

    path, _ = tiny_moe["qwen3_moe"]
    torch.manual_seed(21)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
                   ).save_pretrained(tmp_path / "attn")
    expert_dir = tmp_path / "expert"
    expert_dir.mkdir()
    (expert_dir / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"]}))
    prefix = "base_model.model.model.layers.1.mlp.experts.0.gate_proj"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(4, 64), f"{prefix}.lora_B.weight": torch.zeros(32, 4)},
              str(expert_dir / "adapter_model.safetensors"))
    llm = LLM(model=path, dtype="float32", quantization="none", enable_lora=True, max_lora_rank=4)
    try:
        attn = LoRARequest("attn", 1, str(tmp_path / "attn"))
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=attn)
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                         str(tmp_path / "attn")).eval()
        assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(peft, p, 6) for p in PROMPTS]
        with pytest.raises(ValueError, match="mixture-of-experts"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY,
                         lora_request=LoRARequest("expert", 2, str(expert_dir)))
    finally:
        llm.close()


# --- metrics through a real server -------------------------------------------------------------------------------

def test_server_exports_expert_load_in_metrics_and_debug_status(tiny_moe, tmp_path):
    """`tokenmill serve` on a MoE model: /metrics has the tokens-per-expert histogram and per-expert counters
    after a request, /debug/status the per-layer summary; a dense model has neither."""
    path, hf = tiny_moe["olmoe"]
    server = ServerProcess(path, ["--dtype", "float32", "--max-model-len", "256"], tmp_path / "server.log")
    try:
        server.wait_healthy()
        response = server.post("/v1/completions", {"prompt": "Hello there, experts", "max_tokens": 4})
        assert response.status_code == 200, response.text
        server.wait_idle()
        metrics = server.metrics()
        count = metrics["tokenmill:moe_expert_tokens_count"]
        assert count > 0 and count % (hf.config.num_experts * hf.config.num_hidden_layers) == 0
        assert metrics["tokenmill:moe_expert_tokens_bucket{le=+Inf}"] == count
        routed = sum(v for k, v in metrics.items() if k.startswith("tokenmill:moe_expert_routed_tokens_total{"))
        assert routed == metrics["tokenmill:moe_expert_tokens_sum"] > 0
        moe = server.get_json("/debug/status")["moe"]
        assert moe["num_experts"] == 8 and moe["num_moe_layers"] == 2
        assert sum(moe["tokens_per_expert"]) == routed
        assert all(x >= 1.0 for x in moe["max_over_mean_per_layer"])
    finally:
        server.stop()
