"""The Triton paged-attention kernels against the torch reference (torch_paged.py), on CPU under
triton's interpreter: KV write, mixed decode + prefill batches over shuffled block tables, split-KV decode,
sliding windows, Gemma 2's attention logit soft-capping.

Triton decides compiled-or-interpreted when it decorates a kernel, including its own library
functions (tl.cdiv, tl.cumsum) decorated when triton is first imported. So TRITON_INTERPRET=1 is
set here before anything imports triton; if triton was already imported without it (by an earlier
test module), the kernel tests are skipped in this process and run by one test in a fresh one.
"""
from __future__ import annotations

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported; process-wide, harmless on CPU

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

triton_language = pytest.importorskip("triton.language")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from tests.triton_interpreter import rerun_in_interpreter  # noqa: E402
from tokenmill.attention import build_attention_metadata  # noqa: E402
from tokenmill.attention import triton_attention  # noqa: E402
from tokenmill.attention.torch_paged import paged_attention, write_kv  # noqa: E402
from tokenmill.attention.triton_attention import (  # noqa: E402
    choose_num_splits,
    triton_paged_attention,
    triton_write_kv,
)

INTERPRETED = isinstance(triton_language.cdiv, InterpretedFunction)
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="triton was imported before TRITON_INTERPRET=1: see test_kernels_in_fresh_interpreter"
)

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
CHUNK_LENS = (1, 2, 7, 16, 33)
PREFIX_LENS = (0, 5, 16, 40)


@pytest.mark.skipif(INTERPRETED, reason="the kernel tests run in this process")
def test_kernels_in_fresh_interpreter():
    rerun_in_interpreter(__file__)


