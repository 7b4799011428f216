"""GGUF quantized weights run as stored (tokenmill/quantization): the kernels against a dequantize-then-
float64 reference, and the embedded Q4_1 model against its dequantized float32 twin.

Proves: every format (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) dequantizes to exactly the `gguf` package's
values; products at 1, 7, 33 and 300 rows (odd block counts, an odd number of output rows, float32 and
bf16 activations) stay within the stated bound of the float64 product of the dequantized weights, on
the portable and AVX2 builds, the native AVX-512 (BW and VNNI) builds where the CPU has them, and the
AVX-512 builds emulated through SIMDe; each row's bits do not depend on the other rows nor on the
thread count; the tiled layout of Q4_0/Q4_1/Q8_0 (``qgemm.repack``; 16-row tiles and a tail of rows
as stored, at N = 37, 48 and 5) does the same, dequantizes to the same values, and gives the same bits
on every ISA path in its tiled rows; the embedded model's greedy tokens with native Q4_1 execution
equal the dequantized path wherever the top-2 log-probability gap exceeds MARGIN (6 chats x 32
tokens, mean |logprob difference| printed); deterministic mode keeps each request's bits whatever it is
batched with; the weights stay quantized in memory and a second load comes from the cache (config, tensor
index, tokenizer; no copy of the blocks).

The bound (per output): sum over groups of 32 of 0.5 * max|x_group| / 127 * sum|w_group| (activations
are rounded to int8 per group, at most half a step each) plus 1e-5 * sum|x||w| of float rounding.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from tokenmill import LLM, SamplingParams, csrc_build
from tokenmill.quantization import GGUF_QUANT_TYPES, QuantizedTensor, qgemm
from tokenmill.quantization.formats import TILE_ROWS, TILED_FORMATS

QTYPES = sorted(GGUF_QUANT_TYPES)
ROWS = (1, 2, 5, 7, 11, 14, 33, 300)  # every remainder of the tiles' 4- and 8-row passes; 2: the AVX2 1-2 row paths
N = 37  # output rows: off every tile of the kernels
# in_features per format: 3 and 17 groups of 32, or 3 super blocks of 256 for the K-quants
KS = {2: (96, 544), 3: (96, 544), 6: (96, 544), 7: (96, 544), 8: (96, 544), 20: (96, 544),
      10: (768,), 11: (768,), 12: (768,), 13: (768,), 14: (768,), 23: (768,)}
# float16 fields of each block (byte offsets): scales and mins that must stay finite and small
HALF_OFFSETS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2),
                14: (208,), 20: (0,), 23: (0,)}
TILED_NS = (37, 48, 5)  # tiled layout: 2 tiles + 5 tail rows, 3 whole tiles, only tail rows
MARGIN = 0.5  # nats: a top-2 gap above this must not flip under Q4_1 execution

SIMDE_INCLUDE = Path("/usr/include/simde")
SHIM_DIR = Path(__file__).parent / "csrc" / "simde_shim"
COMPILER = csrc_build.c_compiler()

pytestmark = pytest.mark.skipif(not qgemm.available(), reason="the C kernels cannot be built here")


def random_blocks(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    """[n, row bytes] of random blocks: every code and sub-scale byte random, the float16 scales small."""
    _, bs, bb = GGUF_QUANT_TYPES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // bs, bb), dtype=np.uint8)
    for off in HALF_OFFSETS[qtype]:
        half = (rng.standard_normal((n, k // bs)) * 0.01).astype(np.float16)
        raw[:, :, off:off + 2] = half.view(np.uint8).reshape(n, k // bs, 2)
    return torch.from_numpy(raw.reshape(n, -1).copy())


def reference_weights(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """The `gguf` package's dequantization, float64 [n, k]."""
    return torch.from_numpy(gguf_dequantize(data.numpy(), GGMLQuantizationType(qtype))).reshape(-1, k).double()


