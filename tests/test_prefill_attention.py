"""The flash-style CPU prefill attention kernel (attention/csrc/paged_prefill.c) and the prefill GEMM dispatch.

Proves: every ISA path's build of the kernel equals a dense float64 causal reference (float32 within
1e-5, bf16 within its output rounding) for fresh prompts, chunks after a cached prefix and several
spans mixed with decodes in one batch, GQA and not, over block sizes 1 and 16 and head dims on and off
the vector width (refused, and left to SDPA, where it is not a multiple), and with sliding windows and logit
soft-capping (a row's bits still independent of the chunking); the engine with the kernel
forced on gives transformers' greedy tokens and prompt log-probabilities (within 1e-4) in float32 on a
tiny model and on the embedded SmolLM2 (chunked prefill, so later chunks attend over a cached prefix);
GGUF weights dequantize to the portable build's bits on this CPU's path (bf16: the float32 values
rounded) and, in the per-thread scratch buffer, give the same products as a fresh dequantized copy; the plan switches the attention layers and
keeps the dequantize-and-GEMM rows a suffix of the ladder.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_attention import dense_reference, fill_cache
from tests.test_cpu_isa_paths import bf16_dot_modes, bf16_dot_path, build_for_isa
from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.attention import Attention, build_attention_metadata, cpu_prefill
from tokenmill.attention.torch_paged import paged_attention
from tokenmill.csrc_build import ISAS
from tokenmill.quantization import qgemm
from tokenmill.quantization.formats import QuantizedTensor
from tokenmill.quantization.gguf_weight import GGUFWeight
from tokenmill.runner import cpu_kernels

HEADS = [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 1, 48), (4, 2, 24)]


def spans_batch(dtype, h, kvh, d, block_size, seed):
    """A decode, a fresh 33-token prompt, a 17-token chunk after 40 cached tokens, a 2-token prompt and a
    100-token prompt in one flat batch: (q, k_cache, v_cache, metadata, keys, values, query_lens)."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    lens = [9, 33, 57, 2, 100]
    query_lens = np.array([1, 33, 17, 2, 100])
    k_cache, v_cache, tables, keys, values = fill_cache(lens, block_size, 200 // block_size * 4 + 40, kvh, d, dtype, rng)
    max_blocks = max(len(t) for t in tables)
    block_table = np.array([t + [0] * (max_blocks - len(t)) for t in tables])
    meta, _ = build_attention_metadata(query_lens, np.array(lens) - query_lens, block_table, block_size)
    q = torch.randn(int(query_lens.sum()), h, d).to(dtype)
    return q, k_cache, v_cache, meta, keys, values, query_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("isa", ISAS)
def test_prefill_kernel_matches_dense_reference(isa, dtype, block_size):
    lib = build_for_isa(cpu_prefill._load, isa)
    width = lib.paged_prefill_vector_width()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for h, kvh, d in HEADS:
        q, k_cache, v_cache, meta, keys, values, query_lens = spans_batch(dtype, h, kvh, d, block_size, seed=d + h)
        out = torch.zeros_like(q)
        if d % width:
            with pytest.raises(ValueError, match="multiple"):
                cpu_prefill._paged_prefill(lib, q, k_cache, v_cache, meta, d**-0.5, out)
            continue
        for dot in bf16_dot_modes(lib, "paged_prefill_set_dp"):  # the AVX512_BF16 build: FMAs and VDPBF16PS
            out = torch.zeros_like(q)
            with bf16_dot_path(lib, "paged_prefill_set_dp", dot):
                cpu_prefill._paged_prefill(lib, q, k_cache, v_cache, meta, d**-0.5, out)
            start = 0
            for i, n in enumerate(query_lens):
                if n > 1:
                    ref = dense_reference(q[start:start + n], keys[i], values[i], d**-0.5)
                    torch.testing.assert_close(out[start:start + n].double(), ref, atol=tol, rtol=tol)
                else:  # decode rows are not the kernel's: left as they were
                    assert not out[start:start + n].any()
                start += n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_prefill_rows_keep_their_bits_whatever_the_chunking(isa, dtype):
    """A prompt token's output is the same bits whether its prompt runs as one span or as a chunk after a
    cached prefix (prefix caching on or off, chunks ending anywhere): key tiles start at the same positions and
    every query row is computed on its own (on AVX512_BF16 machines this covers the VDPBF16PS path). Finite
    caches: a masked key's value still meets a weight of 0, and 0 * inf is NaN in the kernels as in torch's
    dense math, so an inf value just past a chunk's end is the one case a chunk boundary shows."""
    lib = build_for_isa(cpu_prefill._load, isa)
    h, kvh, d, bs, n = 9, 3, 64, 16, 150
    rng = np.random.default_rng(7)
    torch.manual_seed(7)
    k_cache, v_cache, tables, _, _ = fill_cache([n], bs, 40, kvh, d, dtype, rng)
    block_table = np.array(tables)
    q = torch.randn(n, h, d).to(dtype)
    wholes = []
    for dot in bf16_dot_modes(lib, "paged_prefill_set_dp"):  # the AVX512_BF16 build: FMAs and VDPBF16PS
        with bf16_dot_path(lib, "paged_prefill_set_dp", dot):
            whole = torch.zeros_like(q)
            meta, _ = build_attention_metadata(np.array([n]), np.array([0]), block_table, bs)
            cpu_prefill._paged_prefill(lib, q, k_cache, v_cache, meta, d**-0.5, whole)
            # chunks running to the prompt's end, and chunks ending inside it (odd and even key counts)
            for cached, end in ((63, n), (64, n), (129, n), (0, 37), (37, 101), (64, 128), (100, 103)):  # 1-token spans are decodes
                chunk = torch.zeros(end - cached, h, d, dtype=dtype)
                meta, _ = build_attention_metadata(np.array([end - cached]), np.array([cached]), block_table, bs)
                cpu_prefill._paged_prefill(lib, q[cached:end].contiguous(), k_cache, v_cache, meta, d**-0.5, chunk)
                assert torch.equal(chunk, whole[cached:end]), f"tokens {cached}..{end} as a chunk change the bits"
        wholes.append(whole)
    if len(wholes) == 2 and dtype == torch.bfloat16:  # the switch reaches the kernel
        assert not torch.equal(wholes[0], wholes[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_prefill_kernel_with_sliding_window_and_softcap_matches_dense_reference(isa, dtype):
    """Each span's query at position p attends to keys p - window < j <= p only: windows of 1 key, inside a key
    tile (5), across tiles (70: BK is 64) and wider than every context, with and without soft-capping, on
    every ISA path's build (VDPBF16PS too where present), for fresh prompts, a chunk after 40 cached tokens and
    a 100-token prompt whose later query tiles skip the key tiles below their windows."""
    lib = build_for_isa(cpu_prefill._load, isa)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    h, kvh, d = 9, 3, 64
    q, k_cache, v_cache, meta, keys, values, query_lens = spans_batch(dtype, h, kvh, d, 16, seed=11)
    q = q * 3  # large scores: the cap bites
    for dot in bf16_dot_modes(lib, "paged_prefill_set_dp"):
        with bf16_dot_path(lib, "paged_prefill_set_dp", dot):
            for window in (1, 5, 70, 200):
                for softcap in (None, 2.0):
                    out = torch.zeros_like(q)
                    cpu_prefill._paged_prefill(lib, q, k_cache, v_cache, meta, d**-0.5, out, window, softcap)
                    start = 0
                    for i, n in enumerate(query_lens):
                        if n > 1:
                            ref = dense_reference(q[start:start + n], keys[i], values[i], d**-0.5, window, softcap)
                            torch.testing.assert_close(out[start:start + n].double(), ref, atol=tol, rtol=tol,
                                                       msg=f"window {window} softcap {softcap} span {i}")
                        else:
                            assert not out[start:start + n].any()
                        start += n
            full = torch.zeros_like(q)
            cpu_prefill._paged_prefill(lib, q, k_cache, v_cache, meta, d**-0.5, full)
            wide = torch.zeros_like(q)
            cpu_prefill._paged_prefill(lib, q, k_cache, v_cache, meta, d**-0.5, wide, 200)
            assert torch.equal(wide, full)  # a window wider than every context changes no bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_prefill_rows_keep_their_bits_whatever_the_chunking_under_a_sliding_window(isa, dtype):
    """Under a window (37: key tiles below a row's window are skipped or fully masked, depending on the other
    rows of its query tile) a prompt token's output is the same bits as one span or as any chunk after a cached
    prefix, and matches the dense windowed, soft-capped reference."""
    lib = build_for_isa(cpu_prefill._load, isa)
    h, kvh, d, bs, n, window = 9, 3, 64, 16, 150, 37
    rng = np.random.default_rng(8)
    torch.manual_seed(8)
    k_cache, v_cache, tables, keys, values = fill_cache([n], bs, 40, kvh, d, dtype, rng)
    block_table = np.array(tables)
    q = torch.randn(n, h, d).to(dtype)
    for dot in bf16_dot_modes(lib, "paged_prefill_set_dp"):
        with bf16_dot_path(lib, "paged_prefill_set_dp", dot):
            whole = torch.zeros_like(q)
            meta, _ = build_attention_metadata(np.array([n]), np.array([0]), block_table, bs)
            cpu_prefill._paged_prefill(lib, q, k_cache, v_cache, meta, d**-0.5, whole, window, 3.0)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            ref = dense_reference(q, keys[0], values[0], d**-0.5, window, 3.0)
            torch.testing.assert_close(whole.double(), ref, atol=tol, rtol=tol)
            for cached, end in ((63, n), (64, n), (100, n), (0, 37), (37, 101), (64, 128), (100, 103), (36, 40)):
                chunk = torch.zeros(end - cached, h, d, dtype=dtype)
                meta, _ = build_attention_metadata(np.array([end - cached]), np.array([cached]), block_table, bs)
                cpu_prefill._paged_prefill(lib, q[cached:end].contiguous(), k_cache, v_cache, meta, d**-0.5, chunk,
                                           window, 3.0)
                assert torch.equal(chunk, whole[cached:end]), f"tokens {cached}..{end} as a chunk change the bits"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_with_the_kernel_matches_sdpa(dtype):
    """The layer's entry point: decodes and prefill spans together, kernel on against SDPA."""
    for h, kvh, d in HEADS:
        q, k_cache, v_cache, meta, _, _, _ = spans_batch(dtype, h, kvh, d, 4, seed=7)
        on = paged_attention(q, k_cache, v_cache, meta, d**-0.5, use_prefill_kernel=True)
        off = paged_attention(q, k_cache, v_cache, meta, d**-0.5, use_prefill_kernel=False)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(on.float(), off.float(), atol=tol, rtol=tol)


def force_prefill_kernel(llm: LLM, on: bool = True) -> int:
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Attention)]
    for m in layers:
        m.cpu_prefill_kernel = on
    return len(layers)


@torch.inference_mode()
def check_against_transformers(llm: LLM, hf, prompt: list[int], new_tokens: int) -> float:
    """Greedy tokens equal transformers'; returns the largest |prompt logprob difference|."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    ref_ids = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == ref_ids
    ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return max(abs(out.prompt_logprobs[pos][prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item())
               for pos in range(1, len(prompt)))


@pytest.mark.skipif(not cpu_prefill.available(), reason="the C kernels cannot be built here")
def test_tiny_model_with_the_kernel_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("llama", tmp_path / "m")  # head_dim 16, GQA 4:2
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # cpu_kernels=False: no kernel timing at start (the other layers on torch); the kernel is forced on below.
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=24,
              cpu_kernels=False)
    assert force_prefill_kernel(llm) == 2
    prompt = [int(t) for t in np.random.default_rng(3).integers(100, 40000, size=70)]  # chunks of 24, 24, 22
    assert check_against_transformers(llm, hf, prompt, 10) < 1e-4


@pytest.mark.skipif(not cpu_prefill.available(), reason="the C kernels cannot be built here")
def test_smollm2_with_the_kernel_matches_transformers(hf_smollm2):
    llm = LLM(dtype="float32", quantization="none", max_num_batched_tokens=100, num_kv_blocks=32, cpu_kernels=False)
    assert force_prefill_kernel(llm) == 30
    text = "The history of the printing press begins in the fifteenth century. " * 12
    prompt = llm.get_tokenizer().encode(text)[:240]  # chunks of 100, 100, 40
    assert check_against_transformers(llm, hf_smollm2, prompt, 6) < 1e-4


def q4_1_weight(n: int, k: int, seed: int) -> GGUFWeight:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 32, 20), dtype=np.uint8)
    half = (rng.standard_normal((n, k // 32, 2)) * 0.01).astype(np.float16)
    raw[:, :, :4] = half.view(np.uint8).reshape(n, k // 32, 4)
    return GGUFWeight([QuantizedTensor(3, (n, k), torch.from_numpy(raw.reshape(n, -1).copy()))])


@pytest.mark.skipif(not qgemm.available(), reason="the C kernels cannot be built here")
def test_dequantize_is_the_portable_builds_values_on_this_path():
    """This CPU's build (vectorised per format on AVX-512) against the plain-C build: the same float32
    bits for every format, and bf16 rows that are the float32 rows rounded (torch's rounding)."""
    from tests.test_quantized_weights import KS, QTYPES, random_blocks

    portable = qgemm._load("portable")
    for qtype in QTYPES:
        for k in KS[qtype]:
            data = random_blocks(qtype, 37, k, seed=qtype + k)
            ref = qgemm._dequantize(portable, data, qtype, k, None, torch.float32)
            assert torch.equal(qgemm.dequantize(data, qtype, k, dtype=torch.float32), ref)
            assert torch.equal(qgemm.dequantize(data, qtype, k, dtype=torch.bfloat16), ref.bfloat16())


@pytest.mark.skipif(not qgemm.available(), reason="the C kernels cannot be built here")
def test_dequantized_products_use_the_scratch_buffer_correctly():
    small, big = q4_1_weight(40, 64, 1), q4_1_weight(96, 128, 2)
    f32 = big.dequantize(torch.float32)
    assert torch.equal(big.dequantize(torch.bfloat16), f32.bfloat16())  # bf16 rows: float32 rows rounded
    buf = torch.empty(96, 128)
    part = big.parts[0]  # Q4_1, or its tiled layout where that is this build's default
    assert qgemm.dequantize(part.data, part.qtype, 128, dtype=torch.float32, out=buf) is buf and torch.equal(buf, f32)
    with pytest.raises(ValueError, match="out must be"):
        qgemm.dequantize(part.data, part.qtype, 128, dtype=torch.bfloat16, out=buf)
    for w in (small, big):
        w.dequantize_table = (True,)
    for dtype in (torch.float32, torch.bfloat16):
        xs, xb = torch.randn(300, 64).to(dtype), torch.randn(300, 128).to(dtype)
        got_big = big.matmul(xb)
        got_small = small.matmul(xs)  # reuses (and overwrites) this thread's buffer
        assert torch.equal(got_big, F.linear(xb, big.dequantize(dtype)))
        assert torch.equal(got_small, F.linear(xs, small.dequantize(dtype)))


def test_plan_switches_prefill_attention_and_keeps_a_dequantize_suffix(monkeypatch):
    attn = Attention(4, 2, 16, 0.25)
    for flag in (True, False):
        cpu_kernels.apply_plan(attn, cpu_kernels.KernelPlan(isa="avx2", dtype="float32", prefill_attention=flag))
        assert attn.cpu_prefill_kernel is flag
    cpu_kernels.apply_plan(attn, cpu_kernels.KernelPlan(isa=None))
    assert attn.cpu_prefill_kernel is False
    # By prompt length: the kernel takes a step whose longest prompt context is within the plan's limit.
    cpu_kernels.apply_plan(attn, cpu_kernels.KernelPlan(isa="avx2", dtype="float32", prefill_attention=True,
                                                        prefill_attention_max_context=1024))
    assert attn.cpu_prefill_kernel is True and attn.cpu_prefill_max_context == 1024
    table = np.arange(80, dtype=np.int64).reshape(1, 80)
    short, _ = build_attention_metadata([100], [900], table, 16)  # a chunk of 100 after 900 cached: context 1000
    long, _ = build_attention_metadata([100], [1000], table, 16)  # context 1100
    assert attn.prefill_kernel_takes(short) and not attn.prefill_kernel_takes(long)
    # The race from the shortest length up: the first SDPA win ends the kernel's range halfway (geometric).
    for outcomes, want in (([True, True, True], (True, 0)), ([True, True, False], (True, 1024)),
                           ([True, False], (True, 256)), ([False], (False, 0))):
        results = iter(outcomes)
        monkeypatch.setattr(cpu_kernels, "_race_prefill", lambda attn, dtype, length: next(results))
        assert cpu_kernels._measure_prefill(attn, torch.float32) == want
    monkeypatch.undo()
    # Race results per ladder point from the top down (True: the quantized kernel won): dequantize wins at
    # 256 rows, a kernel win at 128 ends the ladder (every smaller point takes the kernel unraced, so a
    # noisy dequantize win at 4 rows could not leave a hole), and the switch sits at 256.
    wins = iter([False, True])
    raced = []

    def race(c_fn, torch_fn):
        raced.append(1)
        return next(wins)

    monkeypatch.setattr(cpu_kernels, "_race", race)
    layer = torch.nn.Module()
    from tokenmill.layers.linear import Linear

    layer.proj = Linear(64, 40)
    layer.proj.load_quantized(q4_1_weight(40, 64, 3))
    assert cpu_kernels._measure_quantized([layer.proj], torch.float32) == (True,) * 8 + (False,)
    assert len(raced) == 2
    wins = iter([False] * 9)  # dequantize wins everywhere: every point raced, none keeps the kernel
    raced.clear()
    assert cpu_kernels._measure_quantized([layer.proj], torch.float32) == (False,) * 9 and len(raced) == 9
