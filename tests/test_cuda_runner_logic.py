"""The CUDA execution path's logic, checked on CPU; tests that need a GPU are skipped without one.

On CPU: decode bucket sizes and choice, padding of decode inputs, KV-pool sizing arithmetic,
the device-side step layout against ``build_attention_metadata``, padding rows never touching real
KV blocks, and — the main check — the CUDA runner's padded ("graph-shaped") decode path run eagerly
with the reference CPU attention, whose tokens must equal the CPU ModelRunner's. The same runner
with the Triton kernels under triton's interpreter is in test_cuda_runner_interpreted.py.
On CUDA: graphs on vs off give identical tokens, greedy equality with transformers, profiled KV
sizing, seeded sampling, and the deterministic mode refused.
"""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.offline_models import random_config, save_random_model
from tokenmill import LLM, SamplingParams
from tokenmill.attention import build_attention_metadata
from tokenmill.config import EngineConfig
from tokenmill.models.loader import load_model, resolve_dtype
from tokenmill.runner.cuda_runner import CudaModelRunner
from tokenmill.runner.deterministic import check_deterministic_supported
from tokenmill.runner.device import resolve_device
from tokenmill.runner.gpu_memory import MemoryProfile, kv_cache_budget_bytes
from tokenmill.runner.input_buffers import StepBuffers, fetch_to_host
from tokenmill.runner.padded_decode import (
    DecodeBuffers,
    PaddedDecodeInputs,
    choose_bucket,
    graph_batch_sizes,
    pad_decode_inputs,
    run_padded_decode,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GIB = 1024**3


# ---- buckets -------------------------------------------------------------------------------
def test_graph_batch_sizes_are_powers_of_two_then_multiples_of_eight():
    assert graph_batch_sizes(128) == [1, 2, 4, 8, *range(16, 129, 8)]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]  # max_num_seqs itself is always captured
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]


def test_choose_bucket_picks_the_smallest_size_that_fits():
    sizes = graph_batch_sizes(40)
    assert [choose_bucket(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 40)] == [1, 2, 4, 8, 8, 16, 16, 24, 40, 40]
    assert choose_bucket(41, sizes) is None


# ---- padding -------------------------------------------------------------------------------
def test_pad_decode_inputs_fills_real_rows_and_points_padding_at_the_padding_block():
    block_size, padding_block = 4, 99
    out = PaddedDecodeInputs.zeros(bucket=6, max_blocks=5)
    out.block_table[:] = -7  # stale contents from an earlier step
    block_table = np.array([[3, 8, 0], [5, 0, 0], [1, 2, 6]])
    positions = np.array([5, 0, 9])  # block 1 offset 1; block 0 offset 0; block 2 offset 1
    pad_decode_inputs(out, np.array([11, 12, 13]), positions, block_table, block_size, padding_block)

    assert out.input_ids.tolist() == [11, 12, 13, 0, 0, 0]
    assert out.positions.tolist() == [5, 0, 9, 0, 0, 0]
    assert out.seq_lens.tolist() == [6, 1, 10, 1, 1, 1]
    assert out.slot_mapping.tolist() == [8 * 4 + 1, 5 * 4 + 0, 6 * 4 + 1] + [padding_block * block_size] * 3
    assert out.block_table[:3, :3].tolist() == block_table.tolist()
    assert (out.block_table[3:, 0] == padding_block).all()
    # Columns no kernel reads (past a row's context) are left alone.
    assert (out.block_table[:, 3:] == -7).all() and (out.block_table[3:, 1:] == -7).all()


def test_decode_buffers_metadata_is_views_of_the_static_buffers():
    buffers = DecodeBuffers(max_batch_size=8, max_blocks=4, block_size=4, padding_block_id=50,
                            device=torch.device("cpu"), reference_views=True)
    meta = buffers.metadata(4)
    assert meta is buffers.metadata(4)  # built once per bucket
    assert meta.num_prefills == 0 and meta.decode_token_idx.tolist() == [0, 1, 2, 3]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.seq_lens.tolist() == [1, 1, 1, 1]  # all padding before any step
    buffers.load(np.array([7, 9]), np.array([2, 6]), np.array([[4, 0], [1, 3]]), 4, np.array([0, 1]))
    # The cached metadata sees the new contents: same storage, no rebuild.
    assert meta.seq_lens.tolist() == [3, 7, 1, 1]
    assert meta.slot_mapping.tolist() == [4 * 4 + 2, 3 * 4 + 2, 200, 200]
    assert meta.block_table[:, 0].tolist() == [4, 1, 50, 50]
    assert meta.decode_key_mask[:, 0, 0, :8].sum(dim=1).tolist() == [3, 7, 1, 1]
    assert buffers.sample_idx[:2].tolist() == [0, 1]
    assert buffers.input_ids[:4].tolist() == [7, 9, 0, 0]


