"""bi_linear and bi_rms_norm: accuracy against float64 / the torch RMSNorm, and bitwise row invariance,
on every ISA path this CPU can run (the others are skipped, naming the missing CPU flags).

Invariance means: a row's output bits do not change with the batch size, the row's position, the
contents of the other rows, or the thread count. Every path but avx512_bf16 computes the C file's
"canonical order", so those paths must also agree bit for bit with the portable build, which is
built and checked on every machine.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tokenmill import csrc_build
from tokenmill.layers import batch_invariant as bi
from tokenmill.layers.layernorm import RMSNorm

pytestmark = pytest.mark.skipif(not bi.available(), reason="batch-invariant CPU kernels unavailable (no C compiler?)")
# x86 paths and NEON; the portable path runs everywhere (TM_PORTABLE: plain C loops).
CANONICAL_ISAS = ("portable", "avx2", "avx512", "neon")


@functools.cache
def _lib(isa: str):
    return bi._load(isa)


def lib_for(isa: str):
    """The kernels built for ``isa``, or a skip that names what this CPU lacks."""
    if not csrc_build.isa_supported(isa):
        pytest.skip(f"this CPU cannot run the {isa} path (missing: {', '.join(csrc_build.missing_cpu_flags(isa))})")
    lib = _lib(isa)
    assert lib is not None, f"the {isa} build failed"
    assert lib.bi_isa().decode() == isa
    return lib

DTYPES = [torch.bfloat16, torch.float32]
MS = [0, 1, 2, 3, 5, 7, 8, 9, 17, 33, 64, 130]
# (K, N): K below, at and above multiples of 32 (the bf16 step) and 16 (fp32); N off the 4/8/16 column tiles.
KNS = [(1, 1), (31, 5), (32, 16), (33, 19), (100, 37), (576, 64), (1000, 23)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns, so comparisons are exact (-0 != +0, NaN == NaN)."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(bits(a), bits(b)), f"{(bits(a) != bits(b)).sum().item()} elements differ"


def random_linear(m: int, k: int, n: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def check_linear_accuracy(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """|y - ref| <= output rounding + float32 accumulation error bound."""
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    magnitude = x.double().abs() @ w.double().abs().T
    k = x.shape[1]
    rounding = 2.0**-8 if y.dtype == torch.bfloat16 else 2.0**-23
    bound = rounding * ref.abs() + (k + 8) * 2.0**-24 * magnitude + 1e-30
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k,n", KNS)
def test_linear_matches_float64_reference(dtype, with_bias, k, n):
    for m in MS:
        x, w, b = random_linear(m, k, n, dtype, with_bias, seed=m)
        y = bi.bi_linear(x, w, b)
        assert y.shape == (m, n) and y.dtype == dtype
        check_linear_accuracy(y, x, w, b)


def check_row_invariance(fn, x: torch.Tensor) -> None:
    """fn(x) row by row equals fn on single rows, a permuted batch, a batch with the other rows
    replaced, a larger batch holding x at an offset, and a single thread."""
    m = x.shape[0]
    full = fn(x)
    for i in range(m):
        assert_same_bits(fn(x[i : i + 1])[0], full[i])
    g = torch.Generator().manual_seed(m)
    perm = torch.randperm(m, generator=g)
    assert_same_bits(fn(x[perm]), full[perm])
    keep = torch.rand(m, generator=g) < 0.5
    other = torch.randn(x.shape, generator=g).to(x.dtype) * 3
    other[keep] = x[keep]
    assert_same_bits(fn(other)[keep], full[keep])
    noise = torch.randn(3, x.shape[1], generator=g).to(x.dtype)
    assert_same_bits(fn(torch.cat([noise, x, noise[:2]]))[3 : 3 + m], full)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = fn(x)
        torch.set_num_threads(2)
        double = fn(x)
    finally:
        torch.set_num_threads(threads)
    assert_same_bits(single, full)
    assert_same_bits(double, full)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(33, 19), (576, 64), (1000, 23)])
def test_linear_rows_are_batch_invariant(dtype, k, n):
    x, w, b = random_linear(130, k, n, dtype, bias=True)
    for m in [1, 2, 3, 5, 7, 8, 9, 17, 33, 130]:
        check_row_invariance(lambda t: bi.bi_linear(t, w, b), x[:m])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_invariant_across_row_chunks(dtype):
    """K large enough that 300 rows are processed in several L2-sized chunks."""
    x, w, b = random_linear(300, 4100, 40, dtype, bias=False, seed=1)
    full = bi.bi_linear(x, w, b)
    check_linear_accuracy(full, x, w, b)
    for i in [0, 63, 64, 65, 128, 299]:
        assert_same_bits(bi.bi_linear(x[i : i + 1], w, b)[0], full[i])
    assert_same_bits(bi.bi_linear(x.flip(0), w, b), full.flip(0))


def test_linear_invariant_on_model_shapes():
    """A bf16 SmolLM2-sized projection, with F.linear's failing batch sizes."""
    x, w, b = random_linear(130, 576, 960, torch.bfloat16, bias=False, seed=2)
    full = bi.bi_linear(x, w)
    check_linear_accuracy(full, x, w, b)
    for m in [1, 2, 3, 5, 7, 9]:
        assert_same_bits(bi.bi_linear(x[:m], w), full[:m])


