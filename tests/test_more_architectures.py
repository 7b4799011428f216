"""Phi-3, Gemma 2 and Gemma 3 (text): tokenmill against transformers on tiny random models, from safetensors and GGUF.

Proves, per architecture: prefill plus paged decode reproduces transformers' float32 logits (with the features
that make the architecture: Gemma's scaled embedding, (1 + weight) norms, sandwich norms, GELU-tanh MLP,
query_pre_attn_scalar, attention and final logit soft-capping, q/k norms and a local RoPE base for sliding
layers; Phi-3's fused qkv / gate_up checkpoint tensors); ``LLM.generate`` greedy tokens equal transformers'
``generate`` from the HF directory, from a GGUF written here with llama.cpp's names and conventions (Gemma norms
stored as 1 + weight, Phi-3's fused ``attn_qkv`` / ``ffn_up``) and, where scripts/build_llama_server.sh has built
it, from the GGUF llama.cpp's own convert_hf_to_gguf.py writes; the prefix cache changes nothing; sliding windows
far shorter than the sequence (Gemma's local layers, Mistral's and Phi-3's every layer, Qwen2's upper layers) give
transformers' logits and greedy tokens on the torch paths, the compiled kernels and deterministic mode, from HF
checkpoints and GGUF, with the prefix cache on and off and chunked prefill across the window's edge; and what
tokenmill does not run is refused by name.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma2Config, Gemma3TextConfig, Phi3Config

from tests.gguf_writing import gguf_writer_for
from tests.test_models import (_TOKENIZER_WRITERS, BLOCK_IDS, TOKEN_IDS, hf_logits, new_kv_caches, run_step)
from tests.test_gguf_cache import fresh_gguf_cache
from tests.tiny_models import smollm2_gguf_path, smollm2_tokenizer
from tokenmill import SamplingParams
from tokenmill.models import UnsupportedModelError, load_model
from tokenmill.models.gguf_loader import (gguf_to_hf_config, iter_mapped_weights, kept_quantized_names,
                                          read_gguf_metadata, read_tensor_index)

_COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1,
               eos_token_id=2, pad_token_id=2)
_GEMMA3_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}


def tiny_config(arch: str, gguf_compatible: bool = False, **overrides):
    """The transformers config of a tiny model. ``gguf_compatible``: only what a GGUF can say (llama.cpp has no
    query_pre_attn_scalar key, so it is head_dim; Gemma 3's window pattern is llama.cpp's default 6); otherwise
    every feature is set off its default, so a model that ignored it would not match. ``overrides``: config
    fields to change."""
    config = _tiny_config(arch, gguf_compatible)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _tiny_config(arch: str, gguf_compatible: bool):
    if arch == "phi3":
        return Phi3Config(architectures=["Phi3ForCausalLM"], num_hidden_layers=3, original_max_position_embeddings=512,
                          **_COMMON)
    if arch == "gemma2":
        return Gemma2Config(architectures=["Gemma2ForCausalLM"], num_hidden_layers=4, head_dim=16,
                            query_pre_attn_scalar=16 if gguf_compatible else 24, sliding_window=512,
                            attn_logit_softcapping=2.0, final_logit_softcapping=2.0, **_COMMON)
    if arch == "gemma3":
        if gguf_compatible:
            return Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], num_hidden_layers=6, head_dim=32,
                                    query_pre_attn_scalar=32, sliding_window=512, rope_parameters=_GEMMA3_ROPE,
                                    **_COMMON)
        rope = {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}}
        return Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], num_hidden_layers=4, head_dim=32,
                                query_pre_attn_scalar=24, sliding_window=512, sliding_window_pattern=2,
                                final_logit_softcapping=2.0, rope_parameters=rope, **_COMMON)
    raise ValueError(arch)


def make_model(arch: str, out_dir, gguf_compatible: bool = False, **overrides):
    """Build, seed and save a tiny model; returns the eval-mode transformers model.

    Gemma: norms drawn around 0, not left at their zero init, so a (1 + weight) mistake shows; a small tied
    embedding (std 0.05), else the sqrt(hidden)-scaled input embedding dominates the last hidden state and greedy
    decoding just repeats the last token, which would prove little."""
    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(tiny_config(arch, gguf_compatible, **overrides), dtype=torch.float32).eval()
    if arch.startswith("gemma"):
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
            hf.model.embed_tokens.weight.normal_(0.0, 0.05)
    hf.save_pretrained(out_dir)
    smollm2_tokenizer().save_pretrained(out_dir)
    return hf


# --- a GGUF written the way llama.cpp's convert_hf_to_gguf.py writes these architectures ----------------------

# gguf-py's names: ATTN_POST_NORM "post_attention_norm", FFN_PRE_NORM "ffn_norm", FFN_POST_NORM "post_ffw_norm"
_GEMMA_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
                "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
          "qkv_proj": "attn_qkv", "gate_proj": "ffn_gate", "up_proj": "ffn_up", "gate_up_proj": "ffn_up",
          "down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_gguf(hf, arch: str, out_path, tokenizer_fields: dict, matrix_type=None) -> None:
    """The metadata keys and tensor names llama.cpp's converter writes for phi3 (fused attn_qkv, ffn_up = gate | up,
    rope.scaling.original_context_length, sliding_window 0 = none), gemma2 (softcapping keys, sliding_window, no
    rope.freq_base, no output tensor) and gemma3 (rope.freq_base of the global layers, freq_base_swa of the local
    ones, final softcapping when set, tied output), none with a vocab_size key; Gemma norms stored as 1 + weight.
    Matrices F32, or ``matrix_type`` (e.g. Q8_0) for the 2-D weights other than the embedding.
    (``test_llama_cpp_converter_output_matches_transformers`` runs the converter itself where it is built.)"""
    import gguf

    config = hf.config
    writer = gguf_writer_for(config, arch, out_path)
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_sliding_window(config.sliding_window or 0)
    else:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_sliding_window(config.sliding_window)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        else:
            writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
            writer.add_key_value(gguf.Keys.Rope.FREQ_BASE_SWA.format(arch=arch),
                                 config.rope_parameters["sliding_attention"]["rope_theta"], gguf.GGUFValueType.FLOAT32)
            if config.final_logit_softcapping:
                writer.add_final_logit_softcapping(config.final_logit_softcapping)
    for key, value in tokenizer_fields.items():
        getattr(writer, _TOKENIZER_WRITERS[key])(value)
    for name, tensor in hf.state_dict().items():
        w = tensor.float().numpy()
        parts = name.split(".")
        if name == "lm_head.weight":
            if config.tie_word_embeddings:
                continue  # llama.cpp writes no output tensor for tied embeddings (and skips Gemma 2's always)
            gguf_name = "output.weight"
        elif name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            names = {**_NAMES, **_GEMMA_NAMES} if arch.startswith("gemma") else _NAMES
            gguf_name = f"blk.{parts[2]}.{names[parts[-2]]}.{parts[-1]}"
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1  # Gemma2Model / Gemma3Model.modify_tensors
        w = np.ascontiguousarray(w)
        if matrix_type is not None and w.ndim == 2 and gguf_name != "token_embd.weight":
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, matrix_type), raw_dtype=matrix_type)
        else:
            writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tokenizer_fields():
    """The embedded GGUF's ``tokenizer.*`` metadata (the tiny models use the SmolLM2 tokenizer)."""
    return {k: v for k, v in read_gguf_metadata(smollm2_gguf_path()).fields.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def gguf_cache_dir(tmp_path_factory):
    """A GGUF cache of this module's own (tokenizers put there from the HF directories: transformers' rebuild
    from GGUF metadata takes seconds per load)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield fresh_gguf_cache(tmp_path_factory.mktemp("gguf_cache"), monkeypatch)


ARCHS = ("phi3", "gemma2", "gemma3")


@pytest.fixture(scope="module", params=ARCHS)
def hf_tiny(request, tmp_path_factory):
    """(arch, HF directory, transformers model) with every feature off its default."""
    path = tmp_path_factory.mktemp(f"{request.param}_hf")
    return request.param, path, make_model(request.param, path)


@pytest.fixture(scope="module", params=ARCHS)
def gguf_tiny(request, tmp_path_factory, tokenizer_fields, gguf_cache_dir):
    """(arch, GGUF path, transformers model) for a GGUF-expressible tiny model."""
    from tokenmill.models import gguf_cache

    arch = request.param
    root = tmp_path_factory.mktemp(f"{arch}_gguf")
    hf = make_model(arch, root / "hf", gguf_compatible=True)
    path = root / f"{arch}.gguf"
    write_gguf(hf, arch, path, tokenizer_fields)
    gguf_cache.cached_tokenizer(path, lambda: AutoTokenizer.from_pretrained(str(root / "hf")))
    return arch, path, hf


def random_prompts(lengths: tuple[int, ...] = (9, 61), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]


def assert_greedy_equal(model_path: str, hf, prompts: list[list[int]], max_tokens: int = 10, **llm_kwargs) -> None:
    """tokenmill's LLM.generate greedy tokens == transformers' greedy ``generate`` (EOS ignored) per prompt."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=model_path, dtype="float32", kv_cache_memory=0.05, max_model_len=256, **llm_kwargs)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        llm.close()
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert output.outputs[0].token_ids == ref[0, len(prompt):].tolist(), len(prompt)
    # the models say something: not one token repeated (which a broken model could match by luck)
    assert max(len(set(output.outputs[0].token_ids)) for output in outputs) >= 3


# --- safetensors checkpoints ---------------------------------------------------------------------------------------


def test_prefill_then_paged_decode_matches_transformers_logits(hf_tiny):
    arch, path, hf = hf_tiny
    loaded = load_model(str(path), dtype="float32")
    assert type(loaded.model).__name__ == hf.config.architectures[0]
    kv_caches = new_kv_caches(loaded)
    seq = TOKEN_IDS[:11]
    logits = [run_step(loaded, kv_caches, [seq], [0], [BLOCK_IDS[:3]])]
    for _ in range(6):  # decode steps cross two block boundaries
        seq = seq + [int(logits[-1][-1].argmax())]
        logits.append(run_step(loaded, kv_caches, [[seq[-1]]], [len(seq) - 1], [BLOCK_IDS[:(len(seq) + 3) // 4]]))
    ours, ref = torch.cat(logits), hf_logits(hf, seq)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    if arch != "phi3":  # the final soft-cap bounds the logits (and is not a no-op here)
        capped, uncapped = float(ours.abs().max()), float(hf_logits_uncapped(hf, seq).abs().max())
        assert capped < hf.config.final_logit_softcapping and uncapped > capped + 0.2


@torch.inference_mode()
def hf_logits_uncapped(hf, token_ids: list[int]) -> torch.Tensor:
    cap = hf.config.final_logit_softcapping
    hf.config.final_logit_softcapping = None
    try:
        return hf_logits(hf, token_ids)
    finally:
        hf.config.final_logit_softcapping = cap


def test_gemma2_attention_softcap_is_applied(tmp_path):
    """The same weights without attn_logit_softcapping give other logits: the cap (2.0 here) does work, and
    tokenmill follows transformers both with and without it."""
    hf = make_model("gemma2", tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32")
    capped = run_step(loaded, new_kv_caches(loaded), [TOKEN_IDS], [0], [BLOCK_IDS[:5]])
    for layer in loaded.model.model.layers:
        layer.self_attn.attn.logit_softcap = None
    for layer in hf.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    uncapped = run_step(loaded, new_kv_caches(loaded), [TOKEN_IDS], [0], [BLOCK_IDS[:5]])
    torch.testing.assert_close(uncapped, hf_logits(hf, TOKEN_IDS), atol=1e-4, rtol=0)
    assert (capped - uncapped).abs().max() > 0.05


def test_greedy_generate_matches_transformers(hf_tiny):
    _, path, hf = hf_tiny
    assert_greedy_equal(str(path), hf, random_prompts())


def test_prefix_cache_on_and_off_give_the_same_tokens(tmp_path):
    """Gemma 2 (soft-capped attention on the torch path): prompts sharing a 40-token prefix, the later ones
    prefilled after a prefix-cache hit (a chunk with a cached prefix), give transformers' tokens either way."""
    hf = make_model("gemma2", tmp_path)
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 49152, (40,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (3, 9)]
    from tokenmill import LLM, SamplingParams

    results = []
    for enable in (True, False):
        llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=0.05, max_model_len=256, block_size=16,
                  enable_prefix_caching=enable)
        try:
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            first = llm.generate([{"prompt_token_ids": prompts[0]}], params)  # fills the cache
            rest = llm.generate([{"prompt_token_ids": prompts[1]}], params)  # hits it when enabled
            if enable:
                assert rest[0].num_cached_tokens >= 32
            results.append([first[0].outputs[0].token_ids, rest[0].outputs[0].token_ids])
        finally:
            llm.close()
    assert results[0] == results[1]
    for prompt, tokens in zip(prompts, results[0]):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist()


# --- GGUF ----------------------------------------------------------------------------------------------------------


def test_gguf_config_and_weights_match_the_checkpoint(gguf_tiny):
    arch, path, hf = gguf_tiny
    config = gguf_to_hf_config(read_gguf_metadata(path))
    assert config.architectures == hf.config.architectures
    for field in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "tie_word_embeddings", "sliding_window"):
        assert getattr(config, field) == getattr(hf.config, field), field
    if arch == "phi3":
        assert config.sliding_window is None and config.original_max_position_embeddings == 512
    else:
        for field in ("layer_types", "query_pre_attn_scalar", "head_dim", "final_logit_softcapping",
                      "attn_logit_softcapping", "rope_parameters"):
            assert getattr(config, field) == getattr(hf.config, field), field
    expected = {k: v for k, v in hf.state_dict().items() if not (k == "lm_head.weight" and config.tie_word_embeddings)}
    weights = dict(iter_mapped_weights(path, read_tensor_index(read_gguf_metadata(path)), config))
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():  # Gemma norms: (1 + w) - 1 gives w back exactly for |w| <= 0.5
        tol = 0 if "norm" not in name or tensor.abs().max() <= 0.5 else 1e-7
        torch.testing.assert_close(weights[name], tensor, atol=tol, rtol=0, msg=name)


def test_gguf_greedy_generate_matches_transformers(gguf_tiny):
    _, path, hf = gguf_tiny
    assert_greedy_equal(str(path), hf, random_prompts(), quantization="none")


def test_phi3_gguf_keeps_fused_quantized_tensors_in_their_blocks(tmp_path, tokenizer_fields, gguf_cache_dir):
    """Q8_0 attn_qkv and ffn_up (phi3's fused gate | up, with no ffn_gate beside it) are run as stored, and the
    model follows the same file dequantized."""
    import gguf

    from tokenmill.models import gguf_cache

    hf = make_model("phi3", tmp_path / "hf", gguf_compatible=True)
    path = tmp_path / "phi3-q8.gguf"
    write_gguf(hf, "phi3", path, tokenizer_fields, matrix_type=gguf.GGMLQuantizationType.Q8_0)
    gguf_cache.cached_tokenizer(path, lambda: AutoTokenizer.from_pretrained(str(tmp_path / "hf")))
    kept = kept_quantized_names(read_tensor_index(read_gguf_metadata(path)))
    assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"} <= kept
    quantized = load_model(str(path), dtype="float32", quantization="gguf")
    layer = quantized.model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant is not None and layer.mlp.gate_up_proj.quant is not None
    dense = load_model(str(path), dtype="float32", quantization="none")
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):  # every row in its place: ~0.5% error (8-bit activations)
        y_q, y_dense = layer.get_submodule(name)(x), dense.model.model.layers[0].get_submodule(name)(x)
        assert (y_q - y_dense).abs().max() < 0.02 * y_dense.abs().max(), name
    ours = run_step(quantized, new_kv_caches(quantized), [TOKEN_IDS], [0], [BLOCK_IDS[:5]])
    ref = run_step(dense, new_kv_caches(dense), [TOKEN_IDS], [0], [BLOCK_IDS[:5]])
    assert (ours - ref).abs().mean() < 0.1 * ref.abs().mean()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def _llama_cpp_converter() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py from ``$LLAMA_CPP_TOOLS`` or scripts/build_llama_server.sh's cached build
    (looked up at import, before a fixture points TOKENMILL_CACHE_DIR elsewhere), or None."""
    from tokenmill.bench.llama_server import default_binary_path

    tools = os.environ.get("LLAMA_CPP_TOOLS")
    prefix = Path(tools).expanduser() if tools else default_binary_path().parent.parent
    convert = prefix / "convert" / "convert_hf_to_gguf.py"
    return convert if convert.is_file() else None


_CONVERT = _llama_cpp_converter()
# Runs the converter with its own gguf-py. The tiny models carry SmolLM2's BPE tokenizer: Gemma 2's converter only
# reads a sentencepiece tokenizer.model, so it is given the BPE path Gemma 3's converter already falls back to.
_CONVERT_DRIVER = """
import runpy, sys
from pathlib import Path
convert = sys.argv[1]
sys.path[:0] = [str(Path(convert).parent / "gguf-py"), str(Path(convert).parent)]
import conversion.gemma
conversion.gemma.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = [convert, *sys.argv[2:]]
runpy.run_path(convert, run_name="__main__")
"""


@pytest.mark.skipif(_CONVERT is None, reason="llama.cpp's converter is not built here (scripts/build_llama_server.sh)")
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_converter_output_matches_transformers(arch, tmp_path, gguf_cache_dir):
    """The GGUF llama.cpp's own convert_hf_to_gguf.py makes (F32) loads and greedy-decodes as transformers does."""
    from tokenmill.models import gguf_cache

    hf_dir = tmp_path / "hf"
    hf = make_model(arch, hf_dir, gguf_compatible=True)
    if arch == "phi3":  # the converter's BPE path for Phi-3 (Phi-4 style) is chosen by this class name
        config = json.loads((hf_dir / "tokenizer_config.json").read_text())
        (hf_dir / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    out = tmp_path / f"{arch}.gguf"
    done = subprocess.run([sys.executable, "-c", _CONVERT_DRIVER, str(_CONVERT), str(hf_dir), "--outtype", "f32",
                           "--outfile", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    gguf_cache.cached_tokenizer(out, lambda: AutoTokenizer.from_pretrained(str(hf_dir)))
    assert_greedy_equal(str(out), hf, random_prompts(), quantization="none")


# --- sliding windows shorter than the sequence ----------------------------------------------------------------------

WINDOW = 8  # far below the prompts and generations here: the windows decide the outputs


def set_attention_paths(model, kernels: bool) -> int:
    """Every Attention layer of ``model`` on the compiled CPU decode and prefill kernels (True) or on the torch
    reference (False: reference decode, SDPA / eager prefill). Returns how many layers."""
    from tokenmill.attention import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer in layers:
        layer.cpu_decode_kernel = layer.cpu_prefill_kernel = kernels
    return len(layers)


def generate_greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def hf_greedy(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate`` per prompt (its sliding-window cache and masks), EOS ignored."""
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
            out.append(ref[0, len(prompt):].tolist())
    assert max(len(set(tokens)) for tokens in out) >= 3  # not one token repeated, which a broken model could match
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_sliding_window_logits_match_transformers_past_the_window(arch, tmp_path):
    """Window 5 (not a multiple of the block size 4) over 17 tokens: a prefill of 11, then 6 decode steps, on the
    torch paths and on the compiled kernels, give transformers' float32 logits of the whole sequence (its masks:
    keys p - 5 < j <= p on the sliding layers; Phi-3: every layer); the windows sit on transformers' layers, and
    the same model with them taken away gives other logits."""
    hf = make_model(arch, tmp_path, sliding_window=5)
    loaded = load_model(str(tmp_path), dtype="float32")
    layer_types = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * hf.config.num_hidden_layers
    windows = [layer.self_attn.attn.sliding_window for layer in loaded.model.model.layers]
    assert windows == [5 if t == "sliding_attention" else None for t in layer_types] and 5 in windows
    ref = hf_logits(hf, TOKEN_IDS)
    for kernels in (False, True):
        set_attention_paths(loaded.model, kernels)
        kv_caches = new_kv_caches(loaded)
        logits = [run_step(loaded, kv_caches, [TOKEN_IDS[:11]], [0], [BLOCK_IDS[:3]])]
        for n in range(11, len(TOKEN_IDS)):  # decode steps cross two block boundaries
            logits.append(run_step(loaded, kv_caches, [[TOKEN_IDS[n]]], [n], [BLOCK_IDS[:(n + 4) // 4]]))
        torch.testing.assert_close(torch.cat(logits), ref, atol=1e-4, rtol=0, msg=f"kernels={kernels}")
    for layer in loaded.model.model.layers:
        layer.self_attn.attn.sliding_window = None
    full = run_step(loaded, new_kv_caches(loaded), [TOKEN_IDS], [0], [BLOCK_IDS[:5]])
    assert (full - ref).abs().max() > 0.05


@pytest.mark.parametrize("arch", ("gemma2", "gemma3"))
def test_sliding_window_generation_matches_transformers_on_every_path(arch, tmp_path):
    """Window 8, prompts of 13 to 57 tokens and 24 new tokens each: greedy tokens equal transformers' for a batch
    of prompts, on the torch paths and on the compiled kernels, with the prefix cache on (a prompt prefilled after
    a 40-token cached prefix) and off, and with chunked prefill (32-token steps cut prompts across the window's
    edge)."""
    from tokenmill import LLM

    hf = make_model(arch, tmp_path, sliding_window=WINDOW)
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 49152, (40,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 17)]
    prompts += [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (40, 13)]
    refs = hf_greedy(hf, prompts, 24)
    for kernels, caching in ((False, True), (True, True), (False, False), (True, False)):
        llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=0.05, max_model_len=256, block_size=16,
                  max_num_batched_tokens=32, enable_prefix_caching=caching, cpu_kernels=False)
        try:
            assert set_attention_paths(llm.engine.runner.model, kernels) == hf.config.num_hidden_layers
            first = generate_greedy(llm, prompts[:1], 24)  # fills the prefix cache
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
            assert (rest[0].num_cached_tokens >= 32) == caching
            got = first + [o.outputs[0].token_ids for o in rest]
        finally:
            llm.close()
        assert got == refs, f"kernels={kernels} prefix caching={caching}"


@pytest.mark.parametrize("arch", ("gemma2", "gemma3"))
def test_sliding_window_gguf_greedy_matches_transformers(arch, tmp_path, tokenizer_fields, gguf_cache_dir):
    """A GGUF with attention.sliding_window 8 (gemma2: every other layer; gemma3: llama.cpp's pattern of 6) reads
    back the window and the sliding layers, and generates transformers' greedy tokens past the window."""
    from tokenmill.models import gguf_cache

    hf = make_model(arch, tmp_path / "hf", gguf_compatible=True, sliding_window=WINDOW)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(hf, arch, path, tokenizer_fields)
    gguf_cache.cached_tokenizer(path, lambda: AutoTokenizer.from_pretrained(str(tmp_path / "hf")))
    config = gguf_to_hf_config(read_gguf_metadata(path))
    assert config.sliding_window == WINDOW and config.layer_types == hf.config.layer_types
    assert_greedy_equal(str(path), hf, random_prompts((40, 23, 57)), max_tokens=24, quantization="none")


@pytest.mark.parametrize("arch, overrides", [
    ("mistral", {"sliding_window": WINDOW}),  # every layer
    ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),  # layers 1 and 2
])
def test_llama_family_sliding_windows_match_transformers(arch, overrides, tmp_path):
    """Mistral's window on every layer and Qwen2's on the layers from max_window_layers on: a batch of prompts
    longer than the window gives transformers' greedy tokens on the torch paths and on the compiled kernels."""
    from tests.tiny_models import make_tiny_model
    from tokenmill import LLM

    path = make_tiny_model(arch, tmp_path, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = random_prompts((40, 23, 9), seed=2)
    refs = hf_greedy(hf, prompts, 24)
    for kernels in (False, True):
        llm = LLM(model=str(path), dtype="float32", kv_cache_memory=0.05, max_model_len=256, max_num_batched_tokens=32,
                  cpu_kernels=False)
        try:
            set_attention_paths(llm.engine.runner.model, kernels)
            assert generate_greedy(llm, prompts, 24) == refs, f"kernels={kernels}"
        finally:
            llm.close()


def test_deterministic_mode_runs_sliding_windows_and_soft_capping(tmp_path):
    """Gemma 2 (window 8 on every other layer, attention soft-capping) in deterministic mode, where every token
    attends through the compiled decode kernel: transformers' greedy tokens past the window."""
    hf = make_model("gemma2", tmp_path, sliding_window=WINDOW)
    assert_greedy_equal(str(tmp_path), hf, random_prompts((40, 23)), max_tokens=24, deterministic=True,
                        max_num_batched_tokens=32)


# --- what tokenmill refuses --------------------------------------------------------------------------------------


def test_unsupported_variants_are_refused_by_name(tmp_path, tokenizer_fields):
    from tokenmill.models import get_model_class

    config = Phi3Config(architectures=["Phi3ForCausalLM"], num_hidden_layers=1, **_COMMON,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    with pytest.raises(NotImplementedError, match="partial_rotary_factor"):
        get_model_class(config)(config)
    # a phi3 GGUF with only one of its two longrope factor tensors
    import gguf

    path = tmp_path / "longrope.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    for key, value in (("block_count", 1), ("context_length", 512), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("head_count", 4), ("layer_norm_rms_eps", 1e-6)):
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="rope_factors_long.*without its longrope partner"):
        gguf_to_hf_config(read_gguf_metadata(path))
