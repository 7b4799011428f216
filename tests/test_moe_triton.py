"""The Triton grouped expert kernels (moe/triton_experts.py) against the per-token reference and the CPU grouped step.

fp32 and bf16 over random routing, every token on one expert (segments longer than a row tile), idle experts,
k = number of experts, a single token, exact router ties and an empty batch, with hidden and intermediate widths
that are not multiples of the tiles; the row-tile bound every routing fits; weights stacked as views (no copy) and
quantized or unsupported weights refused; a tiny Mixtral through the CUDA runner (Triton attention and experts)
giving the CPU runner's tokens; the kernels compiled for sm_90 without a GPU. On CPU triton's interpreter runs
the kernels (TRITON_INTERPRET=1 is set before triton is imported; if triton was imported earlier in this process,
the tests rerun this file in a fresh interpreter). Nothing here has run on a GPU.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported; process-wide, harmless on CPU

triton_language = pytest.importorskip("triton.language")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from tests.triton_interpreter import rerun_in_interpreter  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.moe import (ExpertMLP, RouterConfig, SparseMoeBlock, grouped_expert_step,  # noqa: E402
                           reference_expert_step, select_experts)
from tokenmill.moe.experts import stack_expert_weights  # noqa: E402
from tokenmill.quantization.int8 import quantize_linears_int8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNNABLE = DEVICE == "cuda" or isinstance(triton_language.cdiv, InterpretedFunction)
needs_kernels = pytest.mark.skipif(not RUNNABLE, reason="triton imported before TRITON_INTERPRET=1: see the fresh run")

E, H, INTER, T = 8, 40, 24, 24  # experts, hidden, intermediate (neither a power of two), tokens


@pytest.mark.skipif(RUNNABLE, reason="the tests run in this process")
def test_in_fresh_interpreter():
    rerun_in_interpreter(__file__)


def _experts(dtype: torch.dtype, seed: int = 0) -> torch.nn.ModuleList:
    gen = torch.Generator().manual_seed(seed)
    experts = torch.nn.ModuleList(ExpertMLP(H, INTER) for _ in range(E))
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return experts.to(dtype=dtype, device=DEVICE)


def _routing(case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T', H] float32, weights [T', k], ids [T', k]) of one edge case."""
    gen = torch.Generator().manual_seed(4)
    num_tokens = {"one_token": 1, "no_tokens": 0}.get(case, T)
    x = torch.randn(num_tokens, H, generator=gen)
    logits = torch.randn(num_tokens, E, generator=gen)
    k = E if case == "k_equals_e" else 2
    if case == "one_expert":
        logits[:, 3] += 100.0
        k = 1
    if case == "idle_experts":
        logits[:, 4:] -= 100.0  # experts 4..7 get no token
    if case == "ties":
        logits[:, [1, 5, 6]] = 2.5  # a three-way tie at the top: the two lowest indices win, whatever the token
    weights, ids = select_experts(logits, RouterConfig(E, k, norm_topk_prob=True))
    if case == "one_expert":
        assert (ids == 3).all()
    if case == "idle_experts":
        assert not (ids >= 4).any()
    if case == "ties":
        assert (ids == torch.tensor([1, 5])).all()
    if case == "k_equals_e":
        assert (ids.sort(dim=-1).values == torch.arange(E)).all()
    return x, weights, ids


CASES = ["random", "one_expert", "idle_experts", "k_equals_e", "one_token", "ties", "no_tokens"]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_the_reference_loop_and_the_grouped_step(case, dtype):
    """The Triton step (align, gate_up + SiLU×up, down, rank-order combine) equals the per-token reference loop and
    the CPU grouped step: to float32 rounding in fp32, to one bf16 step in bf16."""
    from tokenmill.moe.triton_experts import triton_grouped_expert_step

    experts = _experts(dtype)
    x, weights, ids = _routing(case)
    x, weights, ids = x.to(DEVICE, dtype), weights.to(DEVICE), ids.to(DEVICE)
    reference = reference_expert_step(x.cpu(), weights.cpu(), ids.cpu(), experts.cpu())
    grouped = grouped_expert_step(x.cpu(), weights.cpu(), ids.cpu(), experts.cpu())
    experts.to(DEVICE)
    w_gate_up, w_down = stack_expert_weights(experts)
    got = triton_grouped_expert_step(x, weights, ids, w_gate_up, w_down).cpu()
    assert got.shape == (x.shape[0], H) and got.dtype == dtype
    # bf16: the same roundings as the torch layers (to nearest even), only the sums' order differs: one bf16 step
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(got, reference, **tol)
    torch.testing.assert_close(got, grouped, **tol)
    if case == "one_expert":  # every token on expert 3 with weight 1: that expert's MLP itself
        torch.testing.assert_close(got, experts[3].cpu()(x.cpu()), **tol)


@needs_kernels
def test_an_expert_alone_is_the_same_whatever_else_is_in_the_batch():
    """A token's output does not depend on which other tokens share the step (float32): the first 5 tokens'
    rows equal the same 5 tokens run alone, though the segments and tiles differ."""
    from tokenmill.moe.triton_experts import triton_grouped_expert_step

    experts = _experts(torch.float32, seed=2)
    w_gate_up, w_down = stack_expert_weights(experts)
    x, weights, ids = (t.to(DEVICE) for t in _routing("random"))
    full = triton_grouped_expert_step(x, weights, ids, w_gate_up, w_down)
    alone = triton_grouped_expert_step(x[:5], weights[:5], ids[:5], w_gate_up, w_down)
    torch.testing.assert_close(full[:5], alone, rtol=1e-6, atol=1e-6)