def test_linear_non_contiguous_x_and_empty_batch():
    x, w, b = random_linear(9, 64, 24, torch.float32, bias=True)
    strided = torch.randn(9, 128)[:, ::2]
    strided.copy_(x)
    assert not strided.is_contiguous()
    assert_same_bits(bi.bi_linear(strided, w, b), bi.bi_linear(x, w, b))
    empty = bi.bi_linear(x[:0], w, b)
    assert empty.shape == (0, 24) and empty.dtype == torch.float32


def test_linear_rejects_bad_inputs():
    x, w, b = random_linear(4, 32, 8, torch.float32, bias=True)
    with pytest.raises(ValueError, match="bfloat16 or all float32"):
        bi.bi_linear(x.half(), w.half())
    with pytest.raises(ValueError, match="bfloat16 or all float32"):
        bi.bi_linear(x, w.bfloat16())
    with pytest.raises(ValueError, match="bfloat16 or all float32"):
        bi.bi_linear(x, w, b.double())
    with pytest.raises(ValueError, match="K=31"):
        bi.bi_linear(x[:, :31], w)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        bi.bi_linear(x[0], w)
    with pytest.raises(ValueError, match="bias must be"):
        bi.bi_linear(x, w, b[:7])
    with pytest.raises(ValueError, match="contiguous"):
        bi.bi_linear(x, torch.randn(32, 8).T)


@pytest.mark.parametrize("isa", csrc_build.ISAS)
def test_every_isa_build_is_accurate_and_invariant(isa):
    """Each ISA path's build, forced here whatever path this machine would pick by itself."""
    lib = lib_for(isa)
    for dtype in DTYPES:
        for m, k, n in [(9, 100, 37), (5, 33, 19), (3, 576, 20)]:
            x, w, b = random_linear(m, k, n, dtype, bias=True, seed=k)
            y = bi._linear(lib, x, w, b)
            check_linear_accuracy(y, x, w, b)
            check_row_invariance(lambda t: bi._linear(lib, t, w, b), x)
        g = torch.ones(100, dtype=dtype) * 0.5
        x = random_linear(9, 100, 1, dtype, bias=False)[0]
        check_row_invariance(lambda t: bi._rms_norm(lib, t, g, 1e-6), x)


@pytest.mark.parametrize("isa", csrc_build.ISAS)
def test_linear_heads_gives_each_heads_bi_linear_bits(isa):
    """bi_linear_heads (multi-head latent attention's absorbed products): every head's result has the bits of
    bi_linear on that head alone, for decode-sized batches (one parallel region over heads and column blocks),
    batches past one row chunk (a call per head), one or two threads, and heads read in place from a wider
    per-head layout (W_UV inside kv_b_proj's weight)."""
    lib = lib_for(isa)
    threads = torch.get_num_threads()
    try:
        for dtype in DTYPES:
            for h, m, n, k in [(4, 1, 32, 16), (16, 3, 128, 512), (3, 300, 40, 512), (2, 5, 17, 33)]:
                gen = torch.Generator().manual_seed(h * m + n)
                x = torch.randn(h, m, k, generator=gen).to(dtype)
                wide = torch.randn(h, n + 7, k, generator=gen).to(dtype)
                w = wide[:, 7:]  # each head a contiguous [n, k] slab, head stride (n + 7) * k
                want = torch.stack([bi._linear(lib, x[i], w[i].contiguous(), None) for i in range(h)])
                for t in (1, 2):
                    torch.set_num_threads(t)
                    assert_same_bits(bi._linear_heads(lib, x, w), want)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="slab"):
        bi._linear_heads(lib, torch.randn(2, 1, 8), torch.randn(2, 8, 4).transpose(1, 2))
    with pytest.raises(ValueError, match=r"\[H, M, K\]"):
        bi._linear_heads(lib, torch.randn(2, 1, 8), torch.randn(3, 4, 8))


