"""The lean step (tokenmill/runner/lean_decode.py) against the torch path it replaces.

With the torch path's layers on the C kernels the lean step calls (RMSNorm, SiLU×up, paged decode and
prefill attention, the quantized product), a decode step, a prefill and a mixed step (prompt chunks beside
decode queries) must give the same bits both ways: the hidden states after the final norm and every KV row
written, for float32 and bf16, on tiny int8 Llama / Qwen2 (biases) / Qwen3 (q/k norms) models, on tiny Mistral
and Qwen2 models with sliding windows (passed into the C step per layer) and on the embedded SmolLM2 Q4_1 GGUF;
greedy generation then gives the same tokens and logprobs. The check is repeated in a subprocess on another ISA
path (AVX2, or portable on an AVX2 machine). Steps the lean step does not
take (prompt chunks the plan keeps on SDPA, LoRA, quantized KV, deterministic mode, dense weights,
--no-cpu-kernels) run the torch path.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams, csrc_build
from tokenmill.attention import build_attention_metadata
from tokenmill.attention.layer import Attention
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import Linear
from tokenmill.runner import lean_decode

pytestmark = pytest.mark.skipif(not lean_decode.available() or csrc_build.kernels_disabled(),
                                reason="no C compiler, or TOKENMILL_DISABLE_CPU_KERNELS=1")
REPO = Path(__file__).resolve().parent.parent


def torch_path_on_c_kernels(model) -> None:
    """Every layer of the torch path on the C kernel the lean step calls, at every row count."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul)):
            module.cpu_kernel_table = (True,)
        elif isinstance(module, Attention):
            module.cpu_decode_kernel = module.cpu_prefill_kernel = True
        elif isinstance(module, Linear) and module.quant is not None:
            module.quant.dequantize_table = ()
        elif hasattr(type(module), "cpu_heads_table"):  # MLA's per-head products (models/deepseek.py)
            module.cpu_heads_table = (True,)


