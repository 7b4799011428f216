"""Default-mode CPU kernels (tokenmill.runner.cpu_kernels): linears, RMSNorm, SiLU×up and decode
attention run in the compiled C kernels where a measurement says they beat torch on this CPU, and
the LM head always in the C GEMM with float32 logits. Checked on the embedded SmolLM2 in bfloat16
against transformers on the same GGUF weights, and layer by layer against the torch paths they
replace."""
from __future__ import annotations

import concurrent.futures
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.attention.layer import Attention
from tokenmill.layers import batch_invariant, silu_and_mul_kernel
from tokenmill.layers import linear as linear_module
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import Linear
from tokenmill.runner.cpu_kernels import ROW_LADDER, KernelPlan, apply_plan, row_table

pytestmark = pytest.mark.skipif(
    not (batch_invariant.available() and silu_and_mul_kernel.available()), reason="C kernels unavailable"
)

CHATS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
         "Explain what a hash table is in two sentences.", "List three colours of the rainbow.",
         "Why is the sky blue?", "Name a prime number larger than 100."]
NEW_TOKENS = 24


def layers(llm: LLM) -> list:
    return list(llm.engine.runner.model.modules())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_cpu_runner_applies_the_measured_plan(tmp_path, monkeypatch, dtype):
    """Every layer follows the plan the runner measured (or read back from its cache: the second
    engine must not measure again), and the LM head runs the C GEMM with float32 logits."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    model = str(make_tiny_model("qwen3", tmp_path))
    first = LLM(model=model, dtype=dtype, num_kv_blocks=16)
    second = LLM(model=model, dtype=dtype, num_kv_blocks=16)
    assert "measured" in first.engine.runner.kernel_choice and "cache" in second.engine.runner.kernel_choice
    assert first.engine.runner.kernel_choice.replace("measured", "cache") == second.engine.runner.kernel_choice
    assert len(list((tmp_path / "cache" / "kernels" / "dispatch").glob("*.json"))) == 1
    runner = second.engine.runner
    plan = runner.kernel_plan
    assert plan.isa == batch_invariant.isa() and plan.dtype == dtype and plan.source == "cache"
    modules, lm_head = layers(second), runner.model.lm_head
    gemm, rms, silu = row_table(plan.gemm), row_table(plan.rms_norm), row_table(plan.silu_and_mul)
    assert len(gemm) == ROW_LADDER[-1] + 1
    assert all(m.cpu_gemm_table == gemm and not m.batch_invariant for m in modules if isinstance(m, Linear))
    assert all(m.cpu_kernel_table == rms for m in modules if isinstance(m, RMSNorm))
    assert all(m.cpu_kernel_table == silu for m in modules if isinstance(m, SiluAndMul))
    assert all(m.cpu_decode_kernel == plan.paged_decode for m in modules if isinstance(m, Attention))
    assert all(m.cpu_prefill_kernel == plan.prefill_attention for m in modules if isinstance(m, Attention))
    assert lm_head.float32_logits_kernel == plan.logits
    assert not any(m.float32_logits_kernel for m in modules if isinstance(m, Linear) and m is not lm_head)
    if dtype == "float32":
        assert not plan.logits and "LM head as GEMM" in runner.kernel_choice
    else:
        assert f"LM head {'C' if plan.logits else 'torch'}, float32 logits" in runner.kernel_choice


def test_a_damaged_plan_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    model = str(make_tiny_model("llama", tmp_path))
    LLM(model=model, dtype="float32", num_kv_blocks=16)
    (cached,) = (tmp_path / "cache" / "kernels" / "dispatch").glob("*.json")
    for damage in ("null", "[1, 2]", '{"isa": "avx2"}', cached.read_text().replace("true", "1"), "{"):
        cached.write_text(damage)
        llm = LLM(model=model, dtype="float32", num_kv_blocks=16)
        assert llm.engine.runner.kernel_plan.source == "measured", damage


def test_engines_started_together_share_one_measured_plan(tmp_path, monkeypatch):
    # Two engines planning at once (a server and an offline engine, replicas): one measures, the other
    # waits on the lock and reads its file, so both run the same kernels and give the same bits.
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    model = str(make_tiny_model("llama", tmp_path))
    LLM(model=model, dtype="bfloat16", num_kv_blocks=16)  # builds the kernels (and plans bf16) first
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        plans = list(pool.map(lambda _: LLM(model=model, dtype="float32", num_kv_blocks=16).engine.runner.kernel_plan,
                              range(2)))
    assert sorted(p.source for p in plans) == ["cache", "measured"]
    assert replace(plans[0], source="") == replace(plans[1], source="")


def test_no_cpu_kernels_puts_every_layer_on_torch(tmp_path):
    llm = LLM(model=str(make_tiny_model("llama", tmp_path)), dtype="bfloat16", num_kv_blocks=16, cpu_kernels=False)
    modules = layers(llm)
    assert not any(m.cpu_gemm_table or m.float32_logits_kernel for m in modules if isinstance(m, Linear))
    assert not any(m.cpu_kernel_table for m in modules if isinstance(m, (RMSNorm, SiluAndMul)))
    assert not any(m.cpu_decode_kernel for m in modules if isinstance(m, Attention))
    assert llm.engine.runner.kernel_choice == "torch ops (C kernels off)"
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_deterministic_mode_keeps_its_own_kernels(tmp_path):
    llm = LLM(model=str(make_tiny_model("llama", tmp_path)), dtype="bfloat16", num_kv_blocks=16, deterministic=True)
    modules = [m for m in layers(llm) if isinstance(m, (Linear, RMSNorm, SiluAndMul))]
    assert all(m.batch_invariant for m in modules)
    assert not any(getattr(m, "cpu_gemm_table", ()) or getattr(m, "cpu_kernel_table", ()) for m in modules)
    assert llm.engine.runner.kernel_choice.startswith("deterministic") and batch_invariant.isa() in (
        llm.engine.runner.kernel_choice)


def test_plan_tables_follow_the_ladder(monkeypatch):
    """A call with M rows follows the smallest ladder point >= M; rows past the ladder the last point."""
    decisions = tuple(point <= 16 for point in ROW_LADDER)  # C up to 16 rows
    table = row_table(decisions)
    assert table[1] and table[16] and not table[17] and not table[-1]
    plan = KernelPlan(isa="avx2", dtype="float32", gemm=decisions, rms_norm=(True,) * len(ROW_LADDER),
                      silu_and_mul=(False,) * len(ROW_LADDER), paged_decode=True, logits=False, source="measured")
    text = plan.describe()
    assert "GEMM C at 1-16 rows, torch otherwise" in text and "RMSNorm C," in text and "SiLU×up torch" in text
    linear = Linear(8, 4)
    apply_plan(linear, plan)
    linear.weight.data = torch.randn(4, 8)
    calls = []
    real = linear_module.bi_linear
    monkeypatch.setattr(linear_module, "bi_linear", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    for rows, expect_c in ((1, True), (16, True), (17, False), (300, False)):
        calls.clear()
        x = torch.randn(rows, 8)
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight), rtol=1e-5, atol=1e-5)
        assert bool(calls) == expect_c, rows


def test_amx_bf16_ladders_reach_the_layers_and_never_below_16_rows():
    """The plan's AMX bf16 ladders become per-row tables on the quantized layers (the LM head its own):
    the 16-row decision covers 16 rows but not the 9-15 rows it was never timed at; the describe line says so."""
    from tokenmill.quantization import QuantizedTensor
    from tokenmill.quantization.gguf_weight import GGUFWeight
    from tokenmill.runner.cpu_kernels import _amx_table

    layers_ladder = tuple(point >= 16 for point in ROW_LADDER)
    head_ladder = tuple(point >= 64 for point in ROW_LADDER)
    table = _amx_table(layers_ladder)
    assert not any(table[:16]) and all(table[16:]) and len(table) == ROW_LADDER[-1] + 1
    assert _amx_table((False,) * len(ROW_LADDER)) == ()
    plan = KernelPlan(isa="avx512_bf16", dtype="bfloat16", amx_bf16=layers_ladder, amx_bf16_logits=head_ladder,
                      source="measured")
    assert "AMX bf16 products from 16 rows" in plan.describe() and "LM head on AMX bf16 from 64 rows" in plan.describe()
    model = torch.nn.ModuleDict({"layer": Linear(32, 16), "head": Linear(32, 16)})
    for m in model.values():
        m.quant = GGUFWeight([QuantizedTensor(8, (16, 32), torch.zeros(16, 34, dtype=torch.uint8))])
    apply_plan(model, plan, lm_head=model["head"])
    assert model["layer"].quant.amx_bf16_table == table
    assert model["head"].quant.amx_bf16_table == _amx_table(head_ladder)
    assert not model["head"].quant.amx_bf16_table[32] and model["head"].quant.amx_bf16_table[33]  # point 64: 33-64
    apply_plan(model, KernelPlan(isa=None), lm_head=model["head"])
    assert model["layer"].quant.amx_bf16_table == () and model["head"].quant.amx_bf16_table == ()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 33, 300])
def test_switched_layers_match_the_torch_layers(dtype, rows):
    torch.manual_seed(rows)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    always = (True,) * (ROW_LADDER[-1] + 1)
    linear = Linear(576, 960)
    linear.weight.data = (torch.randn(960, 576) / 24).to(dtype)
    x = torch.randn(rows, 576, dtype=dtype)
    expected = F.linear(x.float(), linear.weight.float())
    linear.cpu_gemm_table = always
    torch.testing.assert_close(linear(x).float(), expected, atol=tol, rtol=tol)
    # float32 logits: the unrounded float32 sums, whichever path computes them
    torch.testing.assert_close(linear.forward_float32(x), expected, atol=1e-4, rtol=1e-4)
    linear.float32_logits_kernel = True
    torch.testing.assert_close(linear.forward_float32(x), expected, atol=1e-4, rtol=1e-4)
    norm = RMSNorm(576, eps=1e-5)
    norm.weight.data = (1 + torch.randn(576) / 4).to(dtype)
    reference = norm(x)
    norm.cpu_kernel_table = always
    torch.testing.assert_close(norm(x), reference, atol=tol, rtol=tol)
    act = SiluAndMul()
    gate_up = torch.randn(rows, 2 * 1536, dtype=dtype)
    reference = act(gate_up)
    act.cpu_kernel_table = always
    torch.testing.assert_close(act(gate_up), reference, atol=tol, rtol=tol)


@torch.inference_mode()
def test_bfloat16_smollm2_matches_transformers(hf_smollm2):
    """Six chats decoded together in bfloat16: each generated token's log-probability equals
    transformers' float32 one (same GGUF, teacher-forced) within bf16 noise, and greedy tokens equal
    transformers' argmax wherever its float32 logits give a clear winner. Clarity is judged on the
    float32 reference (its top-2 gap > 0.5, twice the bf16 log-probability tolerance) because bf16
    logits would turn near-ties into exact ties that land differently on each machine."""
    llm = LLM(dtype="bfloat16", max_model_len=512, kv_cache_memory=0.1, quantization="none")
    hf = hf_smollm2
    conversations = [[{"role": "user", "content": c}] for c in CHATS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    worst = 0.0
    for conv, out in zip(conversations, llm.chat(conversations, params)):
        prompt, generated = llm.apply_chat_template(conv), out.outputs[0].token_ids
        logits = hf(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1].float()  # (NEW_TOKENS, V)
        ref = torch.log_softmax(logits, dim=-1)
        for step, token in enumerate(generated):
            ours = out.outputs[0].logprobs[step][token].logprob
            worst = max(worst, abs(ours - ref[step, token].item()))
            top2 = ref[step].topk(2).values
            if top2[0] - top2[1] > 0.5:  # clear winner in float32: greedy must pick it
                assert token == ref[step].argmax().item(), (conv, step)
    print(f"largest |logprob - transformers| over {len(CHATS)} x {NEW_TOKENS} tokens: {worst:.4f}")
    assert worst < 0.25, worst
