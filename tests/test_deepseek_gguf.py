"""DeepSeek-V2 / V3 GGUF files (llama.cpp's ``deepseek2`` architecture) made by llama.cpp's own tools:
convert_hf_to_gguf.py (F32) on the tiny V2 and V3 models of tests/deepseek_models.py, llama-quantize (Q8_0) on V3.

Proves: the config read from the ``deepseek2.*`` metadata equals the HF config (V2 or V3 chosen by the gating
function; MLA sizes from ``key_length_mla`` / ``value_length_mla``; MoE, groups, YaRN with ``yarn_log_multiplier``);
``kv_b_proj`` rebuilt from the converter's ``attn_k_b`` / ``attn_v_b`` and every other tensor equal the checkpoint's;
the F32 files give transformers' greedy tokens (prefix caching, chunked prefill); the Q8_0 file keeps its experts in
blocks, its ``kv_b_proj`` dense, and dequantized gives the greedy tokens of transformers on the same dequantized
weights; a file of the older layout (``attn_kv_b``, per-head ``key_length`` / ``value_length``) loads the same model.
Skipped where scripts/build_llama_server.sh has not built llama.cpp. The tiny V2 is not quantized: this llama-quantize
asks a deepseek2 file with ``attn_q`` for ``q_lora_rank`` unless it has V2-Lite's 27 layers.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.deepseek_models import DEEPSEEK_ARCHS, KV_LORA_RANK, QK_ROPE_HEAD_DIM, make_deepseek_model
from tests.test_moe_gguf import _DRIVER, _tokenizer_from_hf_dir
from tests.test_more_architectures import _CONVERT
from tokenmill import LLM, SamplingParams
from tokenmill.memory_plan import read_model_shape
from tokenmill.models import load_model
from tokenmill.models.errors import UnsupportedModelError
from tokenmill.models.gguf_loader import (gguf_to_hf_config, iter_gguf_weights, load_gguf_tokenizer,
                                          read_gguf_metadata)

pytestmark = pytest.mark.skipif(_CONVERT is None, reason="llama.cpp's converter is not built here "
                                "(scripts/build_llama_server.sh)")

# V3's config.json as DeepSeek ships it says scoring_func (the converter writes expert_gating_func from it; without
# it llama.cpp routes softmax); num_key_value_heads as the heads (the converter splits kv_b_proj by it; MLA ignores it)
_V3_EXTRA = {"scoring_func": "sigmoid", "num_key_value_heads": 4}
PROMPTS = [[(31 * i + 7 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate((10, 33))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
_CONFIG_FIELDS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim",
                  "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
                  "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob", "vocab_size",
                  "tie_word_embeddings", "max_position_embeddings")


@pytest.fixture(scope="module")
def gguf_cache_dir(tmp_path_factory):
    from tests.test_gguf_cache import fresh_gguf_cache

    with pytest.MonkeyPatch.context() as monkeypatch:
        yield fresh_gguf_cache(tmp_path_factory.mktemp("gguf_cache"), monkeypatch)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """arch -> (HF dir, transformers model, F32 GGUF, Q8_0 GGUF or None: V3 only, where llama-quantize is built)."""
    root = tmp_path_factory.mktemp("deepseek_gguf")
    models = {arch: make_deepseek_model(arch, root / arch, **(_V3_EXTRA if arch == "deepseek_v3" else {}))
              for arch in DEEPSEEK_ARCHS}
    pairs = [f"{root / arch}={root / f'{arch}.f32.gguf'}" for arch in DEEPSEEK_ARCHS]
    done = subprocess.run([sys.executable, "-c", _DRIVER, str(_CONVERT), *pairs], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    quantize = _CONVERT.parent.parent / "bin" / "llama-quantize"
    q8 = root / "deepseek_v3.q8_0.gguf"
    if quantize.is_file():
        run = subprocess.run([str(quantize), str(root / "deepseek_v3.f32.gguf"), str(q8), "Q8_0"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
    return {arch: (root / arch, models[arch], root / f"{arch}.f32.gguf",
                   q8 if arch == "deepseek_v3" and q8.is_file() else None) for arch in DEEPSEEK_ARCHS}


def _checkpoint_names(weights) -> dict[str, torch.Tensor]:
    """tokenmill's names from the GGUF -> the checkpoint's (``mlp.shared_experts``), tensors cloned."""
    return {name.replace(".mlp.shared_expert.", ".mlp.shared_experts."): tensor.contiguous().clone()
            for name, tensor in weights}


def _assert_config_reads_back(config, hf_config) -> None:
    for name in _CONFIG_FIELDS:
        assert getattr(config, name) == getattr(hf_config, name), name
    assert config.routed_scaling_factor == pytest.approx(hf_config.routed_scaling_factor)
    assert config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)
    assert type(config) is type(hf_config)
    ours, theirs = config.rope_parameters, hf_config.rope_parameters
    assert set(ours) == set(theirs)
    for key, value in theirs.items():  # YaRN's mscale went through float32 (yarn_log_multiplier)
        assert ours[key] == (pytest.approx(value) if isinstance(value, float) else value), key


@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_deepseek2_config_and_weights_read_back_to_the_checkpoint(ggufs, arch):
    """The config from the metadata equals the HF config (V3 by its sigmoid gating: topk_method stays V2's), and
    every tensor, ``kv_b_proj`` rebuilt from ``attn_k_b`` / ``attn_v_b``, equals the checkpoint's."""
    hf_dir, hf, f32, _ = ggufs[arch]
    reader = read_gguf_metadata(f32)
    assert reader.fields["general.architecture"] == "deepseek2"
    assert {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"} <= {t.name for t in reader.tensors}
    config = gguf_to_hf_config(reader)
    _assert_config_reads_back(config, hf.config)
    if arch == "deepseek_v2":
        assert config.topk_method == hf.config.topk_method == "group_limited_greedy"
    else:
        assert config.rope_interleave is True
    ours = _checkpoint_names(iter_gguf_weights(reader, config))
    checkpoint = load_file(str(hf_dir / "model.safetensors"))
    assert set(ours) == set(checkpoint)
    for name, tensor in checkpoint.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=name)
    assert read_model_shape(str(f32)).kv_latent_dim == KV_LORA_RANK + QK_ROPE_HEAD_DIM  # `tokenmill plan`


def test_deepseek2_tokenizer_is_rebuilt_from_the_file(ggufs):
    """transformers has no model type named deepseek2: the tokenizer still comes from the tokenizer.ggml.* fields."""
    hf_dir, _, f32, _ = ggufs["deepseek_v2"]
    text = "Hello world, 12345 tokens!"
    assert load_gguf_tokenizer(f32)(text).input_ids == AutoTokenizer.from_pretrained(str(hf_dir))(text).input_ids


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _llm_greedy(path: Path, **kwargs) -> list[list[int]]:
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=16, block_size=4, num_kv_blocks=128,
              enable_prefix_caching=True, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.close()


@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_llama_cpp_f32_deepseek2_greedy_matches_transformers(ggufs, arch, gguf_cache_dir):
    """The converter's F32 file runs greedy-equal to transformers (the rope pairs as llama.cpp rotates them, V2's
    grouped softmax routing, V3's sigmoid routing with its correction bias and YaRN)."""
    hf_dir, hf, f32, _ = ggufs[arch]
    _tokenizer_from_hf_dir(f32, hf_dir)
    assert _llm_greedy(f32) == [_hf_greedy(hf, p) for p in PROMPTS]


def test_q8_0_deepseek_v3_experts_in_blocks_and_greedy_matches_transformers_on_dequantized_weights(
        ggufs, tmp_path, gguf_cache_dir):
    hf_dir, _, _, q8 = ggufs["deepseek_v3"]
    if q8 is None:
        pytest.skip("llama-quantize is not built here")
    kinds = {t.name: t.qtype for t in read_gguf_metadata(q8).tensors}
    assert kinds["blk.1.attn_v_b.weight"] == GGMLQuantizationType.Q8_0  # dequantized into kv_b_proj
    _tokenizer_from_hf_dir(q8, hf_dir)
    reader = read_gguf_metadata(q8)
    state = _checkpoint_names(iter_gguf_weights(reader, gguf_to_hf_config(reader)))
    (tmp_path / "dequantized").mkdir()
    save_file(state, str(tmp_path / "dequantized" / "model.safetensors"))
    shutil.copy(hf_dir / "config.json", tmp_path / "dequantized" / "config.json")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "dequantized"), dtype=torch.float32).eval()

    blocks = load_model(str(q8), dtype="float32", quantization="gguf")
    moe = [layer.mlp for layer in blocks.model.model.layers if hasattr(layer.mlp, "experts")]
    assert moe
    for block in moe:
        for expert in block.experts:
            assert expert.gate_up_proj.weight is None and expert.down_proj.weight is None  # no dense copy
            assert expert.gate_up_proj.quant.describe() == "Q8_0"
    kv_b = blocks.model.model.layers[1].self_attn.kv_b_proj.weight
    assert kv_b.dtype == torch.float32
    torch.testing.assert_close(kv_b, state["model.layers.1.self_attn.kv_b_proj.weight"], rtol=0, atol=0)
    assert _llm_greedy(q8, quantization="none") == [_hf_greedy(hf, p) for p in PROMPTS]


