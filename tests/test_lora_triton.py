"""The Triton LoRA shrink/expand kernels against the per-token reference and the CPU grouped path.

A grid of slot counts, per-slot ranks, n = 1 and n = 3 output slices, in/out widths that are not
multiples of the tiles, mixed base/adapter batches, one-adapter steps, empty segments and split-K
partial sums; base-model rows are untouched bit for bit; slot weights past a slot's rank are never
read; the Linear hook takes the Triton path when asked; the CUDA runner serves two adapters and the
base model with the tokens of the CPU runner. On a CUDA machine the compiled kernels run; elsewhere
triton's interpreter runs them on CPU (TRITON_INTERPRET=1 is set before triton is imported; if
triton was imported earlier in this process, the tests rerun this file in a fresh interpreter).
"""
from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported; process-wide, harmless on CPU

triton_language = pytest.importorskip("triton.language")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from tests.triton_interpreter import rerun_in_interpreter  # noqa: E402
from tests.test_lora_ops import MODULE, packed_slots, random_adapter, slices_of, slot_weights  # noqa: E402
from tokenmill.layers.linear import MergedLinear  # noqa: E402
from tokenmill.lora.mapping import LoRAMapping, build_lora_mapping  # noqa: E402
from tokenmill.lora.ops import add_lora, add_lora_reference, slot_operands  # noqa: E402
from tokenmill.lora.triton_ops import add_lora_triton, lora_shrink  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNNABLE = DEVICE == "cuda" or isinstance(triton_language.cdiv, InterpretedFunction)
needs_kernels = pytest.mark.skipif(not RUNNABLE, reason="triton imported before TRITON_INTERPRET=1: see the fresh run")


@pytest.mark.skipif(RUNNABLE, reason="the tests run in this process")
def test_in_fresh_interpreter():
    rerun_in_interpreter(__file__)


def exact_delta_rows(y, x, slots, mapping: LoRAMapping) -> tuple[torch.Tensor, torch.Tensor]:
    """y + every mapped token's delta in float64 from the slots' own (rounded) weights, and the
    magnitude sum |x·A| · |B| per element (the scale of the rounding of h), both [T, out]."""
    a64, b64 = slots.lora_a[(0, MODULE)].double(), slots.lora_b[(0, MODULE)].double()
    exact, scale = y.double().clone(), torch.zeros(y.shape, dtype=torch.float64)
    for slot, start, end in mapping.segments:
        a, b = slot_operands(a64, b64, slot, slots.ranks[slot])  # (r * n, in), (out, r * n)
        rows = mapping.token_indices[start:end].cpu()
        h = x.double().cpu()[rows] @ a.t()  # (t, r * n)
        exact[rows] += h @ b.t()
        scale[rows] += h.abs() @ b.abs().t()
    return exact, scale


def check_against_spec(got, y, x, adapters, slots, mapping: LoRAMapping, sizes) -> None:
    """``got`` (y after add_lora_triton) against the reference, the CPU path and exact arithmetic."""
    token_slots: list[int | None] = [None] * y.shape[0]
    for slot, start, end in mapping.segments:
        for t in mapping.token_indices[start:end].tolist():
            token_slots[t] = slot
    spec = y.clone().float().cpu()  # from the float32 adapter weights (before the slots' rounding)
    add_lora_reference(spec, x.float().cpu(), slot_weights(adapters, len(sizes)), token_slots, slices_of(sizes))
    cpu_path = y.clone().cpu()
    operands = [slot_operands(slots.lora_a[(0, MODULE)], slots.lora_b[(0, MODULE)], s, r) for s, r in enumerate(slots.ranks)]
    cpu_mapping = dataclasses.replace(mapping, token_indices=mapping.token_indices.cpu(), segment_table=None)
    add_lora(cpu_path, x.cpu(), operands, cpu_mapping)
    exact, scale = exact_delta_rows(y.cpu(), x.cpu(), slots, mapping)
    got = got.cpu()
    base_rows = [t for t, s in enumerate(token_slots) if s is None]
    assert torch.equal(got[base_rows], y.cpu()[base_rows])  # base-model tokens: untouched bits
    if y.dtype == torch.float32:
        torch.testing.assert_close(got, spec, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, cpu_path, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
    else:
        # bf16: h is rounded to bf16 before the expand and y + delta once at the end (the CPU path
        # rounds h, the delta and the sum): two bf16 steps (2**-7 relative, the interpreter
        # truncating) of |y + delta| and of sum |h| |B|, against exact arithmetic on the same weights.
        slack = 2 * 2**-7 * (exact.abs() + scale) + 1e-6
        error = (got.double() - exact).abs()
        assert (error <= slack).all(), f"max error {error.max()} (slack there {slack.flatten()[error.argmax()]})"
        # Against the spec and the CPU path: the tolerance test_lora_ops gives the CPU path.
        torch.testing.assert_close(got.float(), spec, atol=0.15, rtol=0.05)
        torch.testing.assert_close(got.float(), cpu_path.float(), atol=0.15, rtol=0.05)


# (slots, output slice sizes, padded rank R, in_features, request layout, split_k)
GRID = [
    (3, [40], 8, 72, "mixed", None),  # n = 1, out 40 and in 72: partial tiles everywhere
    (3, [40, 20, 20], 8, 72, "mixed", 2),  # n = 3 (qkv-like), split-K partial sums
    (2, [96, 48, 48], 32, 200, "mixed", 3),  # several row, column and K tiles; one split-K range empty
    (2, [40, 20, 20], 16, 72, "single", None),  # every token on one adapter (single_slot)
    (4, [24, 24], 4, 40, "base-heavy", None),  # mostly base tokens, a couple of adapter tokens
]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_slots,sizes,max_rank,in_features,layout,split_k", GRID,
                         ids=[f"{g[4]}-n{len(g[1])}-R{g[2]}-split{g[5]}" for g in GRID])
