"""DeepSeek (multi-head latent attention) in the lean decode step: tiny V2 / V3 models with int8 (Q8_0 block)
weights run decode and mixed steps in one C call (csrc/lean_decode.c's MLA block: q / kv_a products, latent
norm, RoPE on the rope parts, the absorbed per-head products, paged attention over the one-plane cache) and give
the bits of the torch layers running the same kernels; V2 with greedy softmax routing (V2-Lite's rule) also runs
its MoE blocks there (float32 router, C routing, fused experts, the shared expert), V3's sigmoid routing leaves
its blocks to their modules between C ranges. Greedy tokens and expert-load counts equal the torch path's.
"""
from __future__ import annotations

import pytest

from tests.deepseek_models import make_deepseek_model
from tests.moe_models import greedy_and_expert_load
from tests.test_lean_decode import assert_same_bits, decode_step_both_ways, step_both_ways, torch_path_on_c_kernels
from tokenmill import LLM, SamplingParams
from tokenmill.layers import batch_invariant
from tokenmill.moe import cpu_experts

pytestmark = pytest.mark.skipif(not (batch_invariant.available() and cpu_experts.library.available()),
                                reason="C kernels not built here")

# V2-Lite's routing (greedy softmax top-k, no scaling): c_routable, so its blocks run in the C step
_V2_LITE = dict(topk_method="greedy", routed_scaling_factor=1.0, n_group=1, topk_group=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_lean")
    make_deepseek_model("deepseek_v2", root / "v2", **_V2_LITE)
    make_deepseek_model("deepseek_v3", root / "v3", q_lora_rank=32)  # Q8_0 blocks need K % 32 == 0
    return {"v2": root / "v2", "v3": root / "v3"}


@pytest.mark.parametrize("arch", ["v2", "v3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_latent_attention_runs_in_the_lean_step_with_the_module_paths_bits(models, arch, dtype):
    llm = LLM(model=str(models[arch]), quantization="int8", dtype=dtype, max_model_len=256, kv_cache_memory=0.05)
    try:
        model = llm.engine.runner.model
        lean = model.model.lean_decode
        assert lean is not None, llm.engine.runner.kernel_choice
        assert lean._desc.mla == 1
        torch_path_on_c_kernels(model)
        moe_steps = lean.moe_steps
        assert_same_bits(*decode_step_both_ways(llm, [3, 9, 17, 30, 5, 12], seed=2))
        assert (lean.moe_steps > moe_steps) == (arch == "v2")  # V3's sigmoid routing: the blocks' modules
        # a mixed step: prompt chunks (one on a cached prefix) beside decode queries
        mixed = lean.mixed_steps
        assert_same_bits(*step_both_ways(llm, [0, 7, 20, 4], [9, 1, 5, 1], seed=3))
        assert lean.mixed_steps > mixed
        steps = lean.steps
        fast, fast_load = greedy_and_expert_load(llm, max_tokens=10)
        assert lean.steps > steps
        lean.enabled = False
        slow, slow_load = greedy_and_expert_load(llm, max_tokens=10)
        assert fast == slow
        assert fast_load.tokens_per_expert == slow_load.tokens_per_expert
    finally:
        llm.engine.close()


def test_ngram_speculation_and_prefix_caching_keep_the_lean_steps_tokens(models):
    """n-gram speculation (its verify steps run in the lean step, a row per proposed token) and prefix caching on
    a DeepSeek model with latent attention in C: the same greedy tokens as plain decoding."""
    prompts = [{"prompt_token_ids": [7 + i, 300, 41, 9, 300, 41, 9, 300, 41] * 2} for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    common = dict(model=str(models["v2"]), quantization="int8", dtype="float32", max_model_len=256,
                  kv_cache_memory=0.05)
    plain = LLM(**common, enable_prefix_caching=False)
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        assert plain.engine.runner.model.model.lean_decode.steps > 0
    finally:
        plain.engine.close()
    spec = LLM(**common, enable_prefix_caching=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "enable_adaptive_verification": False})
    try:
        lean = spec.engine.runner.model.model.lean_decode
        for _ in range(2):  # the second pass hits the prefix cache
            got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
            assert got == want
        assert lean.steps > 0 and spec.engine.speculator.stats.snapshot()["num_draft_tokens"] > 0  # verified drafts
    finally:
        spec.engine.close()
