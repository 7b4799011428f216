"""The fused expert step on CPU (tokenmill/moe/cpu_experts.py, csrc/moe_step.c) against the torch path.

Experts with GGUF blocks in several formats (K-quants, the tiled Q4_0/Q8_0, a gate_up of two formats), float32
and bfloat16, over the routing edge cases: the fused step must give the grouped torch step's bits (and the
per-token reference loop's, where both run the same kernels), with experts over threads or products over
threads, and refuse the steps it does not run.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.gguf_quantizers import quantize
from tests.test_cpu_isa_paths import build_for_isa
from tokenmill import csrc_build
from tokenmill.moe import cpu_experts
from tokenmill.moe.experts import ExpertMLP, grouped_expert_step, reference_expert_step
from tokenmill.quantization.formats import QuantizedTensor
from tokenmill.quantization.gguf_weight import GGUFWeight, dispatch_rows

pytestmark = pytest.mark.skipif(not cpu_experts.available(), reason="no C compiler for the fused expert step")

HIDDEN, INTER, NUM_EXPERTS = 256, 256, 8
# (gate, up, down) formats: K-quants with a gate_up of two formats; the tiled formats (AMX bf16 where present)
FORMATS = {"kquants": (Q.Q4_K, Q.Q6_K, Q.Q5_K), "tiled": (Q.Q4_0, Q.Q4_0, Q.Q8_0)}


def _blocks(w: torch.Tensor, qtype: Q) -> QuantizedTensor:
    return QuantizedTensor(int(qtype), tuple(w.shape), torch.from_numpy(quantize(w.numpy(), qtype)))


def make_experts(formats: tuple[Q, Q, Q], dtype: torch.dtype, seed: int = 0) -> torch.nn.ModuleList:
    """NUM_EXPERTS ExpertMLPs whose weights are GGUF blocks of random normal(0, 0.05) matrices, in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    experts = torch.nn.ModuleList(ExpertMLP(HIDDEN, INTER) for _ in range(NUM_EXPERTS))
    for expert in experts:
        gate, up = (torch.randn(INTER, HIDDEN, generator=gen) * 0.05 for _ in range(2))
        down = torch.randn(HIDDEN, INTER, generator=gen) * 0.05
        expert.gate_up_proj.load_quantized(GGUFWeight([_blocks(gate, formats[0]), _blocks(up, formats[1])]))
        expert.down_proj.load_quantized(_blocks(down, formats[2]))
        expert.to(dtype)
        expert.act_fn.cpu_kernel_table = (True,)  # the plan's C SiLU at every row count
    return experts


