"""Mixture-of-experts GGUF files made by llama.cpp's own tools: convert_hf_to_gguf.py (F32) and llama-quantize
(Q8_0) on the tiny Mixtral (arch llama + expert_count), Qwen2-MoE, Qwen3-MoE and OLMoE models.

Proves: the config read from the metadata (expert_count, expert_used_count, expert_feed_forward_length, shared
expert length, llama.cpp's renormalization rule) and the stacked 3-D expert tensors split per expert give
transformers' greedy tokens (F32, with prefix caching and chunked prefill); a Q8_0 file keeps every expert in
Q8_0 blocks (no dense copy) and, dequantized, gives the greedy tokens of transformers run on the same dequantized
weights, while running the blocks as stored stays close to that. Skipped where scripts/build_llama_server.sh has
not built llama.cpp (the converter and llama-quantize come from that build).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.moe_models import MOE_ARCHS, make_moe_model
from tests.test_gguf_cache import fresh_gguf_cache
from tests.test_models import BLOCK_IDS, TOKEN_IDS, hf_logits, new_kv_caches, run_step
from tests.test_more_architectures import _CONVERT
from tokenmill import LLM, SamplingParams
from tokenmill.models import load_model
from tokenmill.models.gguf_loader import gguf_to_hf_config, iter_gguf_weights, read_gguf_metadata

pytestmark = pytest.mark.skipif(_CONVERT is None, reason="llama.cpp's converter is not built here "
                                "(scripts/build_llama_server.sh)")

# one interpreter converts every model (the converter's imports cost more than the tiny conversions)
_DRIVER = """
import runpy, sys
from pathlib import Path
convert = sys.argv[1]
sys.path[:0] = [str(Path(convert).parent / "gguf-py"), str(Path(convert).parent)]
for pair in sys.argv[2:]:
    hf_dir, outfile = pair.split("=", 1)
    sys.argv = [convert, hf_dir, "--outtype", "f32", "--outfile", outfile]
    runpy.run_path(convert, run_name="__main__")
"""
_MIXTRAL_NAMES = ((".mlp.", ".block_sparse_moe."), (".gate_proj.", ".w1."), (".up_proj.", ".w3."),
                  (".down_proj.", ".w2."))


@pytest.fixture(scope="module")
def gguf_cache_dir(tmp_path_factory):
    """A GGUF cache of this module's own (the tokenizers are put there from the HF directories)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield fresh_gguf_cache(tmp_path_factory.mktemp("gguf_cache"), monkeypatch)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """arch -> (HF dir, transformers model, F32 GGUF, Q8_0 GGUF or None where llama-quantize is missing)."""
    root = tmp_path_factory.mktemp("moe_gguf")
    models = {arch: make_moe_model(arch, root / arch, gguf_compatible=True) for arch in MOE_ARCHS}
    pairs = [f"{root / arch}={root / f'{arch}.f32.gguf'}" for arch in MOE_ARCHS]
    done = subprocess.run([sys.executable, "-c", _DRIVER, str(_CONVERT), *pairs], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    quantize = _CONVERT.parent.parent / "bin" / "llama-quantize"
    out = {}
    for arch in MOE_ARCHS:
        f32, q8 = root / f"{arch}.f32.gguf", root / f"{arch}.q8_0.gguf"
        if quantize.is_file():
            run = subprocess.run([str(quantize), str(f32), str(q8), "Q8_0"], capture_output=True, text=True,
                                 timeout=120)
            assert run.returncode == 0, run.stderr[-2000:]
        out[arch] = (root / arch, models[arch], f32, q8 if q8.is_file() else None)
    return out


def _hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [[(29 * i + 13 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate((11, 37))]


def _tokenizer_from_hf_dir(gguf: Path, hf_dir: Path) -> None:
    """The GGUF cache's tokenizer entry from the HF directory (transformers' GGUF tokenizer rebuild takes seconds)."""
    from tokenmill.models import gguf_cache

    gguf_cache.cached_tokenizer(gguf, lambda: AutoTokenizer.from_pretrained(str(hf_dir)))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_llama_cpp_f32_gguf_greedy_matches_transformers(ggufs, arch, gguf_cache_dir):
    hf_dir, hf, f32, _ = ggufs[arch]
    config = gguf_to_hf_config(read_gguf_metadata(f32))
    assert config.architectures == hf.config.architectures
    assert config.num_experts_per_tok == hf.config.num_experts_per_tok
    _tokenizer_from_hf_dir(f32, hf_dir)
    llm = LLM(model=str(f32), dtype="float32", max_num_batched_tokens=16, block_size=4, num_kv_blocks=128,
              enable_prefix_caching=True)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 6) for p in PROMPTS]
    finally:
        llm.close()


def _dequantized_transformers(gguf: Path, hf_dir: Path, arch: str, out: Path):
    """transformers' model of ``arch`` holding the GGUF's weights dequantized (saved under the checkpoint's names)."""
    reader = read_gguf_metadata(gguf)
    state = {}
    for name, tensor in iter_gguf_weights(reader, gguf_to_hf_config(reader)):
        if arch == "mixtral":
            for ours, theirs in _MIXTRAL_NAMES:
                name = name.replace(ours, theirs)
        state[name] = tensor.contiguous().clone()
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    shutil.copy(hf_dir / "config.json", out / "config.json")
    return AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_q8_0_experts_stay_quantized_and_match_transformers_on_dequantized_weights(ggufs, arch, tmp_path,
                                                                                   gguf_cache_dir):
    hf_dir, _, _, q8 = ggufs[arch]
    if q8 is None:
        pytest.skip("llama-quantize is not built here")
    _tokenizer_from_hf_dir(q8, hf_dir)
    hf = _dequantized_transformers(q8, hf_dir, arch, tmp_path / "dequantized")
    blocks = load_model(str(q8), dtype="float32", quantization="gguf")
    moe_layers = [layer.mlp for layer in blocks.model.model.layers if hasattr(layer.mlp, "experts")]
    assert moe_layers
    for block in moe_layers:
        for expert in block.experts:
            assert expert.gate_up_proj.weight is None and expert.down_proj.weight is None  # no dense copy
            assert expert.gate_up_proj.quant.describe() == expert.down_proj.quant.describe() == "Q8_0"
    dense = load_model(str(q8), dtype="float32", quantization="none")
    ref = hf_logits(hf, TOKEN_IDS)
    ours_dense = run_step(dense, new_kv_caches(dense), [TOKEN_IDS], [0], [BLOCK_IDS[:5]])
    torch.testing.assert_close(ours_dense, ref, rtol=1e-4, atol=1e-4)
    ours_blocks = run_step(blocks, new_kv_caches(blocks), [TOKEN_IDS], [0], [BLOCK_IDS[:5]])
    assert (ours_blocks - ref).abs().mean() < 0.05 * ref.abs().mean()  # int8 activations: close, not equal
    assert (ours_blocks.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8