# --- files of the older layout (attn_kv_b) and what is refused -------------------------------------------------------

def _rewrite(src: Path, dst: Path, *, old_layout: bool = False, set_keys: dict | None = None) -> None:
    """Copy a GGUF with gguf-py's writer; ``old_layout``: kv_b_proj as one ``attn_kv_b`` tensor and per-head
    ``key_length`` / ``value_length`` (no ``*_mla`` keys), as converters before the absorbed layout wrote it;
    ``set_keys``: metadata values to change (uint32)."""
    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(dst), arch)
    mla = {key: reader.fields[f"{arch}.attention.{key}_mla"].contents() for key in ("key_length", "value_length")}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if old_layout and name.endswith("_mla"):
            continue
        value = field.contents()
        if old_layout and name.endswith(("attention.key_length", "attention.value_length")):
            value = mla[name.rsplit(".", 1)[1]]
        if set_keys and name in set_keys:
            value = set_keys.pop(name)
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    for name, value in (set_keys or {}).items():
        writer.add_key_value(name, value, GGUFValueType.UINT32)
    halves = {}
    for t in reader.tensors:
        data = np.array(t.data)
        if old_layout and t.name.endswith(("attn_k_b.weight", "attn_v_b.weight")):
            halves[t.name.rsplit(".", 2)[-2]] = data
            if len(halves) == 2:
                k_b, v_b = halves.pop("attn_k_b"), halves.pop("attn_v_b")  # (H, r, nope), (H, v, r)
                kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, v_b.shape[2])
                writer.add_tensor(t.name.replace("attn_v_b", "attn_kv_b").replace("attn_k_b", "attn_kv_b"),
                                  np.ascontiguousarray(kv_b))
            continue
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_older_attn_kv_b_layout_loads_the_same_model(ggufs, tmp_path):
    """A file with ``attn_kv_b`` and per-head key/value lengths gives the same config and weights."""
    hf_dir, hf, f32, _ = ggufs["deepseek_v2"]
    old = tmp_path / "old.gguf"
    _rewrite(f32, old, old_layout=True)
    reader = read_gguf_metadata(old)
    assert "blk.1.attn_kv_b.weight" in {t.name for t in reader.tensors}
    assert "deepseek2.attention.key_length_mla" not in reader.fields
    config = gguf_to_hf_config(reader)
    _assert_config_reads_back(config, hf.config)
    ours = _checkpoint_names(iter_gguf_weights(reader, config))
    checkpoint = load_file(str(hf_dir / "model.safetensors"))
    assert set(ours) == set(checkpoint)
    for name, tensor in checkpoint.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=name)


def test_unknown_gating_and_softmax_with_a_correction_bias_are_refused_by_name(ggufs, tmp_path):
    _, _, v3, _ = ggufs["deepseek_v3"]
    for gating, key in ((3, "expert_gating_func 3"), (1, "exp_probs_b")):
        path = tmp_path / f"gating{gating}.gguf"
        _rewrite(v3, path, set_keys={"deepseek2.expert_gating_func": gating})
        with pytest.raises(UnsupportedModelError, match=key):
            gguf_to_hf_config(read_gguf_metadata(path))
