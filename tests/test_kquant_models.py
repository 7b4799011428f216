"""Whole models in the GGUF formats added by issue 40 (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), run as stored.

Proves:
- the test quantizers (tests/gguf_quantizers.py, and gguf-py's for the 32-weight formats) write blocks that
  gguf-py dequantizes back to the input within half a step of each block (Q4_0/Q5_0: a whole step at -max);
- the embedded SmolLM2-135M requantized the way llama.cpp's Q4_K_M does it for this model (in_features 576
  is not a multiple of 256: Q5_0, and Q8_0 for attn_v in the use_more_bits layers; ffn_down Q4_K, Q6_K in
  those layers; the Q8_0 tied embedding) keeps those formats in memory (tiled where the build prefers it),
  decodes in the lean step, and gives the greedy tokens of its dequantized float32 twin wherever the twin's
  top-2 gap exceeds MARGIN (6 chats x 32 tokens, the comparison of tests/test_quantized_weights.py);
- tiny random Llama and Qwen3 models (hidden 256, intermediate 512: the K-quants apply) with the seven
  matrices of a layer in seven different formats (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0, Q4_0; q/k/v and
  gate/up fused from three and two formats; Q4_K embedding, Q6_K LM head) load to exactly the file's
  weights, decode in the lean step, give transformers' greedy tokens on the dequantized weights where the
  margin is clear with a small mean |logprob difference|; prefix caching on and off give the same tokens
  and bit-identical log-probabilities; deterministic mode gives a request the same bits alone, inside a
  batch of other requests and from the prefix cache.

Positions compared and mean |logprob difference| are printed (pytest -s shows them).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from tests.gguf_quantizers import quantize
from tests.gguf_writing import gguf_writer_for
from tests.test_quantized_weights import CHATS, MARGIN, compare_greedy, error_bound
from tests.tiny_models import smollm2_gguf_path, tiny_config
from tokenmill import LLM, SamplingParams, csrc_build
from tokenmill.quantization import qgemm
from tokenmill.quantization.formats import is_tiled
from tokenmill.quantization.gguf_weight import GGUFWeight
from tokenmill.runner import lean_decode

# the engine tests (the quantizer tests need no kernels)
needs_kernels = pytest.mark.skipif(not qgemm.available() or csrc_build.kernels_disabled(),
                                   reason="the quantized-weight C kernels (qgemm) are unavailable here (no C "
                                          "compiler, a failed build, or TOKENMILL_DISABLE_CPU_KERNELS=1)")
needs_lean_step = pytest.mark.skipif(not lean_decode.available(),
                                     reason="the lean decode step's C library cannot be built here")

# format -> (weights per block, levels): the step of a block is its range / levels (Q4_0, Q5_0: max|x| / 8, / 16)
STEPS = {T.Q4_0: (32, 8), T.Q5_0: (32, 16), T.Q8_0: (32, 127), T.Q4_1: (32, 15), T.Q5_1: (32, 31),
         T.Q4_K: (32, 15), T.Q5_K: (32, 31), T.Q6_K: (16, 31)}


def drop_cache_entry(path: Path) -> None:
    """Remove the GGUF cache entry the engines wrote for a temporary file (hundreds of MB for a dense load)."""
    from tokenmill.models.gguf_cache import entry_dir

    if path.exists():
        shutil.rmtree(entry_dir(path), ignore_errors=True)


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, prefixes: tuple[str, ...] = ("",)) -> None:
    """Every key/value field of ``reader`` whose name starts with one of ``prefixes`` (the writer writes
    the GGUF.* header and general.architecture itself)."""
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if not field.name.startswith(prefixes):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---------------------------------------------------------------- the quantizers


def quantization_error_bound(x: np.ndarray, qtype: T) -> np.ndarray:
    """Per weight of x [N, K], how far its dequantized value may be: half a step of its block, where the
    step is max|x| / levels for the symmetric formats and the block's range (over 0 for the K-quants) /
    levels for those with an offset. Q4_0 and Q5_0 (llama.cpp's rounding) use codes -8..7 / -16..15 with
    d = max / -8 / -16, so a weight near -max is clipped by up to a whole step. The K-quants' sub-block
    scales are integer multiples of an fp16 super-block scale, rounded up here: at most 1/63 (1/127 for
    Q6_K) of the super-block's largest step more, for the scale and again for Q4_K/Q5_K's min. Scales stay
    normal float16 numbers for the data of the test (max|x| >= 0.01)."""
    group, levels = STEPS[qtype]
    sub = x.reshape(x.shape[0], -1, group)  # (rows, blocks, weights)
    if qtype in (T.Q4_1, T.Q5_1):
        step = (sub.max(-1) - sub.min(-1)) / levels
    elif qtype in (T.Q4_K, T.Q5_K):
        step = (sub.max(-1) - np.minimum(sub.min(-1), 0)) / levels
    else:
        step = np.abs(sub).max(-1) / levels
    half = 1.0 if qtype in (T.Q4_0, T.Q5_0) else 0.5
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        per_super = step.reshape(x.shape[0], -1, 256 // group).max(-1, keepdims=True)
        extra = per_super * (1 / 127 if qtype == T.Q6_K else 2 / 63)
        step = (step.reshape(per_super.shape[0], -1, 256 // group) + extra).reshape(step.shape)
    # + the float16 rounding of the scale and the offset (2^-11 relative each, and gguf-py rounds the codes
    # with the unrounded ones): a few 2^-11 * max|x|
    bound = half * step + 2**-9 * np.abs(sub).max(-1)
    return np.repeat(bound, group, axis=1)


@pytest.mark.parametrize("qtype", list(STEPS), ids=lambda t: t.name)
def test_quantized_blocks_dequantize_to_the_input_within_half_a_step(qtype):
    """Random rows of very different scales (and an all-zero row, an all-positive one, outliers): gguf-py's
    dequantization of the blocks is within ``quantization_error_bound`` of each weight."""
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((24, 768)) * np.logspace(-2, 1, 24)[:, None]).astype(np.float32)
    x[3] = 0.0
    x[5] = np.abs(x[5]) + 0.5  # min > 0: Q4_K/Q5_K's offset is 0 there, Q4_1's is the min
    x[7, ::7] *= 20  # outliers inside some sub-blocks
    blocks = quantize(x, qtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert blocks.dtype == np.uint8 and blocks.shape == (24, 768 // block * type_size)
    err = np.abs(dequantize(blocks, qtype).reshape(x.shape) - x)
    worst = (err / np.maximum(quantization_error_bound(x, qtype), 1e-30)).max()
    print(f"{qtype.name}: worst error {worst:.3f} x the bound")
    assert worst <= 1.0, f"{qtype.name}: error {worst:.3f} x the bound"
    assert err[3].max() == 0.0  # zeros stay exact


def reference_output(token_ids: list[int], logprobs: list[dict[int, float]]) -> SimpleNamespace:
    """A RequestOutput-shaped greedy reference for ``compare_greedy``: per step its top-1 token and the
    log-probabilities of at least its top 2."""
    steps = [{t: SimpleNamespace(logprob=v) for t, v in lp.items()} for lp in logprobs]
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, logprobs=steps)])


def teacher_forced(outputs, score) -> list[SimpleNamespace]:
    """The reference's greedy outputs for ``compare_greedy``, from one prefill per output instead of a
    decode step per token: ``score(sequences)`` gives, per sequence and position, the reference's
    log-probabilities (top 2 at least) of the token that follows, for each prompt + the tested engine's
    tokens. Up to the first token where the two differ (where compare_greedy stops) the context is the
    reference's own, so this equals the reference's greedy continuation there."""
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]
    refs = []
    for out, scores in zip(outputs, score(sequences)):
        start, n = len(out.prompt_token_ids) - 1, len(out.outputs[0].token_ids)
        steps = scores[start:start + n]
        refs.append(reference_output([max(lp, key=lp.get) for lp in steps], steps))
    return refs


def engine_scores(llm):
    """``teacher_forced``'s score through an engine's prompt log-probabilities (top 2 per position)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)

    def score(sequences: list[list[int]]) -> list[list[dict[int, float]]]:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in sequences], params)
        # prompt_logprobs[i + 1]: token i + 1 after tokens 0..i
        return [[{t: lp.logprob for t, lp in entry.items()} for entry in o.prompt_logprobs[1:]] for o in outputs]
    return score


