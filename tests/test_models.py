"""Model-layer tests: tokenmill's models and loaders against transformers on the same weights.

Proves, per architecture, that prefill plus paged decode (block_size 4, scattered block ids) and a
mixed multi-request step reproduce transformers' float32 logits; that RoPE variants match; that
GGUF files (the real SmolLM2 and GGUFs written from tiny models) load to the same weights; and that
the loader rejects what it must (hub names, bad dtypes, unknown architectures); each architecture puts
its sliding window on the layers transformers does.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.gguf_writing import gguf_writer_for
from tests.tiny_models import TINY_ARCHS, make_tiny_model, smollm2_gguf_path, tiny_config
from tokenmill.attention import build_attention_metadata
from tokenmill.csrc_build import cpu_has_native_bf16
from tokenmill.light_tokenizer import LightTokenizer
from tokenmill.models import get_model_class, load_model
from tokenmill.models.gguf_loader import (gguf_to_hf_config, iter_gguf_weights, iter_mapped_weights, open_gguf,
                                          read_gguf_metadata, read_tensor_index)

BLOCK_SIZE = 4
NUM_BLOCKS = 32
# Deliberately scattered block ids: a request's blocks are never contiguous in the pool.
BLOCK_IDS = [9, 3, 17, 5, 22, 1, 30, 12, 7, 14, 2, 25, 19, 0]
TOKEN_IDS = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 9156, 2462, 253, 655, 28, 253, 1120]


def new_kv_caches(loaded, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, loaded.num_kv_heads, loaded.head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(loaded.num_layers)]


@torch.inference_mode()
def run_step(loaded, kv_caches, token_ids: list[list[int]], num_computed: list[int], block_tables: list[list[int]]):
    """One engine-style step over several requests; returns logits [T, vocab] for every scheduled token."""
    query_lens = np.array([len(t) for t in token_ids])
    width = max(len(b) for b in block_tables)
    table = np.array([b + [0] * (width - len(b)) for b in block_tables])
    metadata, positions = build_attention_metadata(query_lens, np.array(num_computed), table, BLOCK_SIZE)
    input_ids = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64)
    hidden = loaded.model(input_ids, torch.from_numpy(positions), kv_caches, metadata)
    assert hidden.shape == (len(input_ids), loaded.hf_config.hidden_size)
    return loaded.model.compute_logits(hidden)


@torch.inference_mode()
def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module", params=list(TINY_ARCHS))
def tiny(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    loaded = load_model(str(path), dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return request.param, loaded, hf


def test_prefill_then_paged_decode_matches_transformers(tiny):
    _, loaded, hf = tiny
    kv_caches = new_kv_caches(loaded)
    prompt = TOKEN_IDS[:11]
    logits = [run_step(loaded, kv_caches, [prompt], [0], [BLOCK_IDS[:3]])]
    seq = list(prompt)
    for _ in range(6):  # decode steps cross two block boundaries
        seq.append(int(logits[-1][-1].argmax()))
        num_blocks = (len(seq) + BLOCK_SIZE - 1) // BLOCK_SIZE
        logits.append(run_step(loaded, kv_caches, [[seq[-1]]], [len(seq) - 1], [BLOCK_IDS[:num_blocks]]))
    ours = torch.cat(logits)  # (len(seq), vocab): position i predicts token i + 1
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf_logits(hf, seq), atol=1e-4, rtol=0)


def test_mixed_batch_with_chunked_prefill_matches_transformers(tiny):
    _, loaded, hf = tiny
    kv_caches = new_kv_caches(loaded)
    a, b = TOKEN_IDS[:6], TOKEN_IDS[3:]  # 6 and 14 tokens
    blocks_a, blocks_b = BLOCK_IDS[:2], BLOCK_IDS[2:6]
    # step 1: prefill all of A and the first 5 tokens of B
    step1 = run_step(loaded, kv_caches, [a, b[:5]], [0, 0], [blocks_a, blocks_b])
    next_a = int(step1[5].argmax())
    # step 2: decode A, and B's remaining 9 tokens attend to its 5 cached ones
    step2 = run_step(loaded, kv_caches, [[next_a], b[5:]], [6, 5], [blocks_a, blocks_b])
    ref_a, ref_b = hf_logits(hf, a + [next_a]), hf_logits(hf, b)
    torch.testing.assert_close(torch.cat([step1[:6], step2[:1]]), ref_a, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat([step1[6:], step2[1:]]), ref_b, atol=1e-4, rtol=0)


def test_loaded_model_metadata(tiny):
    arch, loaded, _ = tiny
    config = tiny_config(arch)
    assert loaded.dtype == torch.float32 and all(p.dtype == torch.float32 for p in loaded.model.parameters())
    assert not loaded.model.training
    assert loaded.num_layers == config.num_hidden_layers
    assert loaded.num_kv_heads == config.num_key_value_heads
    assert loaded.head_dim == (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    assert loaded.vocab_size == 49152 and loaded.max_position_embeddings == 512
    assert loaded.eos_token_ids == {2}
    assert loaded.generation_config["eos_token_id"] == 2
    assert loaded.tokenizer.chat_template


def test_tied_embeddings_share_one_tensor(tmp_path):
    path = make_tiny_model("llama_tied", tmp_path)
    model = load_model(str(path), dtype="float32").model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_auto_dtype_follows_checkpoint_and_bf16_matches_transformers(tmp_path):
    """dtype auto keeps a bf16 checkpoint in bf16 where the CPU has bf16 arithmetic (float32 elsewhere,
    tests/test_cpu_threads.py); bf16 itself matches transformers on every CPU."""
    path = make_tiny_model("qwen3", tmp_path, dtype=torch.bfloat16)
    assert load_model(str(path)).dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    loaded = load_model(str(path), dtype="bfloat16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    ours = run_step(loaded, new_kv_caches(loaded, torch.bfloat16), [TOKEN_IDS], [0], [BLOCK_IDS[:5]])
    torch.testing.assert_close(ours, hf_logits(hf, TOKEN_IDS), atol=2e-2, rtol=0)
    # Greedy agrees wherever the float32 reference has a clear winner (our logits are float32 sums,
    # transformers' bf16 ones are rounded, so a near-tie may land either way).
    ref32 = hf_logits(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(), TOKEN_IDS)
    top2 = ref32.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05
    assert clear.sum() >= len(TOKEN_IDS) // 2
    assert torch.equal(ours.argmax(-1)[clear], ref32.argmax(-1)[clear])


def test_load_weights_rejects_unknown_and_missing_tensors(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    hf_state = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()
    config = tiny_config("llama")
    with pytest.raises(ValueError, match="no matching parameter"):
        get_model_class(config)(config).load_weights([("model.layers.0.self_attn.x_proj.weight", torch.zeros(1))])
    partial = [(k, v) for k, v in hf_state.items() if "layers.1.mlp.up_proj" not in k]
    with pytest.raises(ValueError, match="missing 1 tensors"):
        get_model_class(config)(config).load_weights(partial)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 64},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rotary_cache_matches_transformers(rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from tokenmill.layers import RotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=512, rope_parameters=dict(rope))
    positions = torch.tensor([0, 1, 7, 63, 64, 300, 511])
    ours_cos, ours_sin = RotaryEmbedding(config, head_dim=32)(positions, torch.float32)  # (T, 1, 16)
    ref_cos, ref_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])  # (1, T, 32)
    torch.testing.assert_close(torch.cat([ours_cos[:, 0]] * 2, -1), ref_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat([ours_sin[:, 0]] * 2, -1), ref_sin[0], atol=1e-6, rtol=0)


def test_rotary_table_is_filled_only_as_far_as_the_engine_serves():
    """The table's storage is allocated at once and never moves; set_max_model_len computes only its first
    max_model_len rows (the same values as a full table), a read before any fill computes all of them, and
    positions past the filled rows are refused."""
    from tokenmill.layers import RotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 512})
    full = RotaryEmbedding(config, head_dim=32)
    assert full.rows_ready == 0
    assert full.cos_sin_cache.shape == (4096, 32) and full.rows_ready == 4096  # first read: every row
    fitted = RotaryEmbedding(config, head_dim=32)
    address = fitted.cos_sin_table.data_ptr()
    fitted.set_max_model_len(1000)
    assert fitted.rows_ready == 1000 and fitted.cos_sin_cache.shape == (1000, 32)
    assert fitted.cos_sin_cache.data_ptr() == address
    torch.testing.assert_close(fitted.cos_sin_cache, full.cos_sin_cache[:1000], atol=0, rtol=0)
    positions = torch.tensor([0, 5, 999])
    for ours, ref in zip(fitted(positions, torch.float32), full(positions, torch.float32)):
        assert torch.equal(ours, ref)
    with pytest.raises(IndexError):
        fitted(torch.tensor([1000]), torch.float32)
    fitted.set_max_model_len(8192)  # past the model's table: all of it
    assert fitted.rows_ready == 4096 and fitted.cos_sin_table.data_ptr() == address


# --- GGUF -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return load_model(str(smollm2_gguf_path()), dtype="float32", quantization="none")  # transformers dequantizes


def test_smollm2_gguf_matches_transformers(smollm2, hf_smollm2):
    hf = hf_smollm2
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    prompt = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    token_ids = smollm2.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    num_blocks = (len(token_ids) + BLOCK_SIZE - 1) // BLOCK_SIZE
    kv_caches = [
        (torch.zeros(num_blocks, BLOCK_SIZE, 3, 64), torch.zeros(num_blocks, BLOCK_SIZE, 3, 64)) for _ in range(30)
    ]
    ours = run_step(smollm2, kv_caches, [token_ids], [0], [list(range(num_blocks))[::-1]])
    ref = hf_logits(hf, token_ids)
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)
    assert int(ours[-1].argmax()) == int(ref[-1].argmax())


def test_smollm2_gguf_config_and_tokenizer(smollm2):
    config = smollm2.hf_config
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (30, 576, 9)
    assert (config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (3, 1536, 49152)
    assert config.max_position_embeddings == 8192 and config.rope_parameters["rope_theta"] == 100000.0
    assert smollm2.model.lm_head.weight is smollm2.model.model.embed_tokens.weight
    assert isinstance(smollm2.tokenizer, LightTokenizer)  # the GGUF cache's saved fast tokenizer, served without transformers
    assert smollm2.tokenizer.hf_class_name == "TokenizersBackend"
    assert "<|im_start|>" in smollm2.tokenizer.chat_template
    assert smollm2.eos_token_ids == {2} and smollm2.generation_config == {}


def test_gguf_auto_dtype_is_bfloat16_where_the_cpu_has_bf16_arithmetic():
    loaded = load_model(None)
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert loaded.dtype == expected
    assert {p.dtype for p in loaded.model.parameters()} == {expected}
    assert loaded.load_seconds < 60


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py stores as ``rope_freqs.weight`` for a llama3 rope_parameters
    dict: per frequency i, the divisor of ``base^(-2i/d)`` (1 above the high-frequency wavelength, ``factor``
    below the low-frequency one, ``1 / ((1 - s) / factor + s)`` between), F32 [head_dim / 2]."""
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    wavelen = 2 * np.pi / inv_freq.double().numpy()
    context = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    smooth = (context / wavelen - low) / (high - low)
    between = 1.0 / ((1.0 - smooth) / factor + smooth)
    divisors = np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, between))
    return divisors.astype(np.float32)


