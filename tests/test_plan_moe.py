"""`tokenmill plan` for mixture-of-experts models: active parameters per token against a count made on the
transformers model (the modules one token touches), weight bytes under --quantization int8 and in bfloat16
(DeepSeek's float32 routers) against the loaded model's real bytes, the bytes a batch-1 decode step reads, and
the activation reserve's expert width (k × moe_intermediate_size, not intermediate_size).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.deepseek_models import make_deepseek_model
from tests.moe_models import make_moe_model
from tests.test_moe_gguf import _DRIVER
from tests.test_more_architectures import _CONVERT
from tokenmill.cli.main import main
from tokenmill.memory_plan import PlanConfig, activation_bytes, mlp_width, plan_memory, read_model_shape
from tokenmill.models.loader import load_model

ARCHS = ("mixtral", "qwen2_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    """arch -> (checkpoint dir, the transformers model saved there)."""
    out = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(f"plan_{arch}")
        hf = make_deepseek_model(arch, path) if arch.startswith("deepseek") else make_moe_model(arch, path)
        out[arch] = (str(path), hf)
    return out


def _numel(module: torch.nn.Module) -> int:
    """Values the module saves: parameters and persistent buffers (DeepSeek-V3's ``e_score_correction_bias``),
    a tied tensor once."""
    saved = {id(t): t for name, t in module.state_dict(keep_vars=True).items() if "rotary_emb" not in name}
    return sum(t.numel() for t in saved.values())


def touched_params(hf: torch.nn.Module) -> tuple[int, int]:
    """(parameters one token touches, MoE layers) counted on the transformers model: embeddings and LM head once,
    every layer's attention and norms, a dense MLP whole, and on a MoE layer the router (with its correction
    bias), the shared expert(s) and its gate, and k of the E routed experts (equal in size)."""
    config = hf.config
    k = config.num_experts_per_tok
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "n_routed_experts", None) or (
        config.num_experts)
    total, moe_layers = _numel(hf), 0
    for layer in hf.model.layers:
        mlp = getattr(layer, "block_sparse_moe", None) or layer.mlp
        experts = getattr(mlp, "experts", None)
        if experts is None:
            continue
        moe_layers += 1
        routed = _numel(experts)
        assert routed % num_experts == 0
        total -= routed - k * (routed // num_experts)  # the E - k experts the token did not choose
    return total, moe_layers


@pytest.mark.parametrize("arch", ARCHS)
def test_active_params_equal_the_modules_a_token_touches(models, arch):
    path, hf = models[arch]
    shape = read_model_shape(path)
    active, moe_layers = touched_params(hf)
    assert shape.num_params == _numel(hf)
    assert shape.num_moe_layers == moe_layers == {"mixtral": 2, "qwen2_moe": 2, "deepseek_v3": 2}[arch]
    assert shape.num_active_params == active < shape.num_params
    # float32 checkpoint, float32 run: a batch-1 decode step reads the active parameters, but the (untied)
    # embedding table only as one row
    plan = plan_memory(shape, PlanConfig(memory=2, dtype="float32", max_model_len=256))
    embed = hf.config.vocab_size * hf.config.hidden_size
    assert plan.active_weight_bytes == (active - embed + hf.config.hidden_size) * 4
    assert plan.weight_bytes == shape.num_params * 4


def engine_weight_bytes(path: str, dtype: str, quantization: str) -> int:
    """Bytes of the loaded model's parameters and quantized weight blocks (the RoPE tables are not weights)."""
    model = load_model(path, dtype, quantization=quantization).model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    blocks = sum(b.numel() * b.element_size() for name, b in model.named_buffers() if ".qweight_" in name)
    assert (blocks > 0) == (quantization == "int8")
    return params + blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_weight_bytes_equal_the_loaded_models(models, arch):
    """--quantization int8 quantizes experts, routers, shared experts and their gates, leaves kv_b_proj and
    layers whose in_features is not a multiple of 32 (the tiny V3's q_b_proj: q_lora_rank 24) dense."""
    path, _ = models[arch]
    shape = read_model_shape(path)
    plan = plan_memory(shape, PlanConfig(memory=2, dtype="float32", quantization="int8", max_model_len=256))
    assert plan.weight_bytes == engine_weight_bytes(path, "float32", "int8") < shape.num_params * 4
    assert plan.active_weight_bytes < plan.weight_bytes