def step_both_ways(llm, context_lens: list[int], query_lens: list[int], seed: int = 0):
    """Prefill ``context_lens`` random sequences (torch path; 0: a new sequence), then run one step of
    ``query_lens`` new tokens of each (1: a decode query, more: a prompt chunk) through the torch path and,
    from the same KV cache, through the lean step. Returns ((hidden, kv) torch, (hidden, kv) lean); hidden
    [T, hidden] after the final norm, kv the runner's whole KV pool."""
    runner = llm.engine.runner
    model, lean = runner.model, runner.model.model.lean_decode
    assert lean is not None, runner.kernel_choice
    gen = np.random.default_rng(seed)
    block_size = runner.block_size
    lens, queries = np.asarray(context_lens, dtype=np.int64), np.asarray(query_lens, dtype=np.int64)
    blocks = [-(-int(n) // block_size) for n in lens + queries]
    ids = gen.permutation(np.arange(1, runner.num_kv_blocks))[: sum(blocks)]  # scattered block ids
    table = np.zeros((len(context_lens), max(blocks)), dtype=np.int64)
    for i, start in enumerate(np.cumsum([0, *blocks[:-1]])):
        table[i, : blocks[i]] = ids[start : start + blocks[i]]
    with torch.inference_mode():
        lean.enabled = False
        tokens = torch.from_numpy(gen.integers(3, runner.vocab_size, int(lens.sum() + queries.sum())))
        cached = lens > 0
        if cached.any():
            metadata, positions = build_attention_metadata(lens[cached], np.zeros_like(lens[cached]), table[cached],
                                                           block_size)
            model(tokens[: int(lens.sum())], torch.from_numpy(positions), runner.kv_caches, metadata)
        before = runner.kv_cache.clone()
        metadata, positions = build_attention_metadata(queries, lens, table, block_size)
        step = (tokens[int(lens.sum()):], torch.from_numpy(positions), runner.kv_caches, metadata)
        want = (model(*step), runner.kv_cache.clone())
        runner.kv_cache.copy_(before)
        lean.enabled = True
        steps = lean.steps
        got = (model(*step), runner.kv_cache.clone())
        assert lean.steps == steps + 1, "the lean step did not run"
    return want, got


def decode_step_both_ways(llm, context_lens: list[int], seed: int = 0):
    """``step_both_ways`` of one decode query per sequence."""
    return step_both_ways(llm, context_lens, [1] * len(context_lens), seed)


def assert_same_bits(want, got) -> None:
    (h_want, kv_want), (h_got, kv_got) = want, got
    assert h_got.dtype == h_want.dtype and torch.equal(h_got, h_want), \
        f"hidden states differ, max |diff| {(h_got.float() - h_want.float()).abs().max().item():.3g}"
    assert torch.equal(kv_got, kv_want), "the KV rows written differ"


def chat_with_the_step_off(llm, chats, params):
    """``llm.chat(chats, params)`` with the lean step switched off (the torch path runs every step)."""
    lean = llm.engine.runner.model.model.lean_decode
    lean.enabled = False
    try:
        return llm.chat(chats, params)
    finally:
        lean.enabled = True


def assert_same_tokens_and_logprobs(got, want) -> None:
    """The same generated token ids and the same logprob of each, output by output."""
    for g, w in zip(got, want, strict=True):
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids
        assert [lp[t].logprob for lp, t in zip(g.logprobs, g.token_ids)] == \
               [lp[t].logprob for lp, t in zip(w.logprobs, w.token_ids)]


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("lean")
    return {arch: str(make_tiny_model(arch, root / arch)) for arch in ("llama", "qwen2", "qwen3")}


def tiny_int8_engine(path: str, dtype: str, **kwargs) -> LLM:
    return LLM(model=path, dtype=dtype, quantization="int8", num_threads=2, num_kv_blocks=48, **kwargs)


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("qwen3", "float32"), ("qwen2", "bfloat16")])
def test_a_decode_step_gives_the_torch_path_bits_on_tiny_int8_models(tiny_paths, arch, dtype):
    llm = tiny_int8_engine(tiny_paths[arch], dtype)
    try:
        assert "lean decode step" in llm.engine.runner.kernel_choice
        torch_path_on_c_kernels(llm.engine.runner.model)
        assert_same_bits(*decode_step_both_ways(llm, [5, 17, 40]))  # 1, 2 and 3 blocks, scattered
        assert_same_bits(*decode_step_both_ways(llm, [33], seed=1))  # batch 1
        llm.engine.runner.model.model.lean_decode.threads = 1  # what ThreadChoice may switch to: the same bits
        assert_same_bits(*decode_step_both_ways(llm, [5, 17, 40], seed=2))
        llm.engine.runner.model.model.lean_decode.threads = None
        # mixed: decode queries around a new prompt and a chunk after a cached prefix
        assert_same_bits(*step_both_ways(llm, [5, 0, 17, 20, 40], [1, 11, 1, 7, 1], seed=3))
    finally:
        llm.close()


@pytest.mark.parametrize("arch, dtype, overrides", [
    ("mistral", "float32", {"sliding_window": 8}),  # every layer
    ("qwen2", "bfloat16", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),  # layers 1, 2
])
def test_sliding_window_layers_give_the_torch_path_bits(tmp_path, arch, dtype, overrides):
    """Each layer's window goes into the C step: decode queries and prompt chunks below, across and far past a
    window of 8 give the torch path's bits, and the same step with the windows left out of the description gives
    other hidden states (the window reaches the kernels)."""
    from tests.tiny_models import make_tiny_model

    llm = tiny_int8_engine(str(make_tiny_model(arch, tmp_path, **overrides)), dtype)
    try:
        model = llm.engine.runner.model
        lean = model.model.lean_decode
        assert lean is not None, llm.engine.runner.kernel_choice
        windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
        assert [lean._layers[i].sliding_window for i in range(len(windows))] == [w or 0 for w in windows]
        assert 8 in windows
        torch_path_on_c_kernels(model)
        assert_same_bits(*decode_step_both_ways(llm, [5, 8, 9, 17, 40]))
        assert_same_bits(*step_both_ways(llm, [5, 0, 17, 20, 40], [1, 11, 1, 7, 1], seed=3))
        want, got = decode_step_both_ways(llm, [17, 40], seed=4)
        for i in range(len(windows)):
            lean._layers[i].sliding_window = 0
        _, unwindowed = decode_step_both_ways(llm, [17, 40], seed=4)
        assert not torch.equal(unwindowed[0], got[0])
    finally:
        llm.close()