def make_step(query_lens, num_cached, block_size, num_kv_heads, head_dim, dtype, rng, spare_blocks=7):
    """Metadata over shuffled, non-contiguous block ids and a random cache holding every context."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    num_cached = np.asarray(num_cached, dtype=np.int64)
    num_blocks = -(-(query_lens + num_cached) // block_size)  # (B,)
    total_blocks = int(num_blocks.sum()) + spare_blocks
    ids = rng.permutation(total_blocks)
    block_table = np.zeros((len(query_lens), int(num_blocks.max())), dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(num_blocks)])
    for i, n in enumerate(num_blocks):
        block_table[i, :n] = ids[offsets[i] : offsets[i + 1]]
    metadata, _ = build_attention_metadata(query_lens, num_cached, block_table, block_size)
    k_cache = torch.randn(total_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    return metadata, k_cache, v_cache


def assert_matches_reference(query, k_cache, v_cache, metadata, num_splits, sliding_window=None, logit_softcap=None):
    scale = query.shape[-1] ** -0.5
    expected = paged_attention(query, k_cache, v_cache, metadata, scale, sliding_window=sliding_window,
                               logit_softcap=logit_softcap)
    actual = triton_paged_attention(query, k_cache, v_cache, metadata, scale, num_splits=num_splits,
                                    sliding_window=sliding_window, logit_softcap=logit_softcap)
    assert actual.shape == query.shape and actual.dtype == query.dtype
    tol = TOLERANCE[query.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@needs_interpreter
@pytest.mark.parametrize(
    "source_dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
     (torch.float32, torch.float16), (torch.float32, torch.bfloat16)],
)
def test_write_kv_matches_reference_and_skips_padding(source_dtype, cache_dtype):
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    num_tokens, block_size, num_kv_heads, head_dim = 11, 8, 3, 32
    k_cache = torch.randn(6, block_size, num_kv_heads, head_dim).to(cache_dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.from_numpy(rng.permutation(6 * block_size)[:num_tokens].astype(np.int64))
    slots[[2, 7]] = -1  # padding tokens
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim).to(source_dtype)
    key = qkv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)  # non-contiguous rows
    value = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    write_kv(key[real], value[real], expected_k, expected_v, slots[real])
    triton_write_kv(key, value, k_cache, v_cache, slots)
    if (source_dtype, cache_dtype) == (torch.float32, torch.bfloat16):
        # The interpreter truncates float32 -> bfloat16 where torch (and the GPU) round to nearest
        # even: allow one bfloat16 ulp here; benchmarks/gpu/kernel_check.py checks exact equality.
        torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=2**-7)
        torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=2**-7)
    else:
        assert torch.equal(k_cache, expected_k)
        assert torch.equal(v_cache, expected_v)
    untouched = torch.ones(6 * block_size, dtype=torch.bool)
    untouched[slots[real]] = False  # padding slots (-1) must not wrap around to the last slot
    for cache, expected in ((k_cache, expected_k), (v_cache, expected_v)):
        assert torch.equal(cache.view(-1, num_kv_heads, head_dim)[untouched],
                           expected.view(-1, num_kv_heads, head_dim)[untouched])


# (block_size, num_heads, num_kv_heads, head_dim, dtype, num_splits): every block size, GQA ratio
# 1/3/4, head_dim 32/64/128 and dtype appears, with split-KV decode off and on.
CASES = [
    (8, 4, 4, 32, torch.float32, 1),
    (16, 6, 2, 64, torch.float32, 3),
    (8, 8, 2, 128, torch.float32, 1),
    (16, 4, 1, 32, torch.float32, 4),
    (16, 8, 2, 64, torch.bfloat16, 1),
    (8, 6, 2, 128, torch.bfloat16, 3),
    (8, 3, 1, 64, torch.float16, 2),
    (16, 4, 4, 128, torch.float16, 1),
]


@needs_interpreter
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,dtype,num_splits", CASES)
def test_mixed_batch_matches_reference(block_size, num_heads, num_kv_heads, head_dim, dtype, num_splits):
    """One step holding every (chunk length, cached prefix) pair: decodes, fresh prefills and
    prefills after a cached prefix, interleaved in the flat batch."""
    rng = np.random.default_rng(block_size * 1000 + head_dim)
    torch.manual_seed(head_dim + num_heads)
    pairs = [(c, p) for c in CHUNK_LENS for p in PREFIX_LENS]
    order = rng.permutation(len(pairs))
    query_lens = [pairs[i][0] for i in order]
    num_cached = [pairs[i][1] for i in order]
    metadata, k_cache, v_cache = make_step(query_lens, num_cached, block_size, num_kv_heads, head_dim, dtype, rng)
    query = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    assert_matches_reference(query, k_cache, v_cache, metadata, num_splits)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2, 5, 8])
def test_split_kv_decode_matches_reference(dtype, num_splits):
    """Decode-only steps with contexts from 1 to 300 keys: with 8 splits the short contexts
    leave trailing partitions empty, which the reduction must ignore."""
    rng = np.random.default_rng(num_splits)
    torch.manual_seed(num_splits)
    seq_lens = np.array([1, 17, 300, 100, 64])
    metadata, k_cache, v_cache = make_step(np.ones(5), seq_lens - 1, 16, 2, 64, dtype, rng)
    query = torch.randn(5, 8, 64).to(dtype)
    assert_matches_reference(query, k_cache, v_cache, metadata, num_splits)


@needs_interpreter
@pytest.mark.parametrize("window,num_splits", [(1, 1), (5, 2), (16, 1), (23, 3)])
def test_sliding_window_matches_reference(window, num_splits):
    """Sliding-window attention (keys p - window < j <= p): decodes and chunks, fresh and after a cached prefix,
    inside and far past the window (a prefill tile whose later rows see none of its first key tiles, decode
    partitions over the window only), against the torch reference's masks."""
    rng = np.random.default_rng(window)
    torch.manual_seed(window)
    query_lens, num_cached = [1, 33, 7, 1, 16, 2, 1], [60, 0, 40, 3, 16, 70, 100]
    metadata, k_cache, v_cache = make_step(query_lens, num_cached, 8, 2, 32, torch.float32, rng)
    query = torch.randn(sum(query_lens), 4, 32)
    assert_matches_reference(query, k_cache, v_cache, metadata, num_splits, sliding_window=window)
    if window < 16:  # the window bites: the full-context result differs
        full = triton_paged_attention(query, k_cache, v_cache, metadata, 32**-0.5, num_splits=num_splits)
        windowed = triton_paged_attention(query, k_cache, v_cache, metadata, 32**-0.5, num_splits=num_splits,
                                          sliding_window=window)
        assert (full - windowed).abs().max() > 0.1