def error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N] bound of the module docstring for x [M, K] and w [N, K] (float64)."""
    m, k = x.shape
    groups = x.double().view(m, k // 32, 32).abs().amax(-1) / 127  # (M, G) activation steps
    w_abs = w.abs().view(w.shape[0], k // 32, 32).sum(-1)  # (N, G)
    return 0.5 * groups @ w_abs.T + 1e-5 * (x.double().abs() @ w.abs().T) + 1e-30


def check_products(lib: ctypes.CDLL, data: torch.Tensor, qtype: int, n: int, k: int, w: torch.Tensor,
                   x: torch.Tensor, label: str) -> torch.Tensor:
    """The grid's row counts and dtypes for one weight (stored or tiled): dequantization equals ``w``,
    every product is within the bound and batch invariant. Returns the float32-activation product of
    all rows."""
    assert torch.equal(qgemm._dequantize(lib, data, qtype, k, None, torch.float32).double(), w)
    ids = torch.tensor([min(5, n - 1), 0, n - 1, min(5, n - 1)])
    assert torch.equal(qgemm._dequantize(lib, data, qtype, k, ids, torch.float32).double(), w[ids])
    result = None
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        full = qgemm._linear(lib, xd, data, qtype, n, k, out_dtype=torch.float32)
        bound = error_bound(xd.float(), w)
        for rows in ROWS:
            got = qgemm._linear(lib, xd[:rows], data, qtype, n, k, out_dtype=torch.float32)
            err = (got.double() - xd[:rows].double() @ w.T).abs()
            worst = (err / bound[:rows]).max().item()
            assert worst <= 1.0, f"{label} rows={rows} {dtype}: {worst:.3f} x bound"
            assert torch.equal(got, full[:rows]), f"{label}: a row's result depends on the other rows"
        single = qgemm._linear(lib, xd[16:17], data, qtype, n, k, out_dtype=torch.float32)
        assert torch.equal(single, full[16:17]), f"{label}: a row's result depends on its position"
        out = qgemm._linear(lib, xd[:7], data, qtype, n, k)  # output in x's dtype
        assert out.dtype == dtype and torch.equal(out, full[:7].to(dtype))
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1 if threads > 1 else 2)
            assert torch.equal(qgemm._linear(lib, xd, data, qtype, n, k, out_dtype=torch.float32), full), \
                f"{label}: the result depends on the thread count"
        finally:
            torch.set_num_threads(threads)
        if dtype == torch.float32:
            result = full
    return result


def check_library(lib: ctypes.CDLL) -> dict[tuple[int, int, int], torch.Tensor]:
    """Every format, shape and row count of the grid on one build of the kernels, the stored layout and the
    tiled one. Returns the tiled products (float32 activations) by (qtype, N, K)."""
    g = torch.Generator().manual_seed(0)
    tiled = {}
    for qtype in QTYPES:
        name = GGUF_QUANT_TYPES[qtype][0]
        for k in KS[qtype]:
            data = random_blocks(qtype, N, k, seed=qtype * 1000 + k)
            w = reference_weights(data, qtype, k)
            x = torch.randn(max(ROWS), k, generator=g) * torch.logspace(-2, 1, max(ROWS)).unsqueeze(1)
            check_products(lib, data, qtype, N, k, w, x, f"{name} K={k}")
            if qtype not in TILED_FORMATS:
                continue
            for n in TILED_NS:
                stored = random_blocks(qtype, n, k, seed=qtype * 1000 + k + n)
                t = qgemm._repack(lib, QuantizedTensor(qtype, (n, k), stored))
                assert t.qtype == qtype + 256 and t.data.shape == stored.shape
                w = reference_weights(stored, qtype, k)
                tiled[qtype, n, k] = check_products(lib, t.data, t.qtype, n, k, w, x, f"tiled {name} N={n} K={k}")
    return tiled


def assert_tiled_rows_match(got: dict, want: dict, label: str) -> None:
    """The tiled rows (all but the tail) of every tiled product are the same bits as ``want``'s."""
    assert got.keys() == want.keys()
    for (qtype, n, k), y in got.items():
        rows = n // TILE_ROWS * TILE_ROWS
        assert torch.equal(y[:, :rows], want[qtype, n, k][:, :rows]), \
            f"{label}: tiled {GGUF_QUANT_TYPES[qtype][0]} N={n} K={k} differs from the portable build"