def test_deepseek_bf16_counts_its_float32_routers(models):
    """DeepSeek keeps its router (and V3's correction bias) in float32 when the model runs in bfloat16."""
    path, hf = models["deepseek_v3"]
    shape = read_model_shape(path)
    plan = plan_memory(shape, PlanConfig(memory=2, dtype="bfloat16", max_model_len=256))
    assert plan.weight_bytes == engine_weight_bytes(path, "bfloat16", "none")
    routers = sum(_numel(layer.mlp.gate) for layer in hf.model.layers if hasattr(layer.mlp, "experts"))
    assert plan.weight_bytes == shape.num_params * 2 + routers * 2


def test_activation_reserve_uses_the_expert_width(models):
    """MoE layers hold k × moe_intermediate (+ the shared expert) per token, dense layers intermediate_size."""
    qwen = read_model_shape(models["qwen2_moe"][0])  # k 3 × 32 + shared 96 = 192 > dense layer's 128
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (8, 3, 32)
    assert mlp_width(qwen) == 3 * 32 + 96
    mixtral = read_model_shape(models["mixtral"][0])  # every layer MoE: 2 × 64, intermediate_size is per expert
    assert mlp_width(mixtral) == 2 * 64
    t, q, kv = 64, 4 * 16, 2 * 16  # tokens; 4 heads and 2 kv heads of 16
    step = t * (4 * 64 + 2 * q + 2 * kv + 3 * (3 * 32 + 96) + 2 * 3 * 64) * 4  # + (token, rank) rows and slots
    logits = 8 * qwen.vocab_size * 4 * 3
    prefill = 4 * t * 256 * 4 + 2 * 256 * kv * 4
    assert activation_bytes(qwen, 4, t, 8, 256) == step + logits + prefill


def test_cli_shows_active_parameters(models, capsys):
    path, _ = models["qwen2_moe"]
    shape = read_model_shape(path)
    assert main(["plan", path, "--memory", "2", "--max-model-len", "256", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["num_active_params"] == shape.num_active_params
    assert record["active_weight_bytes"] > 0 and record["model"]["num_experts"] == 8
    assert main(["plan", path, "--memory", "2", "--max-model-len", "256"]) == 0
    text = capsys.readouterr().out
    assert "experts: 8 routed of moe_intermediate 32, 3 per token, shared experts 96, on 2 of 3 layers" in text
    assert f"active parameters: {shape.num_active_params:,} per token" in text
    assert f"({record['active_weight_bytes']:,} B; tokens/s <= read bandwidth / this)" in text


@pytest.mark.skipif(_CONVERT is None, reason="llama.cpp's converter is not built here (scripts/build_llama_server.sh)")
def test_gguf_experts_in_blocks_count_k_of_e_of_their_stored_bytes(tmp_path):
    """A Mixtral converted and quantized to Q8_0 by llama.cpp's own tools: the same active parameters as its
    safetensors checkpoint, and a batch-1 decode step skips exactly the unchosen experts' stored blocks
    (``ffn_*_exps``, E - k of E) and all but one row of the untied embedding table."""
    from tokenmill.models.gguf_loader import kept_quantized_names, read_gguf_metadata, read_tensor_index

    hf_dir, f32, q8 = tmp_path / "mixtral", tmp_path / "mixtral.f32.gguf", tmp_path / "mixtral.q8_0.gguf"
    make_moe_model("mixtral", hf_dir, gguf_compatible=True)
    done = subprocess.run([sys.executable, "-c", _DRIVER, str(_CONVERT), f"{hf_dir}={f32}"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    quantize = _CONVERT.parent.parent / "bin" / "llama-quantize"
    if not quantize.is_file():
        pytest.skip("llama-quantize is not built here")
    run = subprocess.run([str(quantize), str(f32), str(q8), "Q8_0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    reference = read_model_shape(str(hf_dir))
    for gguf in (f32, q8):
        shape = read_model_shape(str(gguf))
        assert (shape.num_params, shape.num_active_params) == (reference.num_params, reference.num_active_params)
    shape = read_model_shape(str(q8))
    plan = plan_memory(shape, PlanConfig(memory=2, dtype="float32", max_model_len=256))
    assert plan.weight_bytes < shape.num_params * 4  # the experts stay in Q8_0 blocks
    index = read_tensor_index(read_gguf_metadata(q8))
    experts = {t.name: t.nbytes for t in index if "_exps." in t.name}
    assert set(experts) <= kept_quantized_names(index)
    embed = next(t for t in index if t.name == "token_embd.weight")
    embed_bytes = embed.nbytes if embed.name in kept_quantized_names(index) else math.prod(embed.shape) * 4
    unread = sum(experts.values()) * 6 // 8 + embed_bytes - embed_bytes // shape.vocab_size  # E 8, k 2
    assert plan.weight_bytes - plan.active_weight_bytes == unread