# tokenizer.* key -> the GGUFWriter method that writes it with the type llama.cpp uses
_TOKENIZER_WRITERS = {
    "tokenizer.ggml.model": "add_tokenizer_model", "tokenizer.ggml.pre": "add_tokenizer_pre",
    "tokenizer.ggml.tokens": "add_token_list", "tokenizer.ggml.token_type": "add_token_types",
    "tokenizer.ggml.merges": "add_token_merges", "tokenizer.ggml.bos_token_id": "add_bos_token_id",
    "tokenizer.ggml.eos_token_id": "add_eos_token_id", "tokenizer.ggml.unknown_token_id": "add_unk_token_id",
    "tokenizer.ggml.padding_token_id": "add_pad_token_id", "tokenizer.ggml.add_bos_token": "add_add_bos_token",
    "tokenizer.ggml.add_space_prefix": "add_add_space_prefix", "tokenizer.chat_template": "add_chat_template",
}


def _write_gguf(hf_model, arch: str, out_path, tokenizer_fields: dict | None = None) -> None:
    """Export a tiny HF model as an F32 GGUF the way llama.cpp does (Q/K rows permuted for llama; a llama3
    rope_parameters dict as a ``rope_freqs`` tensor and no rope.scaling keys). ``tokenizer_fields``: another
    GGUF's ``tokenizer.*`` values (``read_gguf_metadata(...).fields``) to copy, so engines can load the file."""
    config = hf_model.config
    head_dim = config.head_dim
    writer = gguf_writer_for(config, arch, out_path)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    for key, value in (tokenizer_fields or {}).items():
        getattr(writer, _TOKENIZER_WRITERS[key])(value)
    if config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config.rope_parameters, head_dim))
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
             "down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in hf_model.state_dict().items():
        w = tensor.float().numpy()
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:  # model.layers.{i}.{self_attn|mlp}.{proj}.{kind} or model.layers.{i}.{norm}.weight
            gguf_name = f"blk.{parts[2]}.{names[parts[-2]]}.{parts[-1]}"
        if arch == "llama" and parts[-2] in ("q_proj", "k_proj"):
            heads = config.num_attention_heads if parts[-2] == "q_proj" else config.num_key_value_heads
            w = w.reshape(heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch, gguf_arch", [("llama", "llama"), ("mistral", "llama"), ("qwen2", "qwen2"),
                                             ("qwen3", "qwen3")])