@needs_interpreter
@pytest.mark.parametrize("dtype,window,num_splits", [(torch.float32, None, 1), (torch.float32, 5, 2),
                                                     (torch.bfloat16, None, 3), (torch.float32, None, 4)])
def test_logit_softcap_matches_reference(dtype, window, num_splits):
    """Gemma 2's soft-capping (scores ``cap * tanh(score / cap)`` before the mask and softmax) in the prefill and
    the (split) decode kernels, alone and with a sliding window, against the torch reference; the queries are
    scaled up so that scores reach past the cap (1.5 here) and the capped result is far from the uncapped one."""
    rng = np.random.default_rng(11 + num_splits)
    torch.manual_seed(11 + num_splits)
    query_lens, num_cached = [1, 33, 7, 1, 16, 1], [60, 0, 40, 3, 16, 250]
    metadata, k_cache, v_cache = make_step(query_lens, num_cached, 8, 2, 32, dtype, rng)
    query = (3.0 * torch.randn(sum(query_lens), 4, 32)).to(dtype)
    assert_matches_reference(query, k_cache, v_cache, metadata, num_splits, sliding_window=window, logit_softcap=1.5)
    capped = triton_paged_attention(query, k_cache, v_cache, metadata, 32**-0.5, num_splits=num_splits,
                                    sliding_window=window, logit_softcap=1.5)
    uncapped = triton_paged_attention(query, k_cache, v_cache, metadata, 32**-0.5, num_splits=num_splits,
                                      sliding_window=window)
    assert (capped.float() - uncapped.float()).abs().max() > 0.3