def test_row_tile_bound_fits_every_routing():
    """max_row_tiles (the fixed grid a CUDA graph captures) is at least the tiles of any split of the pairs over the
    experts, including the worst ones (every expert one row past a tile boundary)."""
    from tokenmill.moe.triton_experts import max_row_tiles

    rng = random.Random(0)
    for _ in range(2000):
        experts, block_m = rng.choice([2, 8, 64, 256]), rng.choice([16, 32, 64])
        pairs = rng.randrange(1, 600)
        counts = [0] * experts
        for _ in range(pairs):
            counts[rng.randrange(experts)] += 1
        assert sum(-(-n // block_m) for n in counts) <= max_row_tiles(pairs, experts, block_m)
    for experts, block_m in ((8, 16), (64, 16), (256, 64)):  # adversarial: block_m + 1 rows on as many as fit
        pairs = experts * (block_m + 1)
        assert experts * 2 <= max_row_tiles(pairs, experts, block_m)


def test_stacking_makes_the_experts_views_and_refuses_what_the_kernels_cannot_take():
    experts = _experts(torch.float32)
    before = [m.gate_up_proj.weight.clone() for m in experts]
    w_gate_up, w_down = stack_expert_weights(experts)
    assert w_gate_up.shape == (E, 2 * INTER, H) and w_down.shape == (E, H, INTER)
    for e, module in enumerate(experts):
        assert module.gate_up_proj.weight.data_ptr() == w_gate_up[e].data_ptr()  # a view: no second copy
        assert module.down_proj.weight.data_ptr() == w_down[e].data_ptr()
        assert torch.equal(module.gate_up_proj.weight, before[e])

    quantized = torch.nn.ModuleList(ExpertMLP(32, 32) for _ in range(2))
    for p in quantized.parameters():
        torch.nn.init.normal_(p)
    assert quantize_linears_int8(quantized) == 4
    with pytest.raises(ValueError, match="quantized"):
        stack_expert_weights(quantized)
    with pytest.raises(ValueError, match="bf16 / fp16 / fp32"):
        stack_expert_weights(_experts(torch.float64))


@needs_kernels
def test_kernel_refuses_mixed_dtypes_and_bad_shapes():
    from tokenmill.moe.triton_experts import triton_grouped_expert_step

    w_gate_up, w_down = stack_expert_weights(_experts(torch.float32))
    x, weights, ids = (t.to(DEVICE) for t in _routing("random"))
    with pytest.raises(ValueError, match="dtype"):
        triton_grouped_expert_step(x.bfloat16(), weights, ids, w_gate_up, w_down)
    with pytest.raises(ValueError, match="shapes"):
        triton_grouped_expert_step(x[:, :32], weights, ids, w_gate_up, w_down)


@needs_kernels
@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the compiled kernels are tested")
def test_tiny_mixtral_through_the_cuda_runner_equals_the_cpu_runner(tmp_path):
    """A tiny Mixtral (8 experts, top-2) served by the CUDA runner on CPU with every Triton kernel (attention,
    elementwise, the grouped experts) gives the CPU runner's greedy tokens, prefill and padded decode steps."""
    from tests.moe_models import make_moe_model  # the SmolLM2 tokenizer: not on the GPU machine
    from tokenmill.runner.cuda_runner import CudaModelRunner

    path = tmp_path / "mixtral"
    make_moe_model("mixtral", path, max_position_embeddings=64)
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(n)]} for n in (3, 21, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kwargs = dict(model=str(path), dtype="float32", device="cpu", num_kv_blocks=32, block_size=8,
                  max_num_batched_tokens=32, max_num_seqs=4)
    want = LLM(**kwargs).generate(prompts, params)

    llm = LLM(**kwargs)
    engine = llm.engine
    runner = CudaModelRunner(engine.loaded, engine.config.cache, engine.scheduler_config)  # triton backend
    engine.runner = runner
    blocks = [m for m in engine.loaded.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.use_triton and b._stacked is not None for b in blocks)  # stacked by the runner
    got = llm.generate(prompts, params)

    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert runner.num_padded_decode_steps > 0 and runner.num_general_steps > 0
    assert max(len(set(o.outputs[0].token_ids)) for o in want) >= 2
    engine.check_integrity()


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenmill.moe import triton_experts as k

def build(fn, types, constexprs, **options):
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options)

io = {name: "*bf16" for name in ("x_ptr", "w_ptr", "h_ptr", "out_ptr")}
io |= {name: "*i64" for name in ("expert_ids_ptr", "row_ends_ptr", "counts_ptr", "sorted_slot_ptr",
                                 "tile_expert_ptr", "tile_ends_ptr")}
build(k.align_kernel, io, dict(BLOCK=1024), num_warps=4)
for block_m in (16, 64):
    tiles = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, DOT_F32=False, DOT_PRECISION="tf32", RTNE_BY_HAND=False)
    build(k.gate_up_kernel, io, tiles, num_warps=4)
    build(k.down_kernel, io, tiles, num_warps=4)
"""


def test_kernels_compile_for_hopper():
    """Compiled-mode code generation (not the interpreter) for sm_90, bf16: catches what only a GPU run would
    otherwise show. Runs without a GPU (ptxas ships with triton)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