def hf_scores(hf):
    """``teacher_forced``'s score through a transformers model (float64 log-softmax, top 2)."""
    def score(sequences: list[list[int]]) -> list[list[dict[int, float]]]:
        result = []
        for ids in sequences:
            with torch.inference_mode():
                lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)  # row i: token i + 1
            top = torch.topk(lp, 2)
            result.append([{int(t): float(v) for v, t in zip(vs, ts)} for vs, ts in zip(top.values, top.indices)])
        return result
    return score


# ---------------------------------------------------------------- SmolLM2-135M as llama.cpp's Q4_K_M


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice (llama-quant.cpp) of the layers whose attn_v / ffn_down get Q6_K under Q4_K_M."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def q4_k_m_type(name: str, in_features: int, num_layers: int) -> T:
    """The format llama.cpp's Q4_K_M gives a matrix of this model: Q4_K, Q6_K on ffn_down and attn_v in the
    use_more_bits layers; where in_features is not a multiple of 256 Q4_K falls back to Q5_0 and Q6_K to Q8_0."""
    layer = int(name.split(".")[1])
    more = use_more_bits(layer, num_layers) and (".ffn_down." in name or ".attn_v." in name)
    if in_features % 256:
        return T.Q8_0 if more else T.Q5_0
    return T.Q6_K if more else T.Q4_K