@pytest.mark.parametrize("isa", CANONICAL_ISAS[1:])
@pytest.mark.parametrize("dtype", DTYPES)
def test_simd_paths_equal_the_portable_path_bit_for_bit(isa, dtype):
    """AVX2, AVX-512 (FMA) and NEON compute the canonical order exactly: same bits as plain C, for
    the linear (rounded and float32 outputs, with and without bias) and for RMSNorm."""
    lib, portable = lib_for(isa), lib_for("portable")
    for m, k, n in [(1, 1, 1), (2, 15, 3), (5, 16, 17), (3, 31, 5), (7, 33, 19), (4, 100, 37), (9, 576, 64), (2, 1000, 23)]:
        for with_bias in (False, True):
            x, w, b = random_linear(m, k, n, dtype, with_bias, seed=m * k + n)
            assert_same_bits(bi._linear(lib, x, w, b), bi._linear(portable, x, w, b))
            assert_same_bits(bi._linear(lib, x, w, b, torch.float32), bi._linear(portable, x, w, b, torch.float32))
    for h in (1, 15, 16, 17, 576, 1000):
        x, weight = random_norm(5, h, dtype, seed=h)
        assert_same_bits(bi._rms_norm(lib, x, weight, 1e-5), bi._rms_norm(portable, x, weight, 1e-5))


@pytest.mark.parametrize("isa", csrc_build.ISAS)
def test_float32_output_is_the_unrounded_sum(isa):
    """bf16 inputs with out_dtype=float32 (the LM head's logits) give the sums that the bf16 output
    rounds: rounding them to bf16 reproduces the bf16 result bit for bit."""
    lib = lib_for(isa)
    x, w, b = random_linear(6, 576, 300, torch.bfloat16, bias=True, seed=3)
    y32 = bi._linear(lib, x, w, b, torch.float32)
    assert y32.dtype == torch.float32
    assert_same_bits(y32.bfloat16(), bi._linear(lib, x, w, b))
    check_linear_accuracy(y32, x, w, b)
    assert bool((y32 != y32.bfloat16().float()).any())  # really unrounded
    check_row_invariance(lambda t: bi._linear(lib, t, w, b, torch.float32), x)
    with pytest.raises(ValueError, match="out_dtype"):
        bi._linear(lib, x, w, b, torch.float16)


# ---------------------------------------------------------------- RMSNorm


def random_norm(m: int, h: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, h, generator=g) * 2).to(dtype)
    weight = (1 + 0.5 * torch.randn(h, generator=g)).to(dtype)
    return x, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [1, 15, 16, 17, 576, 1000])
def test_rms_norm_matches_torch_module(dtype, h):
    norm = RMSNorm(h, eps=1e-5)
    for m in [0, 1, 3, 17, 130]:
        x, weight = random_norm(m, h, dtype, seed=m)
        norm.weight.data = weight
        ref = norm(x)
        y = bi.bi_rms_norm(x, weight, 1e-5)
        assert y.shape == x.shape and y.dtype == dtype
        # Same value order as torch; only the sum of squares is added up differently, so at most
        # about one output rounding step apart (bf16: two roundings of relative size 2^-9 each).
        tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-6
        err = (y.double() - ref.double()).abs()
        assert bool((err <= tol * ref.double().abs() + 1e-30).all()), err.max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_are_batch_invariant(dtype):
    x, weight = random_norm(130, 576, dtype)
    for m in [1, 2, 3, 7, 33, 130]:
        check_row_invariance(lambda t: bi.bi_rms_norm(t, weight, 1e-6), x[:m])


def test_rms_norm_rejects_bad_inputs():
    x, weight = random_norm(4, 16, torch.float32)
    with pytest.raises(ValueError, match="weight \\[H\\]"):
        bi.bi_rms_norm(x, weight[:15], 1e-6)
    with pytest.raises(ValueError, match="weight \\[H\\]"):
        bi.bi_rms_norm(x[0], weight, 1e-6)
    with pytest.raises(ValueError, match="bfloat16 or both float32"):
        bi.bi_rms_norm(x.half(), weight.half(), 1e-6)
    with pytest.raises(ValueError, match="bfloat16 or both float32"):
        bi.bi_rms_norm(x.bfloat16(), weight, 1e-6)
