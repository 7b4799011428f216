"""Phi-3 longrope RoPE (Phi-3 128k, Phi-3.5) against transformers on a tiny random model.

tokenmill picks longrope's short or long factors once per engine by ``max_model_len`` (long when it exceeds
``original_max_position_embeddings``, as llama.cpp picks by its context size); transformers picks per forward by
the sequence's length. Proves: with short factors (max_model_len <= the original max) prefill + paged decode and
greedy generation equal transformers for sequences that stay under the original max; with long factors, for
prompts past it (transformers then uses the long factors for every step too); the two sets give different logits
(the factors do work); the attention scaling sqrt(1 + ln(factor) / ln(original max)) is applied; and the GGUF
llama.cpp's own convert_hf_to_gguf.py writes (``rope_factors_long`` / ``rope_factors_short`` tensors,
``phi3.rope.scaling.attn_factor``) reads back into the same config and decodes as transformers does.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, Phi3Config

from tests.test_models import BLOCK_IDS, hf_logits, new_kv_caches, run_step
from tests.test_more_architectures import _CONVERT, _CONVERT_DRIVER, _COMMON, hf_greedy, random_prompts
from tests.tiny_models import smollm2_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.layers.rotary_embedding import RotaryEmbedding, set_rope_max_model_len
from tokenmill.models import load_model
from tokenmill.models.gguf_loader import gguf_to_hf_config, read_gguf_metadata

ORIGINAL_MAX = 32
MAX_POSITIONS = 128
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5]  # head_dim 16: 8 frequencies
LONG = [1.0, 1.5, 3.0, 6.0, 12.0, 20.0, 32.0, 48.0]


def longrope_config() -> Phi3Config:
    return Phi3Config(architectures=["Phi3ForCausalLM"], num_hidden_layers=3,
                      **{**_COMMON, "max_position_embeddings": MAX_POSITIONS},
                      original_max_position_embeddings=ORIGINAL_MAX,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT,
                                       "long_factor": LONG, "original_max_position_embeddings": ORIGINAL_MAX})


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory):
    """(HF directory, transformers model) of a tiny Phi-3 with longrope RoPE."""
    path = tmp_path_factory.mktemp("phi3_longrope")
    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(longrope_config(), dtype=torch.float32).eval()
    hf.save_pretrained(path)
    smollm2_tokenizer().save_pretrained(path)
    return path, hf


def generate(path, prompts: list[list[int]], max_model_len: int, max_tokens: int = 10, **kwargs) -> list[list[int]]:
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=0.05, max_model_len=max_model_len, **kwargs)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        llm.close()
    return [o.outputs[0].token_ids for o in outputs]


def test_attention_scaling_and_factor_choice():
    rope = RotaryEmbedding(longrope_config(), 16)
    expected = math.sqrt(1 + math.log(MAX_POSITIONS / ORIGINAL_MAX) / math.log(ORIGINAL_MAX))
    assert rope.long_factors and rope.attention_scaling == pytest.approx(expected)
    assert float(rope.cos_sin_cache[0, :8].max()) == pytest.approx(expected)  # cos(0) * scaling
    storage = rope.cos_sin_cache.data_ptr()
    long_row = rope.cos_sin_cache[20].clone()
    rope.set_max_model_len(ORIGINAL_MAX)  # a context within the original max: short factors
    assert not rope.long_factors and rope.cos_sin_cache.data_ptr() == storage
    assert not torch.allclose(rope.cos_sin_cache[20], long_row)
    rope.set_max_model_len(ORIGINAL_MAX + 1)
    assert rope.long_factors and torch.equal(rope.cos_sin_cache[20], long_row)


def test_prefill_then_paged_decode_logits_match_transformers_with_either_factor_set(phi3_longrope):
    path, hf = phi3_longrope
    loaded = load_model(str(path), dtype="float32")
    prompt_long = random_prompts((41,), seed=1)[0]  # past the original max: transformers uses the long factors
    prompt_short = prompt_long[:11]  # stays under it
    for max_model_len, prompt in ((MAX_POSITIONS, prompt_long), (ORIGINAL_MAX, prompt_short)):
        set_rope_max_model_len(loaded.model, max_model_len)
        kv_caches = new_kv_caches(loaded)
        n = len(prompt) - 5
        logits = [run_step(loaded, kv_caches, [prompt[:n]], [0], [BLOCK_IDS[:(n + 3) // 4]])]
        for i in range(n, len(prompt)):  # paged decode steps
            logits.append(run_step(loaded, kv_caches, [[prompt[i]]], [i], [BLOCK_IDS[:(i + 4) // 4]]))
        torch.testing.assert_close(torch.cat(logits), hf_logits(hf, prompt), atol=1e-4, rtol=0,
                                   msg=f"max_model_len {max_model_len}")
    # the other factor set on the short prompt: not transformers' logits (the choice matters)
    set_rope_max_model_len(loaded.model, MAX_POSITIONS)
    other = run_step(loaded, new_kv_caches(loaded), [prompt_short], [0], [BLOCK_IDS[:3]])
    assert (other - hf_logits(hf, prompt_short)).abs().max() > 0.05


def test_greedy_generate_matches_transformers_in_each_regime(phi3_longrope):
    """max_model_len 32 (short factors) with sequences up to 29 tokens; max_model_len 128 (long factors) with
    prompts of 40 and 57 tokens, prefix cache on."""
    path, hf = phi3_longrope
    short_prompts = random_prompts((9, 19), seed=2)
    assert generate(path, short_prompts, ORIGINAL_MAX) == hf_greedy(hf, short_prompts, 10)
    long_prompts = random_prompts((40, 57), seed=3)
    assert generate(path, long_prompts, MAX_POSITIONS, max_tokens=12) == hf_greedy(hf, long_prompts, 12)


@pytest.mark.skipif(_CONVERT is None, reason="llama.cpp's converter is not built here (scripts/build_llama_server.sh)")
def test_llama_cpp_converter_output_reads_back_and_matches_transformers(phi3_longrope, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py writes the factors as tensors and the attention factor as a key; the
    config read back is transformers' longrope config, and greedy decoding from the GGUF (long factors: the
    engine's max_model_len is the file's context length) equals transformers past the original max."""
    import shutil

    from tests.test_gguf_cache import fresh_gguf_cache

    path, hf = phi3_longrope
    hf_dir = tmp_path / "hf"
    shutil.copytree(path, hf_dir)
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())  # the converter's BPE path for Phi-3
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    out = tmp_path / "phi3-longrope.gguf"
    done = subprocess.run([sys.executable, "-c", _CONVERT_DRIVER, str(_CONVERT), str(hf_dir), "--outtype", "f32",
                           "--outfile", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    metadata = read_gguf_metadata(out)
    assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= {t.name for t in metadata.tensors}
    rope = gguf_to_hf_config(metadata).rope_parameters
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == ORIGINAL_MAX
    assert rope["long_factor"] == pytest.approx(LONG) and rope["short_factor"] == pytest.approx(SHORT)
    assert rope["attention_factor"] == pytest.approx(RotaryEmbedding(hf.config, 16).attention_scaling)
    with pytest.MonkeyPatch.context() as monkeypatch:
        fresh_gguf_cache(tmp_path / "cache", monkeypatch)
        prompts = random_prompts((40,), seed=4)
        assert generate(out, prompts, MAX_POSITIONS, quantization="none") == hf_greedy(hf, prompts, 10)