def write_q4_k_m_smollm2(out_path: Path) -> dict[str, T]:
    """The embedded Q4_1 SmolLM2 requantized as Q4_K_M (from its Q4_1 values; the Q8_0 embedding copied as
    it is, every metadata field copied, Q/K rows in the stored llama.cpp order). Returns name -> format."""
    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    num_layers = int(reader.fields["llama.block_count"].contents())
    writer = gguf.GGUFWriter(str(out_path), "llama")
    copy_metadata(reader, writer)
    types = {}
    for t in reader.tensors:
        if t.tensor_type == T.F32 or t.name == "token_embd.weight":
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            types[t.name] = t.tensor_type
            continue
        w = dequantize(t.data, t.tensor_type)  # (out_features, in_features)
        types[t.name] = q4_k_m_type(t.name, w.shape[1], num_layers)
        writer.add_tensor(t.name, quantize(w, types[t.name]), raw_dtype=types[t.name])
    finish(writer)
    return types


@pytest.fixture(scope="module")
def smollm2_q4_k_m(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4_k_m") / "SmolLM2-135M-Q4_K_M.gguf"
    types = write_q4_k_m_smollm2(path)
    common = {"model": str(path), "dtype": "float32", "num_threads": 2, "max_model_len": 256, "kv_cache_memory": 0.05}
    quantized = LLM(quantization="gguf", **common)
    dense = LLM(quantization="none", cpu_kernels=False, **common)
    yield quantized, dense, types
    quantized.close()
    dense.close()
    drop_cache_entry(path)


@needs_kernels
def test_q4_k_m_smollm2_keeps_llama_cpps_formats_in_memory(smollm2_q4_k_m):
    quantized, _, types = smollm2_q4_k_m
    counts = {name: sum(1 for t in types.values() if t == fmt) for fmt, name in
              ((T.Q5_0, "Q5_0"), (T.Q4_K, "Q4_K"), (T.Q6_K, "Q6_K"), (T.Q8_0, "Q8_0"))}
    assert counts == {"Q5_0": 166, "Q4_K": 16, "Q6_K": 14, "Q8_0": 15}  # llama.cpp's mix for this model
    runner = quantized.engine.runner
    model = runner.model
    for i, layer in enumerate(model.model.layers):
        more = use_more_bits(i, len(model.model.layers))
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv_proj.weight is None and mlp.down_proj.weight is None
        assert attn.qkv_proj.quant.describe() == ("Q5_0+Q8_0" if more else "Q5_0")  # q, k Q5_0; v Q8_0 or Q5_0
        assert attn.o_proj.quant.describe() == "Q5_0" and mlp.gate_up_proj.quant.describe() == "Q5_0"
        assert mlp.down_proj.quant.describe() == ("Q6_K" if more else "Q4_K")
    assert model.lm_head.quant is model.model.embed_tokens.quant and model.lm_head.quant.describe() == "Q8_0"
    if qgemm.tiled_preferred():  # every segment repacked into the tiled layout
        weights = [m.quant for m in model.modules() if isinstance(getattr(m, "quant", None), GGUFWeight)]
        assert all(is_tiled(part.qtype) for w in weights for part in w.parts)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # only norms stay dense
    assert sum(p.numel() for p in model.parameters()) < 100_000


@needs_kernels
@needs_lean_step
def test_q4_k_m_smollm2_decodes_in_the_lean_step(smollm2_q4_k_m):
    """The runner installs the lean decode step (every projection quantized in formats it runs) and the
    decode steps take it."""
    quantized, _, _ = smollm2_q4_k_m
    runner = quantized.engine.runner
    lean = runner.model.model.lean_decode
    assert lean is not None and "lean decode step" in runner.kernel_choice, runner.kernel_choice
    steps = lean.steps
    quantized.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    assert lean.steps >= steps + 3  # the decode steps after the prefill ran in it


@needs_kernels
def test_q4_k_m_smollm2_greedy_tokens_match_the_dequantized_model_where_the_margin_is_clear(smollm2_q4_k_m):
    quantized, dense, _ = smollm2_q4_k_m
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
    messages = [[{"role": "user", "content": c}] for c in CHATS]
    got = quantized.chat(messages, params)
    diffs = compare_greedy(CHATS, got, teacher_forced(got, engine_scores(dense)))
    mean = sum(diffs) / len(diffs)
    print(f"SmolLM2 Q4_K_M native vs dequantized float32: {len(diffs)} positions compared, "
          f"mean |logprob diff| {mean:.4f}")
    assert len(diffs) >= 6 * 8 and mean < 0.1


# ---------------------------------------------------------------- tiny Llama and Qwen3 in every format

FORMATS = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_0)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
              "down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TINY_VOCAB = 512  # the first 512 tokens of the SmolLM2 tokenizer (specials, bytes, the first merges)