def routing(case: str, tokens: int = 24, k: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) for one routing edge case."""
    gen = torch.Generator().manual_seed(seed)
    if case == "one_token":
        tokens = 1
    if case == "k_is_all":
        k = NUM_EXPERTS
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:k] for _ in range(tokens)])
    if case == "all_to_one":
        ids = torch.stack([torch.tensor([5, *[e for e in range(NUM_EXPERTS) if e != 5][:k - 1]])] * tokens)
        ids[:, 0] = 5
    if case == "idle_experts":  # experts 0-3 get no token
        ids = 4 + torch.stack([torch.randperm(4, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen).softmax(-1)
    return weights, ids


CASES = ("random", "one_token", "k_is_all", "all_to_one", "idle_experts")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_fused_step_gives_the_grouped_steps_bits(fmt, dtype, case):
    experts = make_experts(FORMATS[fmt], dtype)
    fused = cpu_experts.FusedExperts.describe(experts, dtype)
    assert not isinstance(fused, str), fused
    weights, ids = routing(case)
    x = (torch.randn(ids.shape[0], HIDDEN, generator=torch.Generator().manual_seed(2)) * 0.5).to(dtype)
    want = grouped_expert_step(x, weights, ids, experts)
    assert torch.equal(want, reference_expert_step(x, weights, ids, experts))  # same kernels, row by row
    for parallel in (True, False, None):
        got = fused(x, weights, ids, expert_parallel=parallel)
        assert got is not None and got.dtype == dtype
        assert torch.equal(got, want), (fmt, case, parallel, (got.float() - want.float()).abs().max())


@pytest.mark.parametrize("isa", csrc_build.ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_every_isa_build_of_the_fused_step_gives_the_grouped_steps_bits(isa, dtype, monkeypatch):
    """moe_step.c has no intrinsics (the products and SiLU it calls carry the ISA path), but each path's build is
    its own compilation: each one this CPU runs gives the grouped steps' bits."""
    lib = build_for_isa(cpu_experts.library.load, isa)
    monkeypatch.setattr(cpu_experts.library, "built", lambda: lib)  # FusedExperts.describe takes this build
    for fmt in sorted(FORMATS):
        experts = make_experts(FORMATS[fmt], dtype)
        fused = cpu_experts.FusedExperts.describe(experts, dtype)
        assert not isinstance(fused, str), fused
        weights, ids = routing("random")
        x = (torch.randn(ids.shape[0], HIDDEN, generator=torch.Generator().manual_seed(2)) * 0.5).to(dtype)
        want = grouped_expert_step(x, weights, ids, experts)
        for parallel in (True, False):  # experts over threads, products over threads
            got = fused(x, weights, ids, expert_parallel=parallel)
            assert got is not None and torch.equal(got, want), (isa, fmt, parallel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_amx_rows_follow_the_plan_table_per_expert(dtype):
    """With the plan's AMX bf16 table on from 4 rows, experts with 4+ rows take the bf16 tiles (where this CPU
    has them) and the others the int8 kernel, in both paths alike; and a verify step's dispatch rows override."""
    experts = make_experts(FORMATS["tiled"], dtype)
    table = (False,) * 4 + (True,)
    for e in experts:
        e.gate_up_proj.quant.amx_bf16_table = table
        e.down_proj.quant.amx_bf16_table = table
    fused = cpu_experts.FusedExperts.describe(experts, dtype)
    weights, ids = routing("random", tokens=12)
    ids[:8, 0] = 2  # expert 2 gets many rows, the others few
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert torch.equal(fused(x, weights, ids), grouped_expert_step(x, weights, ids, experts))
    with dispatch_rows(1):
        assert torch.equal(fused(x, weights, ids), grouped_expert_step(x, weights, ids, experts))


def test_deterministic_mode_runs_the_invariant_kernels_and_a_token_alone_equals_it_in_a_batch():
    experts = make_experts(FORMATS["kquants"], torch.bfloat16)
    for e in experts:
        e.act_fn.cpu_kernel_table = ()  # deterministic mode needs no plan
        for m in (e.gate_up_proj, e.down_proj, e.act_fn):
            m.batch_invariant = True
        e.gate_up_proj.quant.amx_bf16_table = e.down_proj.quant.amx_bf16_table = (True,)  # ignored
    fused = cpu_experts.FusedExperts.describe(experts, torch.bfloat16)
    weights, ids = routing("random", tokens=16)
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    batch = fused(x, weights, ids)
    assert torch.equal(batch, grouped_expert_step(x, weights, ids, experts))
    for t in (0, 7, 15):
        assert torch.equal(fused(x[t:t + 1], weights[t:t + 1], ids[t:t + 1]), batch[t:t + 1])


def test_steps_the_plan_puts_elsewhere_are_refused_and_the_block_falls_back():
    experts = make_experts(FORMATS["kquants"], torch.float32)
    fused = cpu_experts.FusedExperts.describe(experts, torch.float32)
    weights, ids = routing("random")
    x = torch.randn(ids.shape[0], HIDDEN)
    for e in experts:  # dequantize + torch GEMM from 2 rows: a step with an expert of 2+ rows is refused
        e.gate_up_proj.quant.dequantize_table = e.down_proj.quant.dequantize_table = (False, False, True)
    assert fused(x, weights, ids) is None and fused.refused == 1
    one = routing("one_token")
    assert fused(x[:1], *one) is not None  # one row per expert: the kernel
    for e in experts:
        e.gate_up_proj.quant.dequantize_table = e.down_proj.quant.dequantize_table = ()
        e.act_fn.cpu_kernel_table = (False,)  # the plan prefers torch's SiLU: the fused step keeps its C one
    got, want = fused(x, weights, ids), grouped_expert_step(x, weights, ids, experts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for e in experts:
        e.act_fn.cpu_kernel_table = ()  # no plan (--no-cpu-kernels): the torch path
    assert fused(x, weights, ids) is None


def test_what_the_fused_step_cannot_run_is_named():
    dense = torch.nn.ModuleList(ExpertMLP(HIDDEN, INTER) for _ in range(2))
    assert "dense expert weights" in cpu_experts.FusedExperts.describe(dense, torch.float32)
    experts = make_experts(FORMATS["tiled"], torch.float32)
    assert "float32 or bfloat16" in cpu_experts.FusedExperts.describe(experts, torch.float16)
    fused = cpu_experts.FusedExperts.describe(experts, torch.float32)
    weights, ids = routing("random")
    x = torch.randn(ids.shape[0], HIDDEN)
    with pytest.raises(ValueError, match="expert ids outside"):
        fused(x, weights, ids + NUM_EXPERTS)
    with pytest.raises(ValueError, match="model dtype"):
        fused(x.to(torch.bfloat16), weights, ids)


def _dense_routers(llm) -> None:
    """Replace every MoE router's Q8_0 blocks by a dense weight of the model dtype on the C GEMM (as a GGUF file's
    F32 ``ffn_gate_inp`` loads) and install the lean step again: its router then runs the dense C GEMM."""
    from tokenmill.runner.lean_decode import install_lean_decode

    model = llm.engine.runner.model
    dtype = llm.engine.runner.loaded.dtype
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and gate.quant is not None:
            gate.weight = torch.nn.Parameter(gate.quant.dequantize(dtype), requires_grad=False)
            gate.quant = None
            gate.cpu_gemm_table = (True,)
    block_size = model.model.lean_decode._desc.block_size
    assert install_lean_decode(model, dtype, block_size) is None


@pytest.mark.parametrize("arch,router", [("olmoe", "q8_0"), ("qwen2_moe", "q8_0"), ("qwen3_moe", "q8_0"),
                                         ("mixtral", "q8_0"), ("olmoe", "dense"), ("qwen3_moe", "dense")])
def test_moe_models_run_the_lean_step_with_the_module_paths_bits(arch, router, tmp_path):
    """A tiny MoE model with int8 (Q8_0 block) weights: the lean decode step runs its MoE layers in its C call
    (router, C routing, fused experts; qwen2_moe's gated shared expert: the block's module between C ranges)
    and gives the bits of the torch layers running the same kernels (hidden states and KV rows of a decode
    step of 6 sequences), the same greedy tokens and expert-load counts as the torch path with torch's routing
    and grouped step. qwen2_moe keeps a dense MLP layer, qwen3_moe alternates dense and MoE layers, OLMoE
    normalizes the whole q and k projections; "dense": the routers as a GGUF file's F32 router loads."""
    from tests.moe_models import greedy_and_expert_load, make_moe_model
    from tests.test_lean_decode import assert_same_bits, decode_step_both_ways, torch_path_on_c_kernels
    from tokenmill import LLM

    make_moe_model(arch, tmp_path / arch)
    llm = LLM(model=str(tmp_path / arch), quantization="int8", dtype="bfloat16", max_model_len=256,
              kv_cache_memory=0.05)
    try:
        model = llm.engine.runner.model
        if router == "dense":
            _dense_routers(llm)
        lean = model.model.lean_decode
        assert lean is not None, "the lean step is not installed"
        blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
        assert blocks
        torch_path_on_c_kernels(model)
        moe_steps = lean.moe_steps
        assert_same_bits(*decode_step_both_ways(llm, [3, 9, 17, 30, 5, 12], seed=2))
        in_c = arch != "qwen2_moe"  # a gated shared expert: its blocks run as modules
        assert (lean.moe_steps > moe_steps) == in_c
        steps = lean.steps
        fast, fast_load = greedy_and_expert_load(llm)
        assert lean.steps > steps
        assert all(isinstance(b.cpu_fused, cpu_experts.FusedExperts) for b in blocks)
        if not in_c:
            assert all(b.cpu_fused.calls > b.cpu_fused.refused for b in blocks)
        lean.enabled = False
        for b in blocks:
            b.use_cpu_fused = False  # torch's routing and the grouped step
        torch_path, torch_load = greedy_and_expert_load(llm)
        assert fast == torch_path
        # the expert-load metrics count the same tokens per expert whichever path ran the blocks
        assert fast_load.tokens_per_expert == torch_load.tokens_per_expert
        assert fast_load.sum > 0
    finally:
        llm.engine.close()


def test_mismatched_shapes_are_refused_before_the_c_step():
    experts = make_experts(FORMATS["tiled"], torch.float32)
    fused = cpu_experts.FusedExperts.describe(experts, torch.float32)
    weights, ids = routing("random", tokens=4)
    with pytest.raises(ValueError, match="T = 2"):
        fused(torch.randn(2, HIDDEN), weights, ids)
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        fused(torch.randn(4, HIDDEN), weights[:, :2], ids)


@pytest.mark.parametrize("rule", ["softmax_topk", "renormalized", "softmax_after_topk"])
def test_c_routing_is_select_experts_up_to_float_rounding_with_ties_to_the_lowest_index(rule):
    from tokenmill.moe.routing import RouterConfig, select_experts

    config = RouterConfig(num_experts=16, top_k=4, norm_topk_prob=rule == "renormalized",
                          softmax_after_topk=rule == "softmax_after_topk")
    assert cpu_experts.c_routable(config)
    logits = torch.randn(40, 16, generator=torch.Generator().manual_seed(5)) * 3
    logits[3] = 1.0  # every expert tied: the four lowest indexes, in order
    logits[7, [2, 9, 11]] = 20.0  # a tie at the top
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        got_w, got_ids = cpu_experts.route(x, config)
        want_w, want_ids = select_experts(x, config)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, rtol=2e-6, atol=1e-7)
    assert got_ids[3].tolist() == [0, 1, 2, 3] and got_ids[7, :3].tolist() == [2, 9, 11]
    from tokenmill.moe.routing import RouterConfig as RC

    assert not cpu_experts.c_routable(RC(num_experts=16, top_k=2, scoring="sigmoid", correction_bias=True,
                                         norm_topk_prob=True))