# ---- memory --------------------------------------------------------------------------------
def test_kv_cache_budget_is_the_utilised_memory_left_after_the_profiled_peak():
    profile = MemoryProfile(total=80 * GIB, weights=16 * GIB, peak=20 * GIB, non_torch=1 * GIB)
    assert kv_cache_budget_bytes(profile, 0.9, reserve=GIB // 2) == int(0.9 * 80 * GIB) - 21 * GIB - GIB // 2
    assert kv_cache_budget_bytes(profile, 1.0, reserve=0) == 59 * GIB
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_budget_bytes(profile, 0.25, reserve=0)  # 20 GiB allowed < 21 GiB used


# ---- config, device, dtype -----------------------------------------------------------------
def test_engine_config_validates_device_and_memory_fraction():
    EngineConfig(device="cuda:1", gpu_memory_utilization=1.0, enforce_eager=True)  # accepted
    for bad in ("tpu", "cuda:x", "gpu"):
        with pytest.raises(ValueError, match="device"):
            EngineConfig(device=bad)
    for bad in (0.0, -0.1, 1.01, float("nan")):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)


def test_cli_flags_reach_the_engine_kwargs():
    from tokenmill.cli.main import build_parser, engine_kwargs

    args = build_parser().parse_args(
        ["chat", "--device", "cuda", "--gpu-memory-utilization", "0.5", "--enforce-eager"]
    )
    kwargs = engine_kwargs(args)
    assert (kwargs["device"], kwargs["gpu_memory_utilization"], kwargs["enforce_eager"]) == ("cuda", 0.5, True)
    defaults = engine_kwargs(build_parser().parse_args(["chat"]))
    assert (defaults["device"], defaults["gpu_memory_utilization"], defaults["enforce_eager"]) == ("auto", 0.9, False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's answers")
def test_device_resolution_without_cuda():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")


def test_auto_dtype_is_bfloat16_on_cuda_and_follows_the_checkpoint_on_cpu():
    assert resolve_dtype("auto", torch.float32, torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.float32, torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float32", torch.float32, torch.device("cuda", 0)) == torch.float32


def test_deterministic_mode_is_refused_on_cuda():
    with pytest.raises(ValueError, match="CPU backend only"):
        check_deterministic_supported(torch.float32, torch.device("cuda", 0))


# ---- device-side step layout ---------------------------------------------------------------
def test_step_buffers_lay_out_the_same_step_as_build_attention_metadata():
    rng = np.random.default_rng(0)
    query_lens = np.array([1, 7, 1, 16, 3])
    num_computed = np.array([9, 0, 30, 5, 12])
    block_size = 4
    widths = -(-(query_lens + num_computed) // block_size)
    block_table = np.zeros((5, widths.max()), dtype=np.int64)
    for i, w in enumerate(widths):
        block_table[i, :w] = rng.permutation(100)[:w]
    input_ids = rng.integers(0, 1000, size=int(query_lens.sum()))
    buffers = StepBuffers(max_num_tokens=64, max_num_reqs=8, max_blocks_per_req=16, block_size=block_size,
                          device=torch.device("cpu"))
    staged = buffers.stage(input_ids, query_lens, num_computed, block_table, np.array([0, 1, 2, 3, 4]))
    want, positions = build_attention_metadata(query_lens, num_computed, block_table, block_size)
    got = staged.metadata
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "decode_token_idx"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.num_prefills == want.num_prefills == 3
    assert staged.positions.tolist() == positions.tolist()
    assert staged.input_ids.tolist() == input_ids.tolist()
    assert staged.sample_idx.tolist() == (want.query_start_loc[1:] - 1).tolist()  # each request's last token


def test_fetch_to_host_returns_lists():
    assert fetch_to_host([torch.tensor([1, 2]), torch.tensor([[0.5]])]) == [[1, 2], [[0.5]]]


# ---- the padded decode path on CPU ---------------------------------------------------------
VOCAB = 4096


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny random Llama with a synthetic tokenizer (no downloads: runs on the GPU machine too)."""
    config = random_config("llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           initializer_range=0.2)
    return save_random_model(tmp_path_factory.mktemp("llama"), config, torch.float32)


def _use_cuda_runner(llm: LLM, attention_backend: str) -> CudaModelRunner:
    """Swap the engine's CPU ModelRunner for the CUDA runner over the same model and pool size."""
    engine = llm.engine
    runner = CudaModelRunner(engine.loaded, engine.config.cache, engine.scheduler_config,
                             attention_backend=attention_backend)
    assert runner.num_kv_blocks == engine.runner.num_kv_blocks
    engine.runner = runner
    return runner


def _workload(seed: int, num: int) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts of mixed lengths with different max_tokens, so decode batches shrink through the buckets."""
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 40))]}
               for _ in range(num)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(2, 14), logprobs=2 if i % 3 == 0 else None,
                             prompt_logprobs=1 if i == 1 else None)
              for i in range(num)]
    return prompts, params


def test_padded_decode_rows_write_only_their_slots_and_the_padding_block(tiny_llama):
    loaded = load_model(str(tiny_llama), dtype="float32")
    layers, kv_heads, head_dim, block_size, num_blocks = loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, 4, 12
    padding_block = num_blocks - 1
    kv = torch.zeros(layers, 2, num_blocks, block_size, kv_heads, head_dim)
    kv_caches = [(kv[i, 0], kv[i, 1]) for i in range(layers)]
    buffers = DecodeBuffers(8, 3, block_size, padding_block, torch.device("cpu"), reference_views=True)
    # Two requests at positions 5 and 2 (contexts in blocks [2, 7] and [4]); bucket 8 = 6 padding rows.
    buffers.load(np.array([500, 600]), np.array([5, 2]), np.array([[2, 7], [4, 0]]), 8, np.array([0, 1]))
    with torch.inference_mode():
        hidden = run_padded_decode(loaded.model, kv_caches, buffers, 8)
    assert hidden.shape == (8, loaded.hf_config.hidden_size) and torch.isfinite(hidden).all()
    written = kv.abs().sum(dim=(0, 1, 4, 5)) != 0  # (num_blocks, block_size)
    expected = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    expected[7, 1] = expected[4, 2] = expected[padding_block, 0] = True
    assert torch.equal(written, expected)


def test_padded_decode_hidden_states_match_the_unpadded_forward(tiny_llama):
    loaded = load_model(str(tiny_llama), dtype="float32")
    layers, block_size = loaded.num_layers, 4
    rng = torch.Generator().manual_seed(0)
    kv = torch.randn(layers, 2, 10, block_size, loaded.num_kv_heads, loaded.head_dim, generator=rng)
    block_table = np.array([[1, 3, 5], [2, 0, 0], [6, 7, 8]])
    positions = np.array([9, 1, 11])
    input_ids = np.array([321, 654, 987])
    with torch.inference_mode():
        kv_ref = kv.clone()
        meta, pos = build_attention_metadata(np.ones(3, dtype=np.int64), positions, block_table, block_size)
        want = loaded.model(torch.from_numpy(input_ids), torch.from_numpy(pos),
                            [(kv_ref[i, 0], kv_ref[i, 1]) for i in range(layers)], meta)
        buffers = DecodeBuffers(4, 3, block_size, 9, torch.device("cpu"), reference_views=True)
        buffers.load(input_ids, positions, block_table, 4, np.arange(3))
        got = run_padded_decode(loaded.model, [(kv[i, 0], kv[i, 1]) for i in range(layers)], buffers, 4)
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv[:, :, :9], kv_ref[:, :, :9])  # identical writes outside the padding block


@pytest.mark.parametrize("num_kv_blocks,max_num_batched_tokens,num_prompts", [(256, 64, 11), (20, 32, 6)])
def test_cuda_runner_on_cpu_matches_the_cpu_runner(tiny_llama, num_kv_blocks, max_num_batched_tokens, num_prompts):
    """Padded decode (eager, reference attention) + the general path: same tokens and
    log-probabilities as the CPU ModelRunner; the second case forces chunked prefill and preemption."""
    prompts, params = _workload(seed=num_kv_blocks, num=num_prompts)
    kwargs = dict(model=str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=num_kv_blocks,
                  block_size=4, max_num_batched_tokens=max_num_batched_tokens)
    want = LLM(**kwargs).generate(prompts, params)
    llm = LLM(**kwargs)
    runner = _use_cuda_runner(llm, "torch")
    got = llm.generate(prompts, params)

    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert runner.num_padded_decode_steps > 0 and runner.num_general_steps > 0
    for g, w in zip(got, want):
        if w.outputs[0].logprobs is not None:
            for gp, wp in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert gp.keys() == wp.keys()
                assert all(abs(gp[t].logprob - wp[t].logprob) < 1e-4 for t in wp)
        if w.prompt_logprobs is not None:
            assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
    if num_kv_blocks == 20:
        assert llm.engine.scheduler.num_preemptions_total > 0
    llm.engine.check_integrity()


# ---- on a GPU ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_llama(tmp_path_factory) -> Path:
    config = random_config("llama", vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                           initializer_range=0.2)
    return save_random_model(tmp_path_factory.mktemp("gpu_llama"), config, torch.float32)


def _gpu_prompts(seed: int, num: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(rng.randrange(4, 300))]} for _ in range(num)]


@needs_cuda
def test_cuda_graphs_on_and_off_give_identical_tokens(gpu_llama):
    prompts = _gpu_prompts(1, 37)
    params = [SamplingParams(temperature=0.0, max_tokens=5 + i % 23, ignore_eos=True) for i in range(len(prompts))]
    outputs = {}
    for eager in (False, True):
        llm = LLM(model=str(gpu_llama), dtype="bfloat16", device="cuda", enforce_eager=eager, num_kv_blocks=2048,
                  max_num_seqs=48)
        assert (llm.engine.runner.graphs is None) == eager
        outputs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.runner.num_padded_decode_steps > 0
        del llm
    assert outputs[False] == outputs[True]


@needs_cuda
def test_cuda_greedy_matches_transformers_in_float32(gpu_llama):
    from transformers import AutoModelForCausalLM

    prompts = _gpu_prompts(2, 6)
    llm = LLM(model=str(gpu_llama), dtype="float32", device="cuda", num_kv_blocks=1024)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))]
    hf = AutoModelForCausalLM.from_pretrained(gpu_llama, dtype=torch.float32).cuda().eval()
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt["prompt_token_ids"]], device="cuda")
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              pad_token_id=0)
        assert tokens == out[0, ids.shape[1]:].tolist()


@needs_cuda
def test_cuda_pool_is_sized_from_gpu_memory_utilization(gpu_llama):
    llm = LLM(model=str(gpu_llama), device="cuda", gpu_memory_utilization=0.3)
    runner = llm.engine.runner
    assert runner.device.type == "cuda" and runner.kv_cache.is_cuda and runner.kv_dtype == torch.bfloat16
    total = torch.cuda.get_device_properties(runner.device).total_memory
    assert 0 < runner.kv_cache.numel() * runner.kv_cache.element_size() < 0.3 * total


@needs_cuda
def test_cuda_seeded_sampling_and_logprobs(gpu_llama):
    # No prefix caching: the second run must compute exactly what the first did.
    llm = LLM(model=str(gpu_llama), device="cuda", num_kv_blocks=512, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=8, logprobs=3)
    first = llm.generate(_gpu_prompts(3, 4), params)
    again = llm.generate(_gpu_prompts(3, 4), params)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert all(len(o.outputs[0].logprobs) == 8 for o in first)


@needs_cuda
def test_cuda_deterministic_mode_is_refused_before_loading(gpu_llama):
    with pytest.raises(ValueError, match="CPU backend only"):
        LLM(model=str(gpu_llama), device="cuda", deterministic=True)