TINY_LAYERS = 2
# Weight init std: tests/tiny_models.py's 0.2 at 4x the width makes logits so large that the kernels' int8
# activation rounding alone moves log-probabilities by up to 0.8 nats (transformers with that rounding
# simulated moves them as much); at 0.1 it moves them by at most ~0.2, well inside MARGIN.
TINY_INIT = 0.1


def tiny_format(layer: int, projection: str) -> T:
    """Layer i's projections take FORMATS rotated by 3i: within a layer all seven differ, across layers
    each projection changes format (q/k/v fused into three segments, gate/up into two)."""
    return FORMATS[(PROJECTIONS.index(projection) + 3 * layer) % len(FORMATS)]


def tiny_tokenizer_fields(writer: gguf.GGUFWriter) -> None:
    """A 512-token GPT-2 BPE tokenizer cut from SmolLM2's: its first 512 tokens and the merges among them."""
    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:TINY_VOCAB]
    vocab = set(tokens)
    merges = [m for m in reader.fields["tokenizer.ggml.merges"].contents()
              if m.replace(" ", "", 1) in vocab and all(p in vocab for p in m.split(" "))]
    copy_metadata(reader, writer, ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                                   "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                                   "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
                                   "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template"))
    writer.add_token_list(tokens)
    writer.add_token_types(reader.fields["tokenizer.ggml.token_type"].contents()[:TINY_VOCAB])
    writer.add_token_merges(merges)