@needs_interpreter
def test_gemma2_through_the_triton_kernels_matches_transformers(tmp_path):
    """A tiny Gemma 2 (attention soft-capping 2.0, every feature off its default) with every Attention layer on the
    Triton kernels, as the CUDA runner routes them: a prefill then paged decode steps give transformers' float32
    logits (before this, such a layer was refused on the Triton path)."""
    from tests.test_models import BLOCK_IDS, TOKEN_IDS, hf_logits, new_kv_caches, run_step
    from tests.test_more_architectures import make_model
    from tokenmill.attention import Attention
    from tokenmill.models import load_model

    hf = make_model("gemma2", tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32")
    layers = [m for m in loaded.model.modules() if isinstance(m, Attention)]
    assert layers and all(layer.logit_softcap == 2.0 for layer in layers)
    for layer in layers:
        layer.use_triton = True
    kv_caches = new_kv_caches(loaded)
    seq = TOKEN_IDS[:11]
    logits = [run_step(loaded, kv_caches, [seq], [0], [BLOCK_IDS[:3]])]
    for n in range(11, 14):  # decode steps across a block boundary
        seq = TOKEN_IDS[: n + 1]
        logits.append(run_step(loaded, kv_caches, [[seq[-1]]], [n], [BLOCK_IDS[: (n + 4) // 4]]))
    torch.testing.assert_close(torch.cat(logits), hf_logits(hf, seq), atol=1e-4, rtol=0)


@needs_interpreter
def test_prefill_only_step_matches_reference():
    rng = np.random.default_rng(3)
    torch.manual_seed(3)
    metadata, k_cache, v_cache = make_step([2, 33, 16], [40, 0, 16], 8, 2, 32, torch.float32, rng)
    query = torch.randn(51, 4, 32)
    assert_matches_reference(query, k_cache, v_cache, metadata, None)


@needs_interpreter
def test_write_then_attend_equals_reference_layer_step():
    """The layer's two calls back to back: write this step's K/V, then attend (GQA 4, bfloat16)."""
    rng = np.random.default_rng(4)
    torch.manual_seed(4)
    query_lens, num_cached = [1, 7, 1, 16], [9, 5, 40, 0]
    metadata, k_cache, v_cache = make_step(query_lens, num_cached, 16, 2, 64, torch.bfloat16, rng)
    num_tokens = sum(query_lens)
    key, value = torch.randn(2, num_tokens, 2, 64).to(torch.bfloat16)
    query = torch.randn(num_tokens, 8, 64).to(torch.bfloat16)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv(key, value, ref_k, ref_v, metadata.slot_mapping)
    expected = paged_attention(query, ref_k, ref_v, metadata, 0.125)
    triton_write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
    actual = triton_paged_attention(query, k_cache, v_cache, metadata, 0.125)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    torch.testing.assert_close(actual.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_choose_num_splits_fills_the_gpu_only_when_it_pays():
    assert choose_num_splits(1, 8, 8192, 132) == 32  # one long sequence: split up to the cap
    assert choose_num_splits(2, 8, 4096, 132) == 16  # bounded by 256 keys per partition
    assert choose_num_splits(128, 8, 8192, 132) == 1  # the batch already fills every SM
    assert choose_num_splits(4, 8, 300, 132) == 1  # short contexts: not worth a second kernel


def test_rejects_mismatched_inputs():
    rng = np.random.default_rng(5)
    metadata, k_cache, v_cache = make_step([1, 3], [4, 0], 8, 2, 32, torch.float32, rng)
    query = torch.randn(4, 4, 32)
    with pytest.raises(ValueError, match="KV heads"):
        triton_paged_attention(torch.randn(4, 3, 32), k_cache, v_cache, metadata, 1.0)
    with pytest.raises(ValueError, match="block_size"):
        triton_paged_attention(query, k_cache.view(-1, 4, 2, 32), v_cache.view(-1, 4, 2, 32), metadata, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        triton_paged_attention(query.double(), k_cache, v_cache, metadata, 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        triton_paged_attention(query, k_cache, v_cache, metadata, 1.0, num_splits=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        triton_paged_attention(query, k_cache, v_cache, metadata, 1.0, logit_softcap=0.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_write_kv(torch.randn(4, 2, 32), torch.randn(4, 2, 32), k_cache, v_cache, metadata.slot_mapping[:3])


def test_available_needs_cuda_or_the_interpreter(monkeypatch):
    assert triton_attention.available()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_attention.available() == torch.cuda.is_available()


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenmill.attention import triton_kernels as k

def build(fn, types, constexprs, **options):
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options)

io = {name: "*bf16" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "key_ptr", "value_ptr")}
io |= {name: "*i64" for name in ("query_start_loc_ptr", "seq_lens_ptr", "block_table_ptr", "slot_mapping_ptr")}
io |= {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "scale_log2e": "fp32", "softcap_log2e": "fp32"}
build(k.write_kv_kernel, io, dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128))
for sliding, softcap in ((False, False), (True, False), (True, True)):  # Gemma 2: windows and soft-capping
    common = dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_D=128, DOT_F32=False, DOT_PRECISION="tf32",
                  SLIDING=sliding, SOFTCAP=softcap)
    build(k.prefill_kernel, io, dict(common, BLOCK_R=128, BLOCK_M=64, BLOCK_N=64), num_warps=4, num_stages=2)
    for split in (False, True):
        build(k.decode_kernel, io, dict(common, BLOCK_G=16, BLOCK_N=64, SPLIT=split), num_warps=4, num_stages=2)
build(k.reduce_kernel, io, dict(HEAD_DIM=128, BLOCK_S=32, BLOCK_D=128))
"""


def test_kernels_compile_for_hopper():
    """Compiled-mode code generation (not the interpreter) for sm_90 at serving shapes, bf16:
    catches what only a GPU run would otherwise show. Runs without a GPU (ptxas ships with triton)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