@pytest.fixture(scope="module")
def portable_tiled() -> dict:
    """The portable build's tiled products: every other path must give their bits."""
    return check_library(qgemm._load("portable"))


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512", "avx512+vnni"])
def test_native_builds_stay_within_the_bound_of_the_dequantized_product(isa, portable_tiled):
    base = isa.split("+")[0]
    if not csrc_build.isa_supported(base):
        pytest.skip(f"this CPU lacks {', '.join(csrc_build.missing_cpu_flags(base))}")
    if isa == "avx512+vnni":
        if "avx512_vnni" not in csrc_build.cpu_flags():
            pytest.skip("this CPU lacks avx512_vnni")
        lib = csrc_build.load_c_library(qgemm._SOURCE, "qgemm", qgemm._setup, (*qgemm._FLAGS, *qgemm._VNNI_FLAGS), base)
    else:  # the AVX-512BW path without VNNI too, even on a CPU that has it
        lib = csrc_build.load_c_library(qgemm._SOURCE, "qgemm", qgemm._setup, qgemm._FLAGS, base)
    assert lib is not None and lib.qg_isa().decode() == base and lib.qg_vnni() == int(isa.endswith("vnni"))
    assert lib.qg_tiled_preferred() == int(base != "portable")
    assert_tiled_rows_match(check_library(lib), portable_tiled, isa)


@pytest.mark.skipif(not SIMDE_INCLUDE.is_dir() or COMPILER is None or not csrc_build.isa_supported("avx2"),
                    reason="needs SIMDe (apt-get install libsimde-dev), a C compiler and an AVX2 CPU")
def test_emulated_avx512_builds_stay_within_the_bound(tmp_path, portable_tiled):
    """The AVX-512BW and AVX-512 VNNI branches, their intrinsics served by SIMDe (as tests/test_avx512_emulated.py)."""
    builds = {
        "avx512": ["-D__AVX512F__", "-D__AVX512BW__", "-D__AVX512VL__", "-D__AVX512DQ__"],
        "avx512_bf16": ["-D__AVX512F__", "-D__AVX512BW__", "-D__AVX512VL__", "-D__AVX512DQ__", "-D__AVX512BF16__",
                        "-D__AVX512VNNI__", "-DTM_VNNI"],
    }
    jobs = {}
    for isa, macros in builds.items():
        target = tmp_path / f"qgemm-{isa}.so"
        cmd = [COMPILER, *qgemm._FLAGS, "-mavx2", "-mfma", "-mf16c", *macros, "-O1", "-Wno-psabi", "-I", str(SHIM_DIR),
               "-I", str(csrc_build.SHARED_INCLUDE_DIR), str(qgemm._SOURCE), "-o", str(target), "-lm"]
        jobs[isa] = (target, cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for isa, (target, cmd, proc) in jobs.items():
        output, _ = proc.communicate()
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{output}"
        lib = ctypes.CDLL(str(target))
        qgemm._setup(lib)
        assert lib.qg_isa().decode() == isa and lib.qg_vnni() == int(isa == "avx512_bf16")
        assert_tiled_rows_match(check_library(lib), portable_tiled, f"{isa} (SIMDe)")
        csrc_build.loaded_kernels.add(("qgemm (SIMDe)", isa))


def test_shapes_the_formats_cannot_take_are_refused():
    data = random_blocks(3, 4, 64, seed=1)
    with pytest.raises(ValueError, match="x must be"):
        qgemm.quantized_linear(torch.zeros(2, 63), data, 3, 4, 64)
    with pytest.raises(ValueError, match="not a supported quantized format"):
        qgemm.quantized_linear(torch.zeros(2, 64), data, 1, 4, 64)
    with pytest.raises(ValueError, match="no tiled layout"):  # already tiled
        qgemm.repack(qgemm.repack(QuantizedTensor(12, (2, 256), random_blocks(12, 2, 256, seed=1))))
    with pytest.raises(ValueError, match="not a multiple of 256"):  # K-quants take whole super blocks only
        QuantizedTensor(12, (2, 288), torch.zeros(2, 162, dtype=torch.uint8))
    with pytest.raises(ValueError, match="no tiled layout"):
        qgemm.repack(qgemm.repack(QuantizedTensor(3, (4, 64), data)))


# ---------------------------------------------------------------- the embedded Q4_1 model

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Tell me a fun fact about octopuses.",
]