def permute_rows(w: np.ndarray, heads: int, inverse: bool = False) -> np.ndarray:
    """llama.cpp's Q/K row order for a llama GGUF (convert_hf_to_gguf's permute), or its inverse."""
    head_dim = w.shape[0] // heads
    if inverse:
        return w.reshape(heads, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(heads, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(hf_model, arch: str, out_path: Path) -> dict[str, torch.Tensor]:
    """The HF model as a GGUF with every matrix quantized (``tiny_format``; token_embd Q4_K, output Q6_K) and
    the norms F32. Returns the HF state dict of what the file holds: the dequantized weights, rows back in HF order."""
    config = hf_model.config
    writer = gguf_writer_for(config, arch, out_path)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    tiny_tokenizer_fields(writer)
    dequantized = {}
    for name, tensor in hf_model.state_dict().items():
        w = tensor.float().numpy()
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            gguf_name, qtype = "token_embd.weight", T.Q4_K
        elif name == "model.norm.weight":
            gguf_name, qtype = "output_norm.weight", T.F32
        elif name == "lm_head.weight":
            gguf_name, qtype = "output.weight", T.Q6_K
        else:  # model.layers.{i}.{self_attn|mlp}.{proj}.weight or model.layers.{i}.{norm}.weight
            gguf_name = f"blk.{parts[2]}.{GGUF_NAMES[parts[-2]]}.{parts[-1]}"
            qtype = tiny_format(int(parts[2]), parts[-2]) if parts[-2] in PROJECTIONS else T.F32
        heads = None
        if arch == "llama" and parts[-2] in ("q_proj", "k_proj"):
            heads = config.num_attention_heads if parts[-2] == "q_proj" else config.num_key_value_heads
            w = permute_rows(w, heads)
        if qtype == T.F32:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
            dequantized[name] = tensor.float().clone()
            continue
        blocks = quantize(w, qtype)
        writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        back = dequantize(blocks, qtype).reshape(w.shape)
        if heads is not None:
            back = permute_rows(back, heads, inverse=True)
        dequantized[name] = torch.from_numpy(np.ascontiguousarray(back))
    finish(writer)
    return dequantized


def token_logprobs(output) -> tuple[list[int], list[float]]:
    out = output.outputs[0]
    return out.token_ids, [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


TINY_ARCHS = {"llama": "llama", "qwen3": "qwen3"}  # tests/tiny_models.py key -> GGUF architecture


@pytest.fixture(scope="module", params=list(TINY_ARCHS))
def tiny_quantized(request, tmp_path_factory):
    """(arch, path of the GGUF, transformers model on its dequantized weights, engine with prefix caching,
    engine without, deterministic engine)."""
    from transformers import AutoModelForCausalLM

    arch = request.param
    config = tiny_config(arch, hidden_size=256, intermediate_size=512, vocab_size=TINY_VOCAB, head_dim=64,
                         num_hidden_layers=TINY_LAYERS, initializer_range=TINY_INIT)
    torch.manual_seed(40)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(f"kquant_{arch}") / f"tiny-{arch}.gguf"
    hf.load_state_dict(write_tiny_gguf(hf, TINY_ARCHS[arch], path))
    common = {"model": str(path), "quantization": "gguf", "dtype": "float32", "num_threads": 2, "num_kv_blocks": 96,
              "block_size": 16}
    engines = {"prefix": LLM(**common), "no_prefix": LLM(**common, enable_prefix_caching=False),
               "deterministic": LLM(**common, deterministic=True)}
    for name in ("prefix", "no_prefix"):  # every row count on the quantized kernel, whatever the plan measured
        for module in engines[name].engine.runner.model.modules():
            if isinstance(getattr(module, "quant", None), GGUFWeight):
                module.quant.dequantize_table = ()
    yield SimpleNamespace(arch=arch, path=path, hf=hf, **engines)
    for llm in engines.values():
        llm.close()
    drop_cache_entry(path)


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY_VOCAB, (length,), generator=gen).tolist() for _ in range(count)]


@needs_kernels
def test_tiny_models_keep_every_format_quantized_and_load_the_files_weights(tiny_quantized):
    """Every projection stays in its file format (fused q/k/v and gate/up as segments of different formats),
    the embedding Q4_K and the LM head Q6_K; each weight dequantizes exactly to the file's dequantized values
    (llama's Q/K rows back in transformers' order) and its product is within the activation-rounding bound
    of tests/test_quantized_weights.py."""
    model = tiny_quantized.prefix.engine.runner.model
    hf = tiny_quantized.hf.state_dict()
    gen = torch.Generator().manual_seed(5)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        fmt = {name: tiny_format(i, name).name for name in PROJECTIONS}
        fused = {attn.qkv_proj: ("q_proj", "k_proj", "v_proj"), attn.o_proj: ("o_proj",),
                 mlp.gate_up_proj: ("gate_proj", "up_proj"), mlp.down_proj: ("down_proj",)}
        for linear, names in fused.items():
            assert linear.weight is None and linear.quant.describe() == "+".join(fmt[n] for n in names)
            kind = "self_attn" if names[0].endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            w = torch.cat([hf[f"model.layers.{i}.{kind}.{n}.weight"] for n in names])
            assert torch.equal(linear.quant.dequantize(torch.float32), w), (i, names)
            x = torch.randn(7, w.shape[1], generator=gen)
            err = (linear.quant.matmul(x).double() - x.double() @ w.double().T).abs()
            assert (err <= error_bound(x, w.double())).all(), (i, names)
    embed = model.model.embed_tokens
    assert embed.quant.describe() == "Q4_K" and model.lm_head.quant.describe() == "Q6_K"
    assert torch.equal(embed(torch.arange(TINY_VOCAB)), hf["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.quant.dequantize(torch.float32), hf["lm_head.weight"])


@needs_kernels
@needs_lean_step
def test_tiny_models_decode_in_the_lean_step(tiny_quantized):
    runner = tiny_quantized.prefix.engine.runner
    lean = runner.model.model.lean_decode
    assert lean is not None and "lean decode step" in runner.kernel_choice, runner.kernel_choice
    steps = lean.steps
    tiny_quantized.prefix.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4))
    assert lean.steps >= steps + 3


@needs_kernels
def test_tiny_models_follow_transformers_on_the_dequantized_weights(tiny_quantized):
    """Greedy tokens equal transformers' (float32, on the dequantized weights) wherever its top-2 gap exceeds
    MARGIN, with a small mean |logprob difference|: the only difference is the kernels' int8 rounding of the
    activations (these random models have flat distributions over 512 tokens: many top-2 gaps are below
    MARGIN, where a flip is allowed and the comparison of that output stops)."""
    prompts = random_prompts(12, 12, seed=1) + random_prompts(4, 70, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)
    got = tiny_quantized.no_prefix.generate([{"prompt_token_ids": p} for p in prompts], params)
    want = teacher_forced(got, hf_scores(tiny_quantized.hf))
    diffs = compare_greedy([f"prompt {i}" for i in range(len(prompts))], got, want)
    mean = sum(diffs) / len(diffs)
    print(f"tiny {tiny_quantized.arch} (Q4_K Q5_K Q6_K Q5_0 Q5_1 Q8_0 Q4_0) vs transformers: {len(diffs)} positions "
          f"compared, mean |logprob diff| {mean:.4f}, max {max(diffs):.4f}")
    assert len(diffs) >= 8 * len(prompts) and mean < 0.08
    assert max(diffs) < MARGIN / 2  # the rounding noise stays well inside the margin that excuses a flip


def shared_prefix_prompts() -> list[list[int]]:
    """Five prompts sharing a 53-token prefix (3 full blocks of 16) with tails of 3 to 20 tokens."""
    prefix = random_prompts(1, 53, seed=3)[0]
    return [prefix + tail for tail in (random_prompts(1, n, seed=10 + n)[0] for n in (3, 9, 14, 20, 5))]


@needs_kernels
def test_prefix_caching_on_and_off_give_the_same_tokens_and_logprobs(tiny_quantized):
    """Five prompts sharing three blocks, run twice (the second run computes only their tails): the same
    tokens and bit-identical log-probabilities as an engine without prefix caching. (The fixture keeps every
    row count on the quantized kernel, whose rows are batch invariant: this machine's measured plan does
    that for these models anyway; a plan that dequantized for torch's GEMM at prefill sizes would round
    the prefix and the tails' activations differently.)"""
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    reference = [token_logprobs(o) for o in tiny_quantized.no_prefix.generate(prompts, params)]
    for run in range(2):  # the second run finds every prompt's prefix blocks in the cache
        outputs = tiny_quantized.prefix.generate(prompts, params)
        if run == 1:
            assert all(o.num_cached_tokens >= 48 for o in outputs), [o.num_cached_tokens for o in outputs]
        for i, (out, (ref_tokens, ref_logprobs)) in enumerate(zip(outputs, reference)):
            tokens, logprobs = token_logprobs(out)
            assert tokens == ref_tokens, (run, i)
            assert logprobs == ref_logprobs, (run, i)  # bit for bit
    tiny_quantized.prefix.engine.check_integrity()


@needs_kernels
def test_deterministic_mode_is_bit_identical_alone_in_a_batch_and_from_the_prefix_cache(tiny_quantized):
    llm = tiny_quantized.deterministic
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts()]
    others = [{"prompt_token_ids": p} for p in random_prompts(3, 37, seed=4)]
    alone = token_logprobs(llm.generate(prompts[1], params)[0])
    batched = llm.generate(others[:2] + [prompts[1]] + others[2:], params)
    assert token_logprobs(batched[2]) == alone  # bit for bit: tokens and float logprobs
    cached = llm.generate(prompts, params)  # prompt 1's prefix (and its whole prompt) now come from the cache
    assert cached[1].num_cached_tokens >= 48
    assert token_logprobs(cached[1]) == alone