@pytest.fixture(scope="module")
def smollm2():
    llm = LLM(dtype="float32", num_threads=2, max_model_len=256, kv_cache_memory=0.05)
    yield llm
    llm.close()


def test_embedded_q4_1_model_decodes_the_same_bits_and_greedy_tokens(smollm2):
    runner = smollm2.engine.runner
    assert runner.loaded.quantization == "gguf" and "lean decode step" in runner.kernel_choice
    torch_path_on_c_kernels(runner.model)
    assert_same_bits(*decode_step_both_ways(smollm2, [20, 9]))
    lean = runner.model.model.lean_decode
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    chats = [[{"role": "user", "content": "What is the capital of France?"}]]
    steps = lean.steps
    got = smollm2.chat(chats, params)
    assert lean.steps - steps == 8  # the prompt's step (on the C prefill kernel here), then 7 decode steps
    assert_same_tokens_and_logprobs(got, chat_with_the_step_off(smollm2, chats, params))


def test_amx_bf16_products_give_the_torch_path_bits():
    """Where qgemm has AMX bf16 tiles, a bf16 decode step whose plan multiplies on them (the lean step's
    qlinear_bf16 pointer) gives the torch path's bits, and other bits than the int8 kernel: the tiles ran."""
    from tokenmill.quantization import qgemm

    if not qgemm.amx_bf16():
        pytest.skip("no AMX bf16 here")
    llm = LLM(dtype="bfloat16", num_threads=2, max_model_len=256, kv_cache_memory=0.05)
    try:
        model = llm.engine.runner.model
        torch_path_on_c_kernels(model)
        quants = [m.quant for m in model.modules() if isinstance(m, Linear) and m.quant is not None]
        lens = [5 + 3 * i for i in range(20)]  # 20 decode rows
        for quant in quants:
            quant.amx_bf16_table = (True,)
        amx = decode_step_both_ways(llm, lens, seed=4)
        assert_same_bits(*amx)
        for quant in quants:
            quant.amx_bf16_table = ()
        int8 = decode_step_both_ways(llm, lens, seed=4)
        assert_same_bits(*int8)
        assert not torch.equal(amx[0][0], int8[0][0])
    finally:
        llm.close()