def compare_greedy(names, got, want) -> list[float]:
    """Walk each pair of greedy outputs (logprobs=2) while their contexts agree: a differing token is
    allowed only where the reference's top-2 gap is at most MARGIN. Returns |logprob diff| per position."""
    diffs = []
    for name, q_out, d_out in zip(names, got, want):
        q, d = q_out.outputs[0], d_out.outputs[0]
        for step, (qt, dt) in enumerate(zip(q.token_ids, d.token_ids)):
            top = sorted(d.logprobs[step].values(), key=lambda lp: -lp.logprob)
            gap = top[0].logprob - top[1].logprob
            diffs.append(abs(q.logprobs[step][qt].logprob - d.logprobs[step][dt].logprob))
            if qt != dt:  # contexts differ from here on: stop comparing this output
                assert gap <= MARGIN, f"{name!r} step {step}: the token flipped with a top-2 gap of {gap:.3f}"
                break
    return diffs


@pytest.fixture(scope="module")
def engines():
    common = {"dtype": "float32", "num_threads": 1, "max_model_len": 256, "kv_cache_memory": 0.05,
              "cpu_kernels": False}
    quantized, dense = LLM(quantization="gguf", **common), LLM(quantization="none", **common)
    yield quantized, dense
    quantized.close()
    dense.close()


def test_weights_stay_quantized_and_reload_from_the_cache(engines):
    quantized, _ = engines
    loaded = quantized.engine.loaded
    model = loaded.model
    assert loaded.quantization == "gguf"
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight is None and layer.self_attn.qkv_proj.quant.describe() == "Q4_1"
    assert model.lm_head.quant is model.model.embed_tokens.quant and model.lm_head.quant.describe() == "Q8_0"
    qbytes = sum(b.numel() for b in model.buffers() if b.dtype == torch.uint8)
    assert 90e6 < qbytes < 100e6  # Q4_1 layers + Q8_0 embedding, against ~540 MB in float32
    from tokenmill.memory_plan import PlanConfig, plan_memory, read_model_shape
    from tokenmill.models.loader import load_model

    dense_bytes = sum(p.numel() * 4 for p in model.parameters())
    shape = read_model_shape(None)  # parses the GGUF metadata (seconds)
    plan = plan_memory(shape, PlanConfig(memory=4, dtype="float32"))
    assert plan.weight_bytes == qbytes + dense_bytes  # `tokenmill plan` counts the blocks as stored
    none = plan_memory(shape, PlanConfig(memory=4, dtype="float32", quantization="none"))
    assert none.weight_bytes == none.model.num_params * 4
    again = load_model(None, "float32")  # second start: config, tensor index and tokenizer from the GGUF cache
    assert again.quantization == "gguf" and again.load_seconds < 10
    from tokenmill.models import gguf_cache
    from tokenmill.models.default_model import default_model_path

    entry = gguf_cache.entry_dir(default_model_path())
    # only the dense engine's dequantized copy: the blocks are read from the file in place, never copied
    assert {f.name for f in entry.glob("*.safetensors")} <= {"model.safetensors"}


