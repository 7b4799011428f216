"""Default-mode CPU kernels (tokenmill.runner.cpu_kernels): small linears, RMSNorm and SiLU×up run in
the compiled C kernels. Checked on the embedded SmolLM2 in bfloat16 against transformers on the same
GGUF weights, and layer by layer against the torch paths they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.layers import batch_invariant, silu_and_mul_kernel
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import Linear
from tokenmill.models.default_model import default_model_path
from tokenmill.runner.cpu_kernels import CPU_GEMM_MAX_ROWS

pytestmark = pytest.mark.skipif(
    not (batch_invariant.available() and silu_and_mul_kernel.available()), reason="C kernels unavailable"
)

CHATS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
         "Explain what a hash table is in two sentences.", "List three colours of the rainbow.",
         "Why is the sky blue?", "Name a prime number larger than 100."]
NEW_TOKENS = 24


def layers(llm: LLM) -> list:
    return list(llm.engine.runner.model.modules())


@pytest.mark.parametrize("dtype, max_rows", [("bfloat16", CPU_GEMM_MAX_ROWS[torch.bfloat16]),
                                             ("float32", CPU_GEMM_MAX_ROWS[torch.float32])])
def test_default_cpu_runner_switches_every_layer(tmp_path, dtype, max_rows):
    llm = LLM(model=str(make_tiny_model("qwen3", tmp_path)), dtype=dtype, num_kv_blocks=16)
    modules = layers(llm)
    linears = [m for m in modules if isinstance(m, Linear)]
    elementwise = [m for m in modules if isinstance(m, (RMSNorm, SiluAndMul))]
    assert linears and elementwise
    assert all(m.cpu_gemm_max_rows == max_rows and not m.batch_invariant for m in linears)
    assert all(m.use_cpu_kernel and not m.batch_invariant for m in elementwise)


def test_deterministic_mode_keeps_its_own_kernels(tmp_path):
    llm = LLM(model=str(make_tiny_model("llama", tmp_path)), dtype="bfloat16", num_kv_blocks=16, deterministic=True)
    modules = [m for m in layers(llm) if isinstance(m, (Linear, RMSNorm, SiluAndMul))]
    assert all(m.batch_invariant for m in modules)
    assert not any(getattr(m, "cpu_gemm_max_rows", 0) or getattr(m, "use_cpu_kernel", False) for m in modules)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 33, 300])
def test_switched_layers_match_the_torch_layers(dtype, rows):
    torch.manual_seed(rows)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    linear = Linear(576, 960)
    linear.weight.data = (torch.randn(960, 576) / 24).to(dtype)
    x = torch.randn(rows, 576, dtype=dtype)
    expected = F.linear(x.float(), linear.weight.float())
    linear.cpu_gemm_max_rows = CPU_GEMM_MAX_ROWS[dtype]
    torch.testing.assert_close(linear(x).float(), expected, atol=tol, rtol=tol)
    norm = RMSNorm(576, eps=1e-5)
    norm.weight.data = (1 + torch.randn(576) / 4).to(dtype)
    reference = norm(x)
    norm.use_cpu_kernel = True
    torch.testing.assert_close(norm(x), reference, atol=tol, rtol=tol)
    act = SiluAndMul()
    gate_up = torch.randn(rows, 2 * 1536, dtype=dtype)
    reference = act(gate_up)
    act.use_cpu_kernel = True
    torch.testing.assert_close(act(gate_up), reference, atol=tol, rtol=tol)


@torch.inference_mode()
def test_bfloat16_smollm2_matches_transformers_bfloat16():
    """Six chats decoded together (decode steps of 6 rows and prompt chunks under 256 rows go through the
    C kernels): each generated token's log-probability equals transformers' (same GGUF, bf16,
    teacher-forced) within bf16 noise, and greedy tokens equal transformers' argmax wherever its top
    two candidates are not near-tied."""
    llm = LLM(dtype="bfloat16", max_model_len=512, kv_cache_memory=0.1)
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16).eval()
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
            if top2[0] - top2[1] > 0.25:  # clear winner: greedy must pick it
                assert token == ref[step].argmax().item(), (conv, step)
    print(f"largest |logprob - transformers| over {len(CHATS)} x {NEW_TOKENS} tokens: {worst:.4f}")
    assert worst < 0.25, worst