def test_other_isa_path_gives_the_torch_path_bits(tiny_paths):
    """The whole process on another ISA path (TOKENMILL_CPU_ISA): AVX2 where this CPU has AVX-512, else portable."""
    other = "avx2" if csrc_build.selected_isa() != "avx2" and csrc_build.isa_supported("avx2") else "portable"
    code = ("import sys; from tests.test_lean_decode import check_tiny; check_tiny(sys.argv[1], sys.argv[2])")
    env = {**os.environ, "TOKENMILL_CPU_ISA": other}
    result = subprocess.run([sys.executable, "-c", code, tiny_paths["qwen3"], other], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    csrc_build.loaded_kernels.add(("lean_decode (subprocess)", other))


def check_tiny(path: str, isa: str) -> None:
    """test_other_isa_path_gives_the_torch_path_bits's subprocess: float32 (--dtype auto on a CPU without bf16
    arithmetic) on the forced path."""
    assert csrc_build.selected_isa() == isa
    llm = tiny_int8_engine(path, "float32")
    try:
        lean = llm.engine.runner.model.model.lean_decode
        assert lean is not None and lean.isa == isa
        torch_path_on_c_kernels(llm.engine.runner.model)
        assert_same_bits(*decode_step_both_ways(llm, [5, 17, 40]))
        assert_same_bits(*step_both_ways(llm, [5, 0, 17], [1, 9, 4], seed=1))
    finally:
        llm.close()


def test_engines_the_lean_step_does_not_serve_keep_the_torch_path(tiny_paths):
    """Quantized KV and LoRA engines are never given the step (deterministic mode and --no-cpu-kernels neither:
    tests/test_cpu_kernels.py checks their kernel_choice text, which would name it); dense weights are refused."""
    for why, kwargs in {"quantized KV cache": dict(kv_cache_dtype="int8"), "LoRA": dict(enable_lora=True)}.items():
        llm = tiny_int8_engine(tiny_paths["llama"], "float32", **kwargs)
        try:
            assert llm.engine.runner.model.model.lean_decode is None, why
            assert "lean decode step" not in llm.engine.runner.kernel_choice
            out = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
            assert len(out.token_ids) == 3
        finally:
            llm.close()
    from tests.tiny_models import tiny_config
    from tokenmill.models.llama import LlamaForCausalLM

    dense = LlamaForCausalLM(tiny_config("llama"))  # dense (unloaded) weights
    assert "dense" in lean_decode.install_lean_decode(dense, torch.float32, 16)
    assert dense.model.lean_decode is None


def test_prefill_and_mixed_steps_give_the_torch_path_bits(smollm2):
    """Steps with prompt chunks run in the lean step when the plan puts them on the C prefill kernel: a prefill
    of new prompts, a chunk after a cached prefix, and chunked prefill beside decode queries (the tokens of
    the decode queries before, between and after the chunks) give the torch path's bits."""
    runner = smollm2.engine.runner
    lean = runner.model.model.lean_decode
    torch_path_on_c_kernels(runner.model)
    mixed = lean.mixed_steps
    for contexts, queries in (([0, 0], [9, 20]), ([33], [17]), ([12, 0, 40, 21], [1, 19, 1, 1]),
                              ([0, 18, 7, 30], [5, 1, 1, 16])):
        assert_same_bits(*step_both_ways(smollm2, contexts, queries, seed=len(contexts)))
    assert lean.mixed_steps == mixed + 4


def test_prompt_chunks_the_plan_keeps_on_sdpa_take_the_torch_path(smollm2):
    """Where the plan runs prompt chunks on SDPA (the C prefill kernel measured slower), a step with prompt
    chunks is not the lean step's: it answers None and the torch path runs; decode-only steps still run."""
    runner = smollm2.engine.runner
    lean = runner.model.model.lean_decode
    torch_path_on_c_kernels(runner.model)
    for module in runner.model.modules():
        if isinstance(module, Attention):
            module.cpu_prefill_kernel = False
    try:
        table = np.array([[1, 2], [3, 4]], dtype=np.int64)
        for query_lens, computed in (([4, 1], [0, 7]), ([3, 3], [0, 0])):
            metadata, positions = build_attention_metadata(np.array(query_lens), np.array(computed), table, 16)
            ids = torch.ones(sum(query_lens), dtype=torch.int64)
            assert lean(runner.model.model, ids, torch.from_numpy(positions), runner.kv_caches, metadata) is None
        assert_same_bits(*decode_step_both_ways(smollm2, [20, 9], seed=5))
    finally:
        torch_path_on_c_kernels(runner.model)


def test_layouts_that_cover_a_token_twice_or_leave_the_pool_are_refused(smollm2):
    """ld_step refuses (-1, nothing written) a layout where a token is not exactly one decode query or one
    prompt-chunk token, or a slot or block id outside the KV pool; the layout the runner builds runs."""
    runner = smollm2.engine.runner
    lean = runner.model.model.lean_decode
    num_blocks = runner.kv_caches[0][0].shape[0]
    table = np.array([[1, 2, 0], [3, 0, 0], [4, 5, 6]], dtype=np.int64)
    query_lens, computed = np.array([1, 9, 1]), np.array([20, 0, 33])  # decode, a 9-token prompt, decode

    def attempt(mutate) -> tuple[int, bool]:
        metadata, positions = build_attention_metadata(query_lens, computed, table, runner.block_size)
        positions = torch.from_numpy(positions)
        batch, keep = lean_decode.step_batch(metadata, positions, num_blocks, True)
        positions, slot_mapping, decode_idx, block_table, seq_lens, q_start, q_len, ctx_len, prefill_table = keep
        mutate(locals())
        before = runner.kv_cache.clone()
        hidden = smollm2.engine.runner.model.model.embed_tokens(torch.ones(11, dtype=torch.int64)).contiguous()
        rc = lean._lib.ld_step(ctypes.byref(lean._desc), ctypes.byref(batch), lean._kv_pointers(runner.kv_caches),
                               hidden.data_ptr(), 1, 0)
        return rc, torch.equal(before, runner.kv_cache)

    assert attempt(lambda t: None) == (0, False)  # the runner's layout runs and writes its K/V
    bad = {
        "a decode query on a prompt token": lambda t: t["decode_idx"].__setitem__(0, 1),
        "the same decode query twice": lambda t: t["decode_idx"].__setitem__(1, 0),
        "a prompt chunk over a decode query": lambda t: t["q_start"].__setitem__(0, 0),
        "a slot past the pool": lambda t: t["slot_mapping"].__setitem__(3, num_blocks * runner.block_size),
        "a prompt block past the pool": lambda t: t["prefill_table"].__setitem__((0, 0), num_blocks),
        "a decode block below 0": lambda t: t["block_table"].__setitem__((1, 2), -1),
    }
    for name, mutate in bad.items():
        assert attempt(mutate) == (-1, True), name


def test_greedy_tokens_and_logprobs_are_the_same_with_the_step_on_and_off_under_the_runners_plan():
    """With the runner's own measured plan (not forced onto the C kernels), chunked prefill beside decoding
    and prefix-cache hits give the same tokens and logprobs with the lean step on and off: the runner puts
    the torch path's RMSNorm, SiLU×up and decode attention on the kernels the lean step calls."""
    llm = LLM(dtype="float32", num_threads=2, max_model_len=512, kv_cache_memory=0.05, max_num_batched_tokens=32)
    try:
        lean = llm.engine.runner.model.model.lean_decode
        assert lean is not None and "RMSNorm C," in llm.engine.runner.kernel_choice
        shared = "Here is a long shared instruction about answering briefly and politely. " * 3
        chats = [[{"role": "user", "content": shared + q}] for q in
                 ("What is 2 + 2?", "Name a colour.", "Say hello.", "What is the capital of Italy?")]
        chats += [[{"role": "user", "content": q}] for q in ("Count to five.", "Hi!")]
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
        mixed = lean.mixed_steps
        got = llm.chat(chats, params)
        assert lean.mixed_steps > mixed
        assert_same_tokens_and_logprobs(got, chat_with_the_step_off(llm, chats, params))
    finally:
        llm.close()


def test_parameters_moved_by_rl_sleep_and_wake_up_are_found_again(smollm2):
    """RL sleep frees every parameter and wake-up allocates it anew (tokenmill/rl/engine_ops.py): the step's
    pointers follow, and the bits stay the torch path's."""
    runner = smollm2.engine.runner
    torch_path_on_c_kernels(runner.model)
    params = list(runner.model.parameters())
    old = [p.data for p in params]
    with torch.no_grad():
        for p in params:
            p.data = p.data.clone()  # new storage, same values
        for tensor in old:
            tensor.fill_(float("nan"))  # what a stale pointer would now read
    assert_same_bits(*decode_step_both_ways(smollm2, [12], seed=2))


def test_thread_choice_moves_to_the_faster_count_and_tries_the_slower_one_less_and_less_often():
    choice = lean_decode.ThreadChoice()
    picks = []
    for step in range(300):
        threads = choice.pick(2)
        picks.append(threads)
        busy = step < 200  # another process on the other core: two threads wait at every barrier
        choice.record(threads, (0.3 if threads == 2 else 0.03) if busy else (0.008 if threads == 2 else 0.014))
    assert picks[:16] == [2] * 16 and picks[16] == 1  # the first trial of one thread wins
    trials = [i for i in range(17, 200) if picks[i] == 2]
    assert trials == [33, 66, 131], trials  # two threads retried after 16, 32, 64 steps
    assert picks[-1] == 2 and choice.current == 2  # the load went away: the next trial (step 260) won
    assert lean_decode.ThreadChoice().pick(1) == 1