def test_q4_1_greedy_tokens_match_the_dequantized_model_where_the_margin_is_clear(engines):
    quantized, dense = engines
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
    messages = [[{"role": "user", "content": c}] for c in CHATS]
    got, want = quantized.chat(messages, params), dense.chat(messages, params)
    diffs = compare_greedy(CHATS, got, want)
    compared = len(diffs)
    mean = sum(diffs) / len(diffs)
    print(f"Q4_1 native vs dequantized float32: {compared} positions compared, mean |logprob diff| {mean:.4f}")
    assert compared >= 6 * 8 and mean < 0.1


def test_deterministic_mode_keeps_each_request_bit_identical_with_quantized_weights():
    llm = LLM(quantization="gguf", dtype="float32", deterministic=True, num_threads=2, max_model_len=256,
              kv_cache_memory=0.05)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
        target = [{"role": "user", "content": CHATS[0]}]
        alone = llm.chat([target], params)[0].outputs[0]
        batch = llm.chat([[{"role": "user", "content": c}] for c in CHATS[1:3]] + [target], params)[-1].outputs[0]
        assert alone.token_ids == batch.token_ids
        assert [lp[t].logprob for lp, t in zip(alone.logprobs, alone.token_ids)] == \
               [lp[t].logprob for lp, t in zip(batch.logprobs, batch.token_ids)]
    finally:
        llm.close()


def test_quantization_choices_are_checked():
    from tokenmill.models.loader import resolve_quantization

    cpu = torch.device("cpu")
    assert resolve_quantization(None, "gguf", cpu) == "gguf"
    assert resolve_quantization(None, "safetensors", cpu) == "none"
    with pytest.raises(ValueError, match="quantization"):
        resolve_quantization("gguf", "safetensors", cpu)
    with pytest.raises(ValueError, match="quantization"):
        resolve_quantization("int4", "gguf", cpu)
    with pytest.raises(ValueError, match="quantization"):
        resolve_quantization("int8", "gguf", cpu)


# ---------------------------------------------------------------- int8 weight-only (safetensors checkpoints)


def test_int8_blocks_round_each_weight_to_its_channel_step():
    from tokenmill.quantization.int8 import int8_per_channel_blocks

    w = torch.randn(37, 96, generator=torch.Generator().manual_seed(3)) * torch.logspace(-2, 0, 37).unsqueeze(1)
    blocks = int8_per_channel_blocks(w)
    back = qgemm.dequantize(blocks.data, blocks.qtype, 96)
    step = (w.abs().amax(1) / 127).to(torch.float16).float()
    assert ((back - w).abs() <= step[:, None] * 0.5 + 1e-3 * step[:, None]).all()


def test_int8_tiny_llama_follows_the_dense_model(tmp_path):
    from tests.tiny_models import make_tiny_model

    path = str(make_tiny_model("llama", tmp_path / "llama"))
    common = {"model": path, "dtype": "float32", "num_threads": 1, "num_kv_blocks": 64, "cpu_kernels": False}
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    prompts = ["Hello there", "The quick brown fox"]
    int8, dense = LLM(quantization="int8", **common), LLM(quantization="none", **common)
    try:
        layer = int8.engine.loaded.model.model.layers[0].mlp.gate_up_proj
        assert layer.weight is None and layer.quant.describe() == "Q8_0"
        assert int8.engine.loaded.model.lm_head.quant is None  # the LM head stays dense
        diffs = compare_greedy(prompts, int8.generate(prompts, params), dense.generate(prompts, params))
        assert len(diffs) >= 8 and sum(diffs) / len(diffs) < 0.05, diffs
    finally:
        int8.close()
        dense.close()


