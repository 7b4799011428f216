"""The compiled CPU decode kernel and the torch paged attention against a dense float64 reference, with and
without sliding windows (keys p - window < j <= p) and Gemma 2's logit soft-capping."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_cpu_isa_paths import bf16_dot_modes, bf16_dot_path, build_for_isa
from tokenmill.attention import build_attention_metadata, cpu_decode
from tokenmill.attention.torch_paged import paged_attention, reference_decode_attention, write_kv
from tokenmill.csrc_build import ISAS


def dense_reference(q, k, v, scale, window=None, softcap=None):
    """q [Lq, H, D], k/v [Lk, KVH, D]; causal with the query at the end of the context; ``window``: the query at
    position p sees keys p - window < j <= p only (transformers' sliding-window masks); ``softcap``: scores
    become softcap * tanh(score / softcap) (Gemma 2). In float64."""
    lq, h, d = q.shape
    lk, kvh, _ = k.shape
    k = k.double().repeat_interleave(h // kvh, dim=1)
    v = v.double().repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(lq)[:, None] + lk - lq
    mask = torch.arange(lk)[None, :] <= q_pos
    if window is not None:
        mask &= torch.arange(lk)[None, :] > q_pos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def fill_cache(seqs, block_size, num_blocks, kvh, d, dtype, rng):
    """Scatter random K/V for sequences of the given lengths into shuffled blocks."""
    k_cache = torch.zeros(num_blocks, block_size, kvh, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = list(rng.permutation(num_blocks))
    tables, keys, values = [], [], []
    for n in seqs:
        nb = -(-n // block_size)
        table = [int(free.pop()) for _ in range(nb)]
        k = torch.randn(n, kvh, d).to(dtype)
        v = torch.randn(n, kvh, d).to(dtype)
        pos = np.arange(n)
        slots = torch.tensor(np.array(table)[pos // block_size] * block_size + pos % block_size)
        write_kv(k, v, k_cache, v_cache, slots)
        tables.append(table)
        keys.append(k)
        values.append(v)
    return k_cache, v_cache, tables, keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (6, 1, 32), (4, 2, 48), (4, 2, 24), (2, 2, 8),
                                   (4, 2, 96), (2, 1, 160), (2, 1, 256)])
@pytest.mark.parametrize("isa", ISAS)
def test_decode_kernel_matches_reference(isa, dtype, block_size, heads):
    """Every ISA path's build (this CPU's; others skip naming the CPU flags they need), GQA and not,
    head_dim on the specialised (64, 128), general SIMD (48, 32, 24, 8, 96, 160, 256: the VDPBF16PS path's
    generic width and its half 64-dim output tiles) and, for wide vectors, plain C loops."""
    lib = build_for_isa(cpu_decode._load, isa)
    h, kvh, d = heads
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    seqs = [1, 5, 17, 64, 33]
    k_cache, v_cache, tables, keys, values = fill_cache(seqs, block_size, 200, kvh, d, dtype, rng)
    max_blocks = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    q = torch.randn(len(seqs), h, d).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    meta, _ = build_attention_metadata(np.ones(len(seqs)), np.array(seqs) - 1, block_table.numpy(), block_size)
    ref_out = reference_decode_attention(q, k_cache, v_cache, meta, d**-0.5)
    for dot in bf16_dot_modes(lib, "paged_decode_set_dp"):  # the AVX512_BF16 build: float FMAs and VDPBF16PS
        with bf16_dot_path(lib, "paged_decode_set_dp", dot):
            out = cpu_decode._paged_decode(lib, q, k_cache, v_cache, block_table, torch.tensor(seqs), d**-0.5)
        for i, n in enumerate(seqs):
            ref = dense_reference(q[i : i + 1], keys[i], values[i], d**-0.5)[0]
            torch.testing.assert_close(out[i].double(), ref, atol=tol, rtol=tol)
        # The torch reference decode path agrees too.
        torch.testing.assert_close(ref_out.float(), out.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 24), (6, 1, 32)])
@pytest.mark.parametrize("isa", ISAS)
def test_decode_rows_sharing_a_context_keep_the_bits_of_each_row_alone(isa, dtype, heads):
    """Rows with one block table and lengths growing by one (a request's verify rows) are scored together
    by the kernel; each row's output must be the bits it gets as a batch of one, and near the reference.
    Rows of other requests around them, and a single long row (spread over kv-head tasks), too."""
    lib = build_for_isa(cpu_decode._load, isa)
    h, kvh, d = heads
    rng = np.random.default_rng(1)
    torch.manual_seed(1)
    k_cache, v_cache, tables, keys, values = fill_cache([40, 23, 300], 16, 64, kvh, d, dtype, rng)
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    # request 0 verifies 5 rows (lengths 36..40), request 1 decodes one row, request 2 verifies 2 rows
    row_table = [padded[0]] * 5 + [padded[1]] + [padded[2]] * 2
    row_lens = [36, 37, 38, 39, 40, 23, 299, 300]
    owner = [0, 0, 0, 0, 0, 1, 2, 2]
    q = torch.randn(len(row_lens), h, d).to(dtype)
    block_table, lens = torch.tensor(row_table), torch.tensor(row_lens)
    outs = []
    for dot in bf16_dot_modes(lib, "paged_decode_set_dp"):  # the AVX512_BF16 build: float FMAs and VDPBF16PS
        with bf16_dot_path(lib, "paged_decode_set_dp", dot):
            outs.append(check_grouped_rows(lib, q, k_cache, v_cache, block_table, lens, row_lens, owner, keys, values,
                                           dtype, d))
    if len(outs) == 2 and dtype == torch.bfloat16 and d % 32 == 0:  # the switch reaches the kernel
        assert not torch.equal(outs[0], outs[1])


def check_grouped_rows(lib, q, k_cache, v_cache, block_table, lens, row_lens, owner, keys, values, dtype, d):
    """Grouped rows' bits equal each row alone, near the reference, and the same for any thread count."""
    out = cpu_decode._paged_decode(lib, q, k_cache, v_cache, block_table, lens, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (n, o) in enumerate(zip(row_lens, owner)):
        alone = cpu_decode._paged_decode(lib, q[i : i + 1], k_cache, v_cache, block_table[i : i + 1], lens[i : i + 1],
                                         d**-0.5)
        assert torch.equal(alone, out[i : i + 1]), f"row {i}: grouped bits differ from the row alone"
        ref = dense_reference(q[i : i + 1], keys[o][:n], values[o][:n], d**-0.5)[0]
        torch.testing.assert_close(out[i].double(), ref, atol=tol, rtol=tol)
    # Few tasks for the threads split a (group, kv head) over its query heads: the bits stay the same
    # whatever the thread count (1: no split; a lone row or the 5-row group alone: split on 2+ threads).
    threads = torch.get_num_threads()
    try:
        for rows in (slice(0, 8), slice(0, 5), slice(5, 6)):
            want = None
            for num_threads in (1, 2, 3, 8):
                torch.set_num_threads(num_threads)
                got = cpu_decode._paged_decode(lib, q[rows], k_cache, v_cache, block_table[rows], lens[rows], d**-0.5)
                want = got if want is None else want
                assert torch.equal(got, want), f"rows {rows}: {num_threads} threads change the bits"
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("cached,chunk", [(0, 7), (8, 5), (13, 1), (0, 1), (16, 16)])
def test_paged_attention_mixed_batch_matches_dense(cached, chunk):
    """A decode, a prefill after a cached prefix and a fresh prefill in one flat batch."""
    h, kvh, d, bs = 6, 2, 32, 4
    rng = np.random.default_rng(1)
    torch.manual_seed(1)
    lens = [9, cached + chunk, 12]
    k_cache, v_cache, tables, keys, values = fill_cache(lens, bs, 64, kvh, d, torch.float32, rng)
    query_lens = np.array([1, chunk, 12])
    num_computed = np.array(lens) - query_lens
    max_blocks = max(len(t) for t in tables)
    block_table = np.array([t + [0] * (max_blocks - len(t)) for t in tables])
    meta, positions = build_attention_metadata(query_lens, num_computed, block_table, bs)
    q = torch.randn(int(query_lens.sum()), h, d)
    out = paged_attention(q, k_cache, v_cache, meta, d**-0.5)
    start = 0
    for i, n in enumerate(query_lens):
        ref = dense_reference(q[start : start + n], keys[i], values[i], d**-0.5)
        torch.testing.assert_close(out[start : start + n].double(), ref, atol=1e-5, rtol=1e-5)
        start += n
    assert positions.tolist() == list(range(8, 9)) + list(range(cached, cached + chunk)) + list(range(12))


WINDOWS = (1, 5, 16, 40)  # one key, inside a block, a whole block, and wider than most contexts below


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 24), (2, 1, 160), (4, 4, 32)])
@pytest.mark.parametrize("isa", ISAS)
def test_decode_kernel_with_sliding_window_and_softcap_matches_reference(isa, dtype, block_size, heads):
    """Every ISA path's build (and its VDPBF16PS path where it has one) attends over exactly the keys
    p - window < j <= p of each sequence, with and without soft-capping, as the dense reference and the torch
    reference decode path do; a window at least the context changes no bit."""
    lib = build_for_isa(cpu_decode._load, isa)
    h, kvh, d = heads
    rng = np.random.default_rng(2)
    torch.manual_seed(2)
    seqs = [1, 5, 17, 64, 33, 100]
    k_cache, v_cache, tables, keys, values = fill_cache(seqs, block_size, 400, kvh, d, dtype, rng)
    max_blocks = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    lens = torch.tensor(seqs)
    q = torch.randn(len(seqs), h, d).to(dtype) * 3  # large scores: the cap (2.0) bites
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    meta, _ = build_attention_metadata(np.ones(len(seqs)), np.array(seqs) - 1, block_table.numpy(), block_size)
    for dot in bf16_dot_modes(lib, "paged_decode_set_dp"):
        with bf16_dot_path(lib, "paged_decode_set_dp", dot):
            full = cpu_decode._paged_decode(lib, q, k_cache, v_cache, block_table, lens, d**-0.5)
            assert torch.equal(cpu_decode._paged_decode(lib, q, k_cache, v_cache, block_table, lens, d**-0.5, 100), full)
            for window in WINDOWS:
                for softcap in (None, 2.0):
                    out = cpu_decode._paged_decode(lib, q, k_cache, v_cache, block_table, lens, d**-0.5, window,
                                                   softcap)
                    for i in range(len(seqs)):
                        ref = dense_reference(q[i : i + 1], keys[i], values[i], d**-0.5, window, softcap)[0]
                        torch.testing.assert_close(out[i].double(), ref, atol=tol, rtol=tol,
                                                   msg=f"window {window} softcap {softcap} seq {i}")
                    torch_ref = reference_decode_attention(q, k_cache, v_cache, meta, d**-0.5, window, softcap)
                    torch.testing.assert_close(torch_ref.float(), out.float(), atol=tol, rtol=tol)
    short = [i for i, n in enumerate(seqs) if n > 5]
    windowed = cpu_decode._paged_decode(lib, q, k_cache, v_cache, block_table, lens, d**-0.5, 5)
    assert (windowed[short].float() - full[short].float()).abs().amax(dim=(1, 2)).min() > 1e-2  # the window bites


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_decode_rows_sharing_a_context_keep_their_bits_under_a_sliding_window(isa, dtype):
    """A request's verify rows (one block table, lengths growing by one) running across the window's edge: those
    within the window are scored together, the longer ones each alone from its window's first key; every row
    keeps the bits it gets as a batch of one and matches the dense windowed reference."""
    lib = build_for_isa(cpu_decode._load, isa)
    h, kvh, d, window = 9, 3, 64, 38
    rng = np.random.default_rng(3)
    torch.manual_seed(3)
    k_cache, v_cache, tables, keys, values = fill_cache([42, 23], 16, 64, kvh, d, dtype, rng)
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    row_lens = [35, 36, 37, 38, 39, 40, 41, 42, 23]  # 35..38 within the window, 39..42 past it
    block_table, lens = torch.tensor([padded[0]] * 8 + [padded[1]]), torch.tensor(row_lens)
    q = torch.randn(len(row_lens), h, d).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for dot in bf16_dot_modes(lib, "paged_decode_set_dp"):
        with bf16_dot_path(lib, "paged_decode_set_dp", dot):
            out = cpu_decode._paged_decode(lib, q, k_cache, v_cache, block_table, lens, d**-0.5, window, 5.0)
            for i, n in enumerate(row_lens):
                alone = cpu_decode._paged_decode(lib, q[i : i + 1], k_cache, v_cache, block_table[i : i + 1],
                                                 lens[i : i + 1], d**-0.5, window, 5.0)
                assert torch.equal(alone, out[i : i + 1]), f"row {i}: grouped bits differ from the row alone"
                owner = 0 if i < 8 else 1
                ref = dense_reference(q[i : i + 1], keys[owner][:n], values[owner][:n], d**-0.5, window, 5.0)[0]
                torch.testing.assert_close(out[i].double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 1, 3, 6, 40])