def test_triton_path_equals_reference_and_cpu_path(num_slots, sizes, max_rank, in_features, layout, split_k, dtype):
    rng = random.Random(repr((num_slots, sizes, max_rank, layout)))  # str seeds are reproducible
    torch.manual_seed(rng.randrange(2**31))
    adapters = [random_adapter(s + 1, in_features, sizes, max_rank, rng) for s in range(num_slots)]
    assert len({a.rank for a in adapters}) > 1 or num_slots == 1 or layout == "single"  # ranks differ by slot
    slots = packed_slots(adapters, in_features, sizes, max_rank, dtype)
    if layout == "single":
        lens, request_slots = [5, 1, 14], [1, 1, 1]
    elif layout == "base-heavy":
        lens, request_slots = [6, 1, 9, 1, 4], [None, 3, None, 0, None]
    else:
        lens = [rng.randint(1, 9) for _ in range(7)] + [18]  # the last request spans two row tiles
        request_slots = [rng.choice([None, *range(num_slots)]) for _ in lens[:-1]] + [0]
    mapping = build_lora_mapping(request_slots, np.array(lens), DEVICE)
    assert (mapping.single_slot is not None) == (layout == "single")
    num_tokens = sum(lens)
    x = torch.randn(num_tokens, in_features).to(DEVICE, dtype)
    y = torch.randn(num_tokens, sum(sizes)).to(DEVICE, dtype)
    got = y.clone()
    lora_a, lora_b = slots.lora_a[(0, MODULE)].to(DEVICE), slots.lora_b[(0, MODULE)].to(DEVICE)
    add_lora_triton(got, x, lora_a, lora_b, slots.ranks, mapping, split_k=split_k)
    check_against_spec(got, y, x, adapters, slots, mapping, sizes)


@needs_kernels
def test_empty_segments_and_weights_past_a_slots_rank_are_never_read():
    """A hand-built mapping with zero-length segments (even first and last) runs; the padding of
    A and B past each slot's rank holds NaN, yet no NaN reaches y: only rank * n columns are read."""
    rng = random.Random(3)
    torch.manual_seed(3)
    sizes, in_features, max_rank = [32, 16, 16], 48, 8
    adapters = [random_adapter(s + 1, in_features, sizes, 4, rng) for s in range(3)]  # ranks <= 4 < R
    slots = packed_slots(adapters, in_features, sizes, max_rank, torch.float32)
    lora_a, lora_b = slots.lora_a[(0, MODULE)].clone(), slots.lora_b[(0, MODULE)].clone()
    for s, rank in enumerate(slots.ranks):
        lora_a[s, rank:] = float("nan")
        lora_b[s, :, rank:] = float("nan")
    token_indices = torch.tensor([7, 0, 2, 3, 9, 5], dtype=torch.int64)
    mapping = LoRAMapping(token_indices, ((2, 0, 0), (0, 0, 2), (1, 2, 2), (2, 2, 6), (1, 6, 6)))
    x, y = torch.randn(10, in_features), torch.randn(10, sum(sizes))
    got = y.clone().to(DEVICE)
    add_lora_triton(got, x.to(DEVICE), lora_a.to(DEVICE), lora_b.to(DEVICE), slots.ranks,
                    dataclasses.replace(mapping, token_indices=token_indices.to(DEVICE)))
    got = got.cpu()
    assert torch.isfinite(got).all()
    check_against_spec(got, y, x, adapters, slots, mapping, sizes)


@needs_kernels
def test_split_k_partial_sums_add_up_to_the_shrink():
    """lora_shrink's [split_k, N, R * n] partials sum to x @ A_slot.T over each slot's r * n columns."""
    torch.manual_seed(4)
    rng = random.Random(4)
    sizes, in_features = [24, 24], 300
    adapters = [random_adapter(s + 1, in_features, sizes, 8, rng) for s in range(2)]
    slots = packed_slots(adapters, in_features, sizes, 8, torch.float32)
    mapping = build_lora_mapping([1, None, 0], np.array([3, 2, 4]), DEVICE)
    x = torch.randn(9, in_features).to(DEVICE)
    h = lora_shrink(x, slots.lora_a[(0, MODULE)].to(DEVICE), slots.ranks, mapping, split_k=3)  # in: 3 K tiles
    assert h.shape == (3, 7, 16)
    h = h.sum(0).cpu()
    for slot, start, end in mapping.segments:
        a, _ = slot_operands(slots.lora_a[(0, MODULE)], slots.lora_b[(0, MODULE)], slot, slots.ranks[slot])
        want = x.cpu()[mapping.token_indices[start:end].cpu()] @ a.t()  # (t, r * n)
        torch.testing.assert_close(h[start:end, : a.shape[0]], want, atol=1e-5, rtol=1e-5)