def test_lora_adds_its_delta_on_a_quantized_base(tmp_path):
    """A peft adapter on the int8 tiny Llama scores a text as the same adapter on a dense copy of the int8
    weights (s * q) does, within the activation rounding, while the adapter itself moves the scores far
    more: the delta is added on top of the quantized product."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import make_tiny_model
    from tokenmill import LoRARequest
    from tokenmill.quantization.int8 import int8_per_channel_blocks

    base = str(make_tiny_model("llama", tmp_path / "llama"))
    twin = tmp_path / "int8_as_dense"  # the same checkpoint with every int8-quantized weight replaced by s * q
    shutil.copytree(base, twin)
    state = load_file(str(twin / "model.safetensors"))
    for name, w in state.items():
        if w.dim() == 2 and "embed" not in name and "lm_head" not in name:
            blocks = int8_per_channel_blocks(w)
            state[name] = qgemm.dequantize(blocks.data, blocks.qtype, w.shape[1])
    save_file(state, str(twin / "model.safetensors"), metadata={"format": "pt"})
    torch.manual_seed(0)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                          LoraConfig(r=4, lora_alpha=16, init_lora_weights=False,
                                     target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]))
    peft.save_pretrained(tmp_path / "adapter")
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    common = {"model": base, "dtype": "float32", "num_threads": 1, "num_kv_blocks": 64, "cpu_kernels": False,
              "enable_lora": True, "max_lora_rank": 8}
    text = [{"prompt_token_ids": list(range(1000, 1400, 13))}]  # 31 tokens, 30 scored positions
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def scores(llm, adapter):
        out = llm.generate(text, params, lora_request=adapter)[0]
        ids = out.prompt_token_ids
        return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])

    int8 = LLM(quantization="int8", **common)
    dense = LLM(quantization="none", **{**common, "model": str(twin)})
    try:
        q_lora, d_lora, q_base = scores(int8, lora), scores(dense, lora), scores(int8, None)
        print(f"LoRA on int8: max |dlogp| against the dense twin {(q_lora - d_lora).abs().max():.4f}, "
              f"mean LoRA effect {(q_lora - q_base).abs().mean():.4f}")
        # int8 activations per group of 32 are the only difference from the twin; this random model's
        # scores (about -12 nats: very sharp distributions) amplify them to a few hundredths
        assert (q_lora - d_lora).abs().max() < 0.15
        assert (q_lora - q_base).abs().mean() > 20 * (q_lora - d_lora).abs().mean()
    finally:
        int8.close()
        dense.close()


def test_activation_rounding_ties_and_bf16_inputs_give_the_portable_bits():
    """Activations whose int8 scaling lands exactly on .5 (round half to even), bf16 activations, groups
    of zeros, of tiny values and with an inf or a NaN: every native build's tiled products equal the
    portable build's bit for bit (NaN where the input had one), so the SIMD activation quantization
    rounds, clamps and sums exactly as the scalar loop."""
    k, n = 96, 48
    halves = torch.arange(-63, 64, dtype=torch.float32) + 0.5  # -62.5 .. 63.5: every one a tie at scale 1
    rows = []
    for scale in (1.0, 0.25, 8.0):  # powers of two: x * (127 / max|x|) is exact
        for shift in range(3):
            v = torch.roll(halves, 7 * shift)[:k].clone()
            v[::32] = 127.0  # each group's max is 127: the scale factor is exactly 1
            rows.append(v * scale)
    x = torch.stack(rows)
    x[1, 40:64] = 0.0  # a group with zeros
    x[2, 64:] = 0.0  # an all-zero group
    x[3, 32:64] *= 1e-38  # max|x| below 127 / FLT_MAX: the inverse scale is not finite, the group counts 0
    x[4, 5] = float("inf")  # an infinity, a NaN: their groups' products are NaN on every path
    x[5, 70] = float("nan")
    data = random_blocks(8, n, k, seed=5)
    builds = {"portable": qgemm._load("portable")}
    for isa in ("avx2", "avx512"):
        if csrc_build.isa_supported(isa):
            builds[isa] = csrc_build.load_c_library(qgemm._SOURCE, "qgemm", qgemm._setup, qgemm._FLAGS, isa)
    if csrc_build.isa_supported("avx512") and "avx512_vnni" in csrc_build.cpu_flags():
        builds["avx512+vnni"] = csrc_build.load_c_library(qgemm._SOURCE, "qgemm", qgemm._setup,
                                                          (*qgemm._FLAGS, *qgemm._VNNI_FLAGS), "avx512")
    want = {}
    for name, lib in builds.items():
        tiled = qgemm._repack(lib, QuantizedTensor(8, (n, k), data))
        for dtype in (torch.float32, torch.bfloat16):
            y = qgemm._linear(lib, x.to(dtype), tiled.data, tiled.qtype, n, k, out_dtype=torch.float32)
            if name == "portable":
                want[dtype] = y
                assert y[[0, 1, 2, 3, 6, 7, 8]].isfinite().all() and y[[4, 5]].isnan().all()
            else:
                assert torch.equal(y.nan_to_num(7.0), want[dtype].nan_to_num(7.0)), \
                    f"{name}: {dtype} activations differ from the portable build"
    assert len(builds) > 1 or not csrc_build.isa_supported("avx2")


def test_amx_products_give_the_vnni_bits():
    """Where the CPU has AMX int8 tiles, products of 16 or more rows run on them (qgemm's tile_amx): every
    tiled format, float32 and bf16 activations and outputs, 16 to 70 rows (whole passes of 16, a short last
    pass, a last single row), and 1 or 2 threads give exactly the bits of the VNNI path, so a row's result
    still does not depend on how many rows share its step."""
    lib = qgemm.library.get()
    if not lib.qg_amx():
        pytest.skip("no AMX here (needs amx_tile and amx_int8, and a kernel that grants the tile state)")
    g = torch.Generator().manual_seed(3)
    threads = torch.get_num_threads()
    try:
        for qtype in (2, 3, 8):
            for n, k in ((48, 96), (37, 544)):  # 37: two tiles and 5 tail rows as stored
                t = qgemm.repack(QuantizedTensor(qtype, (n, k), random_blocks(qtype, n, k, seed=qtype + n)))
                for rows in (16, 17, 31, 33, 70):
                    x = torch.randn(rows, k, generator=g) * torch.logspace(-2, 1, rows).unsqueeze(1)
                    for dtype in (torch.float32, torch.bfloat16):
                        for out_dtype in (torch.float32, torch.bfloat16):
                            for num_threads in (1, 2):
                                torch.set_num_threads(num_threads)
                                lib.qg_set_amx(0)
                                want = qgemm.quantized_linear(x.to(dtype), t.data, t.qtype, n, k, out_dtype=out_dtype)
                                assert lib.qg_set_amx(1) == 1
                                got = qgemm.quantized_linear(x.to(dtype), t.data, t.qtype, n, k, out_dtype=out_dtype)
                                assert torch.equal(got, want), \
                                    f"{GGUF_QUANT_TYPES[qtype][0]} N={n} K={k} rows={rows} {dtype}->{out_dtype}"
                    one = qgemm.quantized_linear(x[5:6], t.data, t.qtype, n, k)  # one row: the VNNI path
                    assert torch.equal(one, qgemm.quantized_linear(x, t.data, t.qtype, n, k)[5:6])
    finally:
        lib.qg_set_amx(1)
        torch.set_num_threads(threads)


def test_amx_bf16_products_are_the_float_products_of_the_bf16_weights():
    """Where the CPU has AMX bf16 tiles, ``qgemm.bf16_linear`` multiplies bf16 activations by the weight's
    bf16-rounded values (exactly ``dequantize(..., bfloat16)``) in float32: against the float64 product of
    those two it is within float32 summation error (1e-5 * sum|x||w|), for every tiled format, 1 to 300
    rows (whole and partial blocks of 16 and of 32), an odd and an even number of 16-row weight tiles,
    float32 and bf16 outputs, strided outputs and 1 or 2 threads. Through ``GGUFWeight.matmul`` it runs
    only where ``amx_bf16_table`` says so, at the row count ``dispatch_rows`` names where it is set (a
    verify step), and never in deterministic mode (batch_invariant), which keeps the int8 kernel's bits."""
    from tokenmill.quantization.gguf_weight import GGUFWeight, dispatch_rows

    if not qgemm.amx_bf16():
        pytest.skip("no AMX bf16 here (needs amx_tile, amx_bf16 and avx512_bf16, and the tile state granted)")
    g = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    try:
        for qtype in (2, 3, 8):
            for n, k in ((48, 96), (64, 544), (16, 32)):
                t = qgemm.repack(QuantizedTensor(qtype, (n, k), random_blocks(qtype, n, k, seed=qtype + n)))
                w = qgemm.dequantize(t.data, t.qtype, k, dtype=torch.bfloat16).double()
                for rows in (1, 7, 16, 17, 33, 70, 300):
                    x = (torch.randn(rows, k, generator=g) * torch.logspace(-2, 1, rows).unsqueeze(1)).bfloat16()
                    ref = x.double() @ w.T
                    bound = 1e-5 * (x.double().abs() @ w.abs().T) + 1e-30
                    for out_dtype in (torch.float32, torch.bfloat16):
                        for num_threads in (1, 2):
                            torch.set_num_threads(num_threads)
                            got = qgemm.bf16_linear(x, t.data, t.qtype, n, k, out_dtype=out_dtype)
                            assert got is not None and got.dtype == out_dtype
                            if out_dtype == torch.float32:
                                got_f32 = got
                            name = f"{GGUF_QUANT_TYPES[qtype][0]} N={n} K={k} rows={rows} ->{out_dtype}"
                            if out_dtype == torch.float32:
                                assert ((got.double() - ref).abs() <= bound).all(), name
                            else:  # one more rounding, to bf16
                                assert torch.equal(got, ref.float().bfloat16()) or \
                                    ((got.double() - ref).abs() <= bound + ref.abs() * 2 ** -8).all(), name
                    if rows > 1:  # each row's bits depend on that row only (not M, not the thread count)
                        part = qgemm.bf16_linear(x[rows // 2:], t.data, t.qtype, n, k, out_dtype=torch.float32)
                        assert torch.equal(part, got_f32[rows // 2:]), name
                    wide = torch.full((rows, n + 8), 7.0)  # a strided output: the columns past n stay as they were
                    qgemm.bf16_linear(x, t.data, t.qtype, n, k, out=wide[:, 4:4 + n])
                    assert ((wide[:, 4:4 + n].double() - ref).abs() <= bound).all()
                    assert (wide[:, :4] == 7).all() and (wide[:, 4 + n:] == 7).all()
        assert qgemm.bf16_linear(torch.randn(3, k), t.data, t.qtype, n, k) is None  # float32 activations: not here
        weight = GGUFWeight([QuantizedTensor(3, (48, 96), random_blocks(3, 48, 96, seed=1))])
        x = torch.randn(40, 96, generator=g).bfloat16()
        int8 = weight.matmul(x)
        weight.amx_bf16_table = (True,)
        amx = weight.matmul(x)
        assert torch.equal(amx, qgemm.bf16_linear(x, weight.parts[0].data, weight.parts[0].qtype, 48, 96))
        assert not torch.equal(amx, int8)  # the int8 kernel rounds the activations: other bits
        assert torch.equal(weight.matmul(x, batch_invariant=True), int8)
        weight.amx_bf16_table = (False,) * 16 + (True,)  # AMX bf16 from 16 rows
        assert torch.equal(weight.matmul(x), amx)
        with dispatch_rows(4):  # a verify step of 4 requests: the kernel plain decoding of 4 rows takes
            assert torch.equal(weight.matmul(x), int8)
        assert torch.equal(weight.matmul(x), amx)
        assert torch.equal(weight.matmul(x.float()), qgemm.quantized_linear(x.float(), weight.parts[0].data,
                                                                            weight.parts[0].qtype, 48, 96))
    finally:
        torch.set_num_threads(threads)
