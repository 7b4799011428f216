"""`tokenmill plan`: KV bytes per token, parameter counts and KV capacity equal hand-computed values and
the engine's real allocation, for a tiny Llama, a tiny Qwen3 (explicit head_dim != hidden/heads)
and the embedded SmolLM2 GGUF; nothing here loads weights except the engines built to compare with.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.tiny_models import make_tiny_model
from tokenmill import LLM
from tokenmill.cli.main import main
from tokenmill.csrc_build import cpu_has_native_bf16
from tokenmill.memory_plan import (
    RUNTIME_OVERHEAD_BYTES,
    PlanConfig,
    activation_bytes,
    kv_cache_memory_flag,
    plan_memory,
    read_model_shape,
)
from tokenmill.models.default_model import default_model_path
from tokenmill.models.gguf_loader import gguf_to_hf_config, open_gguf
from tokenmill.models.loader import LoadedModel, resolve_dtype
from tokenmill.runner.kv_cache_sizing import GIB
from tokenmill.runner.model_runner import ModelRunner

# Hand-computed parameter counts: embeddings + lm_head (49152 x 64 each) + per layer q,k,v,o,gate,up,down + norms.
# llama: q 64x64, k/v 64x32, o 64x64, mlp 3 x 64x128, 2 norms of 64 -> 36,992 per layer; x2 + final norm 64.
TINY_LLAMA_PARAMS = 2 * 49152 * 64 + 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192 + 128) + 64  # 6,365,504
# qwen3 (head_dim 32): q 64x128, k/v 64x64, o 128x64, mlp 3 x 64x128, norms 2x64 + q/k norms 2x32 -> 49,344 per layer.
TINY_QWEN3_PARAMS = 2 * 49152 * 64 + 2 * (8192 + 4096 + 4096 + 8192 + 3 * 8192 + 128 + 64) + 64  # 6,390,208
SMOLLM2_PARAMS = 134_515_008  # 30 layers, hidden 576, tied embeddings (the checkpoint's sum of tensor shapes)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("plan_llama")))


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    return str(make_tiny_model("qwen3", tmp_path_factory.mktemp("plan_qwen3"), dtype=torch.bfloat16))


def engine_blocks(model: str, kv_cache_memory: float, block_size: int) -> tuple[int, int]:
    """(num_kv_blocks, parameter count) of a real engine built with this KV budget."""
    llm = LLM(model=model, kv_cache_memory=kv_cache_memory, block_size=block_size, num_threads=1)
    params = sum(p.numel() for p in llm.engine.loaded.model.parameters())
    return llm.engine.runner.num_kv_blocks, params


def test_tiny_llama_numbers_and_engine_allocation(tiny_llama):
    shape = read_model_shape(tiny_llama)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.checkpoint_dtype) == (2, 2, 16, "float32")
    assert shape.num_params == TINY_LLAMA_PARAMS
    plan = plan_memory(shape, PlanConfig(memory=1.0, kv_cache_memory=0.01))
    assert plan.dtype == "float32" and plan.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 == 512
    assert plan.num_kv_blocks == int(0.01 * GIB) // (16 * 512) == 1310
    assert plan.num_kv_tokens == 1310 * 16
    assert plan.num_full_length_sequences == 1310 // (512 // 16) == 40
    assert plan.weight_bytes == TINY_LLAMA_PARAMS * 4
    blocks, params = engine_blocks(tiny_llama, 0.01, 16)
    assert (blocks, params) == (plan.num_kv_blocks, plan.model.num_params)


def test_memory_budget_split_matches_formula_and_engine(tiny_llama):
    config = PlanConfig(memory=0.75, memory_utilization=0.9, block_size=32, max_num_batched_tokens=256, max_num_seqs=8)
    plan = plan_memory(read_model_shape(tiny_llama), config)
    # activations: T x (4h + 2q + 2kv + 3i) x 4 + S x V x 12 + heads x C x L x 4 + 2 x L x kv x 4
    t, s, length, chunk = 256, 8, 512, 256
    expected_act = t * (4 * 64 + 2 * 64 + 2 * 32 + 3 * 128) * 4 + s * 49152 * 12 + 4 * chunk * length * 4 + 2 * length * 32 * 4
    assert plan.activation_bytes == expected_act
    budget = int(0.75 * 0.9 * GIB) - TINY_LLAMA_PARAMS * 4 - RUNTIME_OVERHEAD_BYTES - expected_act
    assert plan.kv_budget_bytes == budget
    assert plan.num_kv_blocks == budget // (32 * 512)
    assert plan.total_bytes <= plan.usable_bytes
    # the suggested --kv-cache-memory gives the engine exactly the planned blocks
    blocks, _ = engine_blocks(tiny_llama, plan.kv_cache_memory_flag, 32)
    assert blocks == plan.num_kv_blocks


def test_tiny_qwen3_explicit_head_dim(tiny_qwen3):
    shape = read_model_shape(tiny_qwen3)
    assert (shape.head_dim, shape.checkpoint_dtype, shape.num_params) == (32, "bfloat16", TINY_QWEN3_PARAMS)
    plan = plan_memory(shape, PlanConfig(memory=1.0, kv_cache_memory=0.005, block_size=8))
    # dtype auto: bf16 where the CPU has bf16 arithmetic, float32 elsewhere (the engine's rule)
    elt = 2 if cpu_has_native_bf16() else 4
    assert plan.dtype == ("bfloat16" if elt == 2 else "float32")
    assert plan.kv_bytes_per_token == 2 * 2 * 2 * 32 * elt
    assert plan.num_kv_blocks == int(0.005 * GIB) // (8 * 2 * 2 * 2 * 32 * elt)
    fp8 = plan_memory(shape, PlanConfig(memory=1.0, kv_cache_memory=0.005, block_size=8, kv_cache_dtype="fp8"))
    # one byte per element plus a float16 scale per token, KV head, K and V, layer (as the runner allocates)
    assert fp8.kv_bytes_per_token == 256 + 2 * 2 * 2 * 2 and fp8.num_kv_blocks == int(0.005 * GIB) // (8 * 272)
    blocks, params = engine_blocks(tiny_qwen3, 0.005, 8)
    assert (blocks, params) == (plan.num_kv_blocks, plan.model.num_params)


def test_embedded_smollm2_gguf_matches_model_runner():
    shape = read_model_shape(None)
    assert (shape.file_format, shape.num_layers, shape.num_kv_heads, shape.head_dim) == ("gguf", 30, 3, 64)
    assert shape.num_params == SMOLLM2_PARAMS
    plan = plan_memory(shape, PlanConfig(memory=1.5, max_model_len=2048))
    elt = 2 if cpu_has_native_bf16() else 4  # dtype auto, as the engine decides it on this CPU
    assert plan.dtype == ("bfloat16" if elt == 2 else "float32")
    assert plan.kv_bytes_per_token == 2 * 30 * 3 * 64 * elt
    assert plan.num_kv_blocks == plan.kv_budget_bytes // (16 * plan.kv_bytes_per_token)
    assert plan.num_full_length_sequences == plan.num_kv_blocks // 128
    # The engine's sizing path on the same config (weights not needed to size the pool).
    path = default_model_path()
    loaded = LoadedModel(model=None, hf_config=gguf_to_hf_config(open_gguf(path)), tokenizer=None, generation_config={},
                         eos_token_ids=set(), model_path=str(path), dtype=resolve_dtype("auto", None))
    runner = ModelRunner(loaded, 16, None, plan.kv_cache_memory_flag)
    assert runner.bytes_per_token == plan.kv_bytes_per_token
    assert runner.num_kv_blocks == plan.num_kv_blocks


def test_kv_cache_memory_flag_round_trips_through_engine_arithmetic():
    for bytes_per_block in (8192, 368_640, 737_280, 4096 * 3):
        for blocks in (1, 7, 1310, 7211, 123_457):
            budget = blocks * bytes_per_block + bytes_per_block // 3
            flag = kv_cache_memory_flag(blocks, bytes_per_block, budget)
            assert int(flag * GIB) // bytes_per_block == blocks
            assert int(flag * GIB) <= budget
            assert len(repr(flag)) <= 14


def test_errors_name_the_field(tiny_llama):
    shape = read_model_shape(tiny_llama)
    with pytest.raises(ValueError, match="^memory"):
        plan_memory(shape, PlanConfig(memory=0.25))
    with pytest.raises(ValueError, match="max_model_len"):
        plan_memory(shape, PlanConfig(memory=1.0, max_model_len=4096))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        PlanConfig(memory=1.0, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="not a local"):
        read_model_shape("/no/such/model")
    assert activation_bytes(shape, 4, 1, 1, 1) > 0


def test_cli_json_and_text(tiny_llama, capsys):
    assert main(["plan", tiny_llama, "--memory", "1", "--kv-cache-memory", "0.01", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["kv_bytes_per_token"], record["num_kv_blocks"], record["model"]["num_params"]) == (
        512, 1310, TINY_LLAMA_PARAMS)
    assert main(["plan", tiny_llama, "--memory", "1", "--kv-cache-dtype", "fp8"]) == 0
    text = capsys.readouterr().out
    assert "KV bytes per token: 2 x 2 layers x 2 kv heads x (16 head_dim x 1 B (fp8) + a 2 B scale) = 144 B" in text
    assert f"tokenmill serve {tiny_llama} --dtype float32" in text and "--num-kv-blocks" in text
    assert "--kv-cache-dtype fp8" in text
    assert main(["plan", tiny_llama, "--memory", "0.1"]) == 2  # ValueError -> exit code 2, message on stderr
    assert "error: --memory 0.1 GiB x --memory-utilization 0.9 leaves no room" in capsys.readouterr().err