def test_device_mapping_packs_indices_and_segment_table():
    """On a non-CPU device one packed tensor holds token_indices and the (slot, start, end) table;
    on CPU only token_indices is built and the table comes on demand."""
    cpu = build_lora_mapping([2, None, 0, 2], np.array([3, 2, 1, 2]))
    assert cpu.segment_table is None and cpu.max_segment_len == 5
    assert cpu.device_segment_table().tolist() == [[0, 2], [0, 1], [1, 6]]
    meta = build_lora_mapping([2, None, 0, 2], np.array([3, 2, 1, 2]), "meta")
    assert meta.token_indices.shape == (6,) and meta.segment_table.shape == (3, 2)
    assert meta.segment_table.dtype == torch.int64 and meta.segments == cpu.segments
    if DEVICE == "cuda":
        dev = build_lora_mapping([2, None, 0, 2], np.array([3, 2, 1, 2]), DEVICE)
        assert dev.token_indices.tolist() == cpu.token_indices.tolist()
        assert dev.segment_table.tolist() == cpu.device_segment_table().tolist()


@needs_kernels
def test_linear_hook_takes_the_triton_path_when_asked():
    """use_triton on the slots sends the hook through the kernels; the result equals the CPU path's."""
    torch.manual_seed(5)
    rng = random.Random(5)
    sizes = [32, 16, 16]
    slots = packed_slots([random_adapter(s + 1, 16, sizes, 8, rng) for s in range(2)], 16, sizes, 8, torch.float32)
    layer = MergedLinear(16, sizes)
    layer.weight.data.normal_()
    layer.lora = slots.hook(0, MODULE)
    x = torch.randn(6, 16)
    slots.mapping = build_lora_mapping([1, None, 0], np.array([2, 1, 3]))
    cpu_path = layer(x)
    slots.use_triton = True
    triton_path = layer(x)
    torch.testing.assert_close(triton_path, cpu_path, atol=1e-5, rtol=1e-5)
    assert torch.equal(triton_path[2], cpu_path[2])  # the base token
    assert not torch.equal(triton_path, torch.nn.functional.linear(x, layer.weight))


@pytest.mark.skipif(DEVICE == "cuda" or not RUNNABLE, reason="CPU interpreter only (a GPU runs the engine itself)")
def test_cuda_runner_with_two_adapters_matches_the_cpu_runner(tmp_path):
    """The CUDA runner (Triton attention and LoRA kernels under the interpreter) on a tiny Llama with
    two peft adapters and the base model in one batch: the CPU runner's greedy tokens, through
    prefill, mixed and padded-decode steps. There is no CUDA device here, so the CUDA runner is
    swapped into a CPU engine, as in test_cuda_runner_interpreted.py."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import make_tiny_model
    from tokenmill import LLM, LoRARequest, SamplingParams
    from tokenmill.runner.cuda_runner import CudaModelRunner

    def save_adapter(base: str, out, seed: int, **lora_args) -> str:  # B random (not zero), as in test_lora.py
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_args)).save_pretrained(out)
        return str(out)

    base = str(make_tiny_model("llama", tmp_path / "base", max_position_embeddings=64, num_hidden_layers=1))
    loras = [LoRARequest("qv", 1, save_adapter(base, tmp_path / "qv", seed=1, r=4, lora_alpha=8,
                                               target_modules=["q_proj", "v_proj"])),
             LoRARequest("mlp", 2, save_adapter(base, tmp_path / "mlp", seed=2, r=8, lora_alpha=16,
                                                target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]))]
    # One prefill step of all three requests, then one padded decode step (the interpreter is slow).
    prompt = {"prompt_token_ids": [random.Random(6).randrange(100, 40000) for _ in range(5)]}
    prompts, choices = [prompt] * 3, [None, *loras]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    kwargs = dict(model=base, dtype="float32", device="cpu", num_threads=1, num_kv_blocks=16, block_size=8,
                  max_num_batched_tokens=16, max_num_seqs=4, enable_lora=True, max_loras=2, max_lora_rank=8)
    want = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(prompts, params, lora_request=choices)]
    assert len({tuple(t) for t in want}) == 3  # the same prompt: each adapter changes the tokens

    llm = LLM(**kwargs)
    engine = llm.engine
    runner = CudaModelRunner(engine.loaded, engine.config.cache, engine.scheduler_config,
                             lora_manager=engine.lora_manager)  # triton backend
    engine.runner = runner
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=choices)]
    assert got == want
    assert engine.lora_manager.slots.use_triton
    assert runner.num_padded_decode_steps == 1 and runner.num_general_steps == 1
    engine.check_integrity()