def test_gguf_export_of_tiny_model_loads_to_same_weights(arch, gguf_arch, tmp_path):
    path = make_tiny_model(arch, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    hf.config.head_dim = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    _write_gguf(hf, gguf_arch, tmp_path / "tiny.gguf")  # llama.cpp exports Mistral as "llama"
    reader = open_gguf(tmp_path / "tiny.gguf")
    config = gguf_to_hf_config(reader)
    assert config.architectures == (["LlamaForCausalLM"] if arch == "mistral" else list(hf.config.architectures))
    assert config.head_dim == hf.config.head_dim and not config.tie_word_embeddings
    assert getattr(config, "rope_freq_factors", None) is None
    expected = hf.state_dict()
    for weights in (dict(iter_gguf_weights(reader, config)),  # dequantized through the whole-file reader
                    dict(iter_mapped_weights(tmp_path / "tiny.gguf", read_tensor_index(reader), config))):
        assert weights.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(weights[name], tensor), name
    model = get_model_class(config)(config)
    model.load_weights(weights.items())  # every tensor lands somewhere, none missing


@pytest.fixture(scope="module")
def smollm2_reader():
    """The embedded GGUF through the `gguf` package's reader (several seconds: once per module)."""
    return open_gguf(smollm2_gguf_path())


@pytest.fixture(scope="module")
def smollm2_tokenizer_fields():
    """The embedded GGUF's ``tokenizer.*`` metadata (the tiny models use the SmolLM2 tokenizer)."""
    return {k: v for k, v in read_gguf_metadata(smollm2_gguf_path()).fields.items() if k.startswith("tokenizer.")}


def test_fast_header_reader_reads_what_the_gguf_package_reads(smollm2_reader):
    fast = read_gguf_metadata(smollm2_gguf_path())
    reference = {f.name: f.contents() for f in smollm2_reader.fields.values() if not f.name.startswith("GGUF.")}
    assert fast.fields == reference  # every key and value, the 49152 tokens and the merges included
    assert [(t.name, t.qtype, t.shape, t.offset, t.nbytes) for t in fast.tensors] == [
        (t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)), int(t.data_offset), int(t.n_bytes))
        for t in smollm2_reader.tensors]
    assert gguf_to_hf_config(fast).to_dict() == gguf_to_hf_config(smollm2_reader).to_dict()


