"""Quantized KV cache (``--kv-cache-dtype int8|fp8_e4m3``, tokenmill/attention/kv_quant.py): codes and
per-token, per-head scales against their error bounds, paged attention over a quantized cache against
the reference over the same values dequantized, the embedded model's greedy tokens against the float
KV cache wherever the top-2 gap is clear, capacity in tokens, and the combinations refused.
"""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.attention.kv_quant import QuantizedKVCache, SCALE_DTYPE, gather_dequantized, quantize, storage_dtype
from tokenmill.attention.metadata import build_attention_metadata
from tokenmill.attention.torch_paged import paged_attention, write_kv
from tokenmill.config import ConfigError

DTYPES = ["int8", "fp8_e4m3"]


@pytest.mark.parametrize("name", DTYPES)
def test_codes_and_scales_stay_within_their_error_bound(name):
    torch.manual_seed(0)
    x = torch.randn(257, 3, 64) * torch.logspace(-3, 2, 257).view(-1, 1, 1)  # magnitudes over five decades
    x[5] = 0.0  # an all-zero vector keeps a finite scale and decodes to zeros
    codes, scales = quantize(x, storage_dtype(name))
    assert codes.dtype == storage_dtype(name) and scales.dtype == SCALE_DTYPE and scales.shape == (257, 3)
    back = codes.float() * scales.float().unsqueeze(-1)
    amax = x.abs().amax(-1, keepdim=True)
    # int8: half a step of amax/127 (plus float16's rounding of the scale); e4m3: 3 mantissa bits.
    bound = amax * (0.5 / 127 + 2**-10) if name == "int8" else x.abs() * 2**-4 + amax * 2**-9
    assert torch.all((back - x).abs() <= bound + 1e-12)
    assert torch.equal(back[5], torch.zeros(3, 64)) and torch.all(scales > 0)


def fill_caches(name: str, num_blocks: int = 12, block_size: int = 4, kv_heads: int = 2, head_dim: int = 16):
    """A quantized cache and a float cache holding exactly its dequantized values, written through write_kv."""
    dtype = storage_dtype(name)
    quant = [QuantizedKVCache(torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype),
                              torch.zeros(num_blocks, block_size, kv_heads, dtype=SCALE_DTYPE)) for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size)
    k, v = torch.randn(len(slots), kv_heads, head_dim), torch.randn(len(slots), kv_heads, head_dim)
    write_kv(k, v, quant[0], quant[1], slots)
    ids = torch.arange(num_blocks)
    plain = [gather_dequantized(c, ids) for c in quant]
    exact = [torch.zeros(num_blocks, block_size, kv_heads, head_dim) for _ in range(2)]
    write_kv(k, v, exact[0], exact[1], slots)
    return quant, plain, exact


@pytest.mark.parametrize("name", DTYPES)
def test_paged_attention_reads_the_dequantized_values_for_prefill_and_decode(name):
    torch.manual_seed(1)
    quant, plain, exact = fill_caches(name)
    block_size = 4
    # Two requests mid-prefill (chunks of 5 and 3 tokens) and two decoding, over shuffled blocks.
    query_lens, seq_lens = [5, 3, 1, 1], [11, 7, 13, 9]
    tables = [[3, 7, 1, 0], [0, 9, 0, 0], [2, 4, 8, 11], [5, 6, 10, 0]]
    computed = [s - q for s, q in zip(seq_lens, query_lens)]
    metadata, _ = build_attention_metadata(query_lens, computed, tables, block_size)
    q = torch.randn(sum(query_lens), 4, 16)
    got = paged_attention(q, quant[0], quant[1], metadata, 0.25)
    same_values = paged_attention(q, plain[0], plain[1], metadata, 0.25, use_kernel=False)
    torch.testing.assert_close(got, same_values, rtol=1e-5, atol=1e-5)  # only the storage differs
    unquantized = paged_attention(q, exact[0], exact[1], metadata, 0.25, use_kernel=False)
    tolerance = 0.03 if name == "int8" else 0.2
    assert (got - unquantized).abs().max() < tolerance


@pytest.fixture(scope="module")
def runs():
    """The embedded model's greedy tokens and top-2 logprobs with the float KV cache and each quantized one."""
    prompts = ["Write a haiku about the sea.", "What is the capital of France?", "List three prime numbers.",
               "Explain photosynthesis in one sentence."]
    out = {}
    for name in ["auto", *DTYPES]:
        with LLM(num_threads=1, kv_cache_memory=0.05, kv_cache_dtype=name) as llm:
            out[name] = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                                 SamplingParams(max_tokens=24, temperature=0, logprobs=2))
            out[name + "_tokens"] = llm.engine.runner.num_kv_tokens
            out[name + "_bytes"] = llm.engine.runner.bytes_per_token
    return out


@pytest.mark.parametrize("name, margin", [("int8", 0.5), ("fp8_e4m3", 1.5)])
def test_embedded_model_greedy_tokens_equal_the_float_cache_where_the_top2_gap_is_clear(runs, name, margin):
    diffs = []
    for ref, got in zip(runs["auto"], runs[name]):
        ref_out, got_out = ref.outputs[0], got.outputs[0]
        for i, (a, b) in enumerate(zip(ref_out.token_ids, got_out.token_ids)):
            top2 = sorted((lp.logprob for lp in ref_out.logprobs[i].values()), reverse=True)[:2]
            if a != b:  # the first divergence must be a near-tie of the float run; after it contexts differ
                assert top2[0] - top2[1] < margin, (name, i, top2)
                break
            diffs.append(abs(ref_out.logprobs[i][a].logprob - got_out.logprobs[i][b].logprob))
    print(f"{name}: mean |logprob difference| on agreeing tokens {sum(diffs) / len(diffs):.4f} over {len(diffs)}")
    assert len(diffs) >= {"int8": 24, "fp8_e4m3": 12}[name]  # a good part of the 4 x 24 tokens before any near-tie


def test_capacity_in_tokens_and_bytes(runs):
    head_dim, layers, kv_heads = 64, 30, 3  # SmolLM2-135M
    bf16_bytes = 2 * layers * kv_heads * head_dim * 2
    for name in DTYPES:
        assert runs[name + "_bytes"] == 2 * layers * kv_heads * (head_dim + 2)  # codes + a float16 scale
        assert bf16_bytes / runs[name + "_bytes"] > 1.93  # 128 / 66 per head: about twice bf16's tokens
        assert runs[name + "_tokens"] >= 1.93 * runs["auto_tokens"] * runs["auto_bytes"] / bf16_bytes


def test_unsupported_combinations_are_refused(tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(num_threads=1, kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="batch-invariant"):
        LLM(num_threads=1, kv_cache_dtype="int8", deterministic=True)