@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_paged_attention_with_sliding_window_and_softcap_matches_dense(window, softcap, use_kernel):
    """The layer's entry point over a decode, chunks after a cached prefix (across the window's edge) and fresh
    prompts in one flat batch: the torch paths (reference decode, SDPA or eager soft-capped prefill over only
    the window's blocks) and the compiled kernels attend over keys p - window < j <= p."""
    h, kvh, d, bs = 6, 2, 32, 4
    rng = np.random.default_rng(4)
    torch.manual_seed(4)
    lens = [9, 13, 12, 30, 2]
    query_lens = np.array([1, 5, 12, 9, 2])
    k_cache, v_cache, tables, keys, values = fill_cache(lens, bs, 64, kvh, d, torch.float32, rng)
    max_blocks = max(len(t) for t in tables)
    block_table = np.array([t + [0] * (max_blocks - len(t)) for t in tables])
    meta, _ = build_attention_metadata(query_lens, np.array(lens) - query_lens, block_table, bs)
    q = torch.randn(int(query_lens.sum()), h, d) * 3
    out = paged_attention(q, k_cache, v_cache, meta, d**-0.5, use_kernel=use_kernel, use_prefill_kernel=use_kernel,
                          sliding_window=window, logit_softcap=softcap)
    start = 0
    for i, n in enumerate(query_lens):
        ref = dense_reference(q[start : start + n], keys[i], values[i], d**-0.5, window, softcap)
        torch.testing.assert_close(out[start : start + n].double(), ref, atol=1e-5, rtol=1e-5, msg=f"request {i}")
        start += n