def test_llama3_gguf_with_rope_freqs_matches_transformers(tmp_path, monkeypatch, smollm2_tokenizer_fields):
    """A Llama 3.x-style GGUF (llama3 RoPE stored as llama.cpp's ``rope_freqs`` divisors) loads, its inverse
    frequencies are transformers' llama3 ones within float32 rounding, and its greedy tokens over prompts
    reaching past the smoothed frequencies' wavelengths equal transformers' on the HF model."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.rotary_embedding import compute_inv_freq

    from transformers import AutoTokenizer

    from tests.test_gguf_cache import fresh_gguf_cache
    from tokenmill.models import gguf_cache

    fresh_gguf_cache(tmp_path / "cache", monkeypatch)
    hf_dir = make_tiny_model("llama_rope_llama3", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    rope, head_dim = hf.config.rope_parameters, hf.config.head_dim  # head_dim 16, original context 64
    divisors = llama3_rope_freqs(rope, head_dim)
    assert divisors[0] == 1 and divisors[-1] == rope["factor"]
    assert ((divisors > 1) & (divisors < rope["factor"])).sum() >= 2  # the smoothed band is exercised
    gguf_path = tmp_path / "llama3.gguf"
    _write_gguf(hf, "llama", gguf_path, smollm2_tokenizer_fields)

    config = gguf_to_hf_config(read_gguf_metadata(gguf_path))
    assert config.rope_parameters["rope_type"] == "default" and config.rope_freq_factors == divisors.tolist()
    # The same SmolLM2 tokenizer the file holds, put in the GGUF cache from the HF directory: transformers'
    # rebuild from GGUF metadata takes seconds (tests/test_gguf_cache.py covers it).
    gguf_cache.cached_tokenizer(gguf_path, lambda: AutoTokenizer.from_pretrained(str(hf_dir)))
    ours, scaling = compute_inv_freq(config, head_dim)
    theirs, their_scaling = ROPE_INIT_FUNCTIONS["llama3"](hf.config, torch.device("cpu"))
    assert scaling == their_scaling == 1.0
    torch.testing.assert_close(ours, theirs.float(), rtol=4 * 2**-24, atol=0)
    default, _ = compute_inv_freq(LlamaConfig(rope_parameters=config.rope_parameters, head_dim=head_dim), head_dim)
    assert not torch.allclose(default, ours)  # the factors change the frequencies

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (70, 150)]
    params = SamplingParams(temperature=0, max_tokens=12)
    for attempt in range(2):  # the second load takes the config (with its factors) from the GGUF cache
        llm = LLM(model=str(gguf_path), dtype="float32", kv_cache_memory=0.05, max_model_len=256)
        assert llm.engine.loaded.hf_config.rope_freq_factors == divisors.tolist()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.close()
        for prompt, output in zip(prompts, outputs):
            with torch.inference_mode():
                ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
            assert output.outputs[0].token_ids == ref[0, len(prompt):].tolist(), (attempt, len(prompt))


# --- loader errors and the default model ------------------------------------------------------


def test_default_model_is_the_embedded_smollm2_gguf():
    path = smollm2_gguf_path()
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_hub_name_is_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="never downloads") as excinfo:
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "local" in str(excinfo.value)


@pytest.mark.parametrize("dtype", ["float16", "fp32", "bf16", ""])
def test_bad_dtype_is_rejected_naming_dtype(dtype):
    with pytest.raises(ValueError, match="dtype") as excinfo:
        load_model(None, dtype=dtype)
    assert repr(dtype) in str(excinfo.value)


def test_unsupported_architecture_is_rejected(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architectures.*GPT2LMHeadModel"):
        load_model(str(path))


def test_directory_without_checkpoint_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(str(tmp_path / "notes.txt"))


def test_each_architecture_gives_its_layers_transformers_sliding_windows():
    """Which layers attend through config.sliding_window, as transformers' classes apply it: Mistral and Phi-3
    every layer when it is set, Qwen2/Qwen3 the layers from max_window_layers on (use_sliding_window; the same
    layers as transformers' own attention modules), Llama none (transformers ignores the key); the window
    reaches each layer's Attention; a window that is not a positive integer is refused by name."""
    from tokenmill.models.llama import LlamaForCausalLM, MistralForCausalLM

    mistral = tiny_config("mistral", sliding_window=16, num_hidden_layers=3)
    assert MistralForCausalLM.sliding_windows(mistral) == (16, 16, 16)
    assert MistralForCausalLM.sliding_windows(tiny_config("mistral")) == (None, None)  # sliding_window null
    assert LlamaForCausalLM.sliding_windows(LlamaConfig(num_hidden_layers=2, sliding_window=16)) == (None, None)
    qwen = tiny_config("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1)
    hf = AutoModelForCausalLM.from_config(qwen)
    expected = tuple(layer.self_attn.sliding_window for layer in hf.model.layers)
    assert expected == (None, 64, 64)
    model = get_model_class(qwen)(qwen)
    assert tuple(layer.self_attn.attn.sliding_window for layer in model.model.layers) == expected
    off = tiny_config("qwen2", use_sliding_window=False, sliding_window=64, max_window_layers=1)
    assert get_model_class(off).sliding_windows(off) == (None, None, None)
    qwen3 = tiny_config("qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert get_model_class(qwen3).sliding_windows(qwen3) == tuple(
        layer.self_attn.sliding_window for layer in AutoModelForCausalLM.from_config(qwen3).model.layers) == (None, 8)
    bad = tiny_config("mistral", sliding_window=16)
    bad.sliding_window = 0
    with pytest.raises(ValueError, match="sliding_window"):
        get_model_class(bad)(bad)