"""The kernels' AVX-512 branches, run on a CPU without AVX-512 through SIMDe (tests/csrc/simde_shim).

Each kernel source is compiled as its loader compiles it, except that the AVX-512 path's -mavx512*
flags become the __AVX512*__ macros the source's macro ladder tests, and tests/csrc/simde_shim comes
first on the include path: its immintrin.h serves every _mm512_* intrinsic from SIMDe (portable C over
native AVX2/FMA), so the build holds no AVX-512 instruction and reports the AVX-512 path. Then:
batch_invariant avx512 (FMA) and SiLU x up give the portable build's bits (NaN, inf, very negative
gates included); the avx512_bf16 GEMM (vdpbf16ps, whose rounding SIMDe does not reproduce) is checked
for accuracy against float64 and for row invariance only; paged decode (both AVX-512 builds, the
avx512_bf16 one forced onto its VDPBF16PS path) is within the decode tests' tolerance of the torch
reference and batch-invariant, and paged prefill's VDPBF16PS path within the prefill tests' tolerance. A passing kernel is listed under its path,
marked "(SIMDe)", in the session's ISA report. Skipped without SIMDe (Debian: libsimde-dev).
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_batch_invariant_kernels import (
    assert_same_bits,
    bits,
    check_linear_accuracy,
    check_row_invariance,
    random_linear,
)
from tests.test_bf16_nan import assert_nan_like, check_batch_invariant
from tests.test_bf16_nan import silu_inputs as silu_nan_inputs
from tests.test_cpu_isa_paths import decode_inputs
from tests.test_cpu_isa_paths import silu_inputs as silu_random_inputs
from tokenmill import csrc_build
from tokenmill.attention import build_attention_metadata, cpu_decode, cpu_prefill
from tokenmill.attention.torch_paged import reference_decode_attention
from tokenmill.layers import batch_invariant as bi
from tokenmill.layers import silu_and_mul_kernel as sk
from tokenmill.sampling import argmax_kernel

SIMDE_INCLUDE = Path("/usr/include/simde")
SHIM_DIR = Path(__file__).parent / "csrc" / "simde_shim"
COMPILER = csrc_build.c_compiler()

# stem -> (loader module, the function reporting the build's path)
KERNELS = {"batch_invariant": (bi, "bi_isa"), "silu_and_mul": (sk, "silu_and_mul_isa"),
           "paged_decode": (cpu_decode, "paged_decode_isa"), "paged_prefill": (cpu_prefill, "paged_prefill_isa"),
           "argmax": (argmax_kernel, "argmax_isa")}
BUILDS = [("batch_invariant", "avx512"), ("batch_invariant", "avx512_bf16"), ("silu_and_mul", "avx512"),
          ("paged_decode", "avx512"), ("paged_decode", "avx512_bf16"), ("paged_prefill", "avx512_bf16"),
          ("argmax", "avx512")]
# -O1: at -O3 gcc spends about 5x longer on the inlined emulation (25 s of CPU for the four builds). The
# level changes no result bit of a kernel built without reassociation (all but paged decode, which is
# checked to a tolerance). -Wno-psabi: SIMDe passes __m512 by value, which gcc notes without -mavx512f.
EXTRA_FLAGS = ("-O1", "-Wno-psabi")
# Registers only an AVX-512 (EVEX) instruction can name, in objdump's AT&T syntax.
AVX512_REGISTER = re.compile(r"%(zmm\d+|[xy]mm(1[6-9]|2\d|3[01])|k[0-7])\b")

pytestmark = [
    pytest.mark.skipif(not SIMDE_INCLUDE.is_dir(),
                       reason=f"SIMDe is not installed ({SIMDE_INCLUDE} missing; apt-get install libsimde-dev)"),
    pytest.mark.skipif(not csrc_build.isa_supported("avx2"),
                       reason="the emulated builds run their AVX2/FMA/F16C code natively: needs "
                              + ", ".join(csrc_build.missing_cpu_flags("avx2"))),
    pytest.mark.skipif(COMPILER is None or csrc_build.kernels_disabled(),
                       reason="no C compiler, or TOKENMILL_DISABLE_CPU_KERNELS=1"),
]


def emulated_flags(isa: str) -> list[str]:
    """The path's compiler flags with each -mavx512* replaced by the macro it defines (-mavx512bf16 ->
    -D__AVX512BF16__), so the source takes the AVX-512 branch while the compiler emits none."""
    return [f"-D__{flag[2:].upper()}__" if flag.startswith("-mavx512") else flag for flag in csrc_build.ISA_FLAGS[isa]]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> dict[tuple[str, str], tuple[ctypes.CDLL, Path]]:
    """Every (stem, isa) of BUILDS compiled against SIMDe (concurrently) and loaded: {key: (lib, path)}."""
    out_dir = tmp_path_factory.mktemp("simde")
    jobs = {}
    for stem, isa in BUILDS:
        module, _ = KERNELS[stem]
        target = out_dir / f"{stem}-{isa}.so"
        cmd = [COMPILER, *module._FLAGS, *emulated_flags(isa), *EXTRA_FLAGS, "-I", str(SHIM_DIR),
               "-I", str(csrc_build.SHARED_INCLUDE_DIR), str(module._SOURCE), "-o", str(target), "-lm"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        jobs[stem, isa] = (target, cmd, proc)
    libs = {}
    for key, (target, cmd, proc) in jobs.items():
        output, _ = proc.communicate()
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{output}"
        lib = ctypes.CDLL(str(target))
        KERNELS[key[0]][0]._setup(lib)
        libs[key] = (lib, target)
    return libs


def build(emulated, stem: str, isa: str) -> ctypes.CDLL:
    """The emulated build, recorded in the session's ISA report."""
    csrc_build.loaded_kernels.add((f"{stem} (SIMDe)", isa))
    return emulated[stem, isa][0]


def portable(load: Callable[[str], ctypes.CDLL | None]) -> ctypes.CDLL:
    lib = load("portable")
    assert lib is not None, "the portable build failed (see the logged compiler output)"
    return lib


@pytest.mark.parametrize("stem, isa", BUILDS, ids=[f"{s}-{i}" for s, i in BUILDS])
def test_emulated_build_takes_the_avx512_branch_without_avx512_instructions(emulated, stem, isa):
    lib, path = emulated[stem, isa]
    assert getattr(lib, KERNELS[stem][1])().decode() == isa
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump not found: the build's instructions cannot be listed")
    listing = subprocess.run([objdump, "-d", str(path)], capture_output=True, text=True, check=True).stdout
    # paged prefill's generic vectors contract a * b + c only above -O1 (it is checked to a tolerance); argmax has no product
    if stem not in ("paged_prefill", "argmax"):
        assert "vfmadd" in listing  # native FMA: SIMDe's own fmadd would round twice
    hits = [line.strip() for line in listing.splitlines() if AVX512_REGISTER.search(line)]
    assert not hits, f"{len(hits)} AVX-512 instructions, first: {hits[0]}"


# ---------------------------------------------------------------- batch-invariant linear and RMSNorm

# (K, N): K off the 16 (float32, bf16 on FMA) and 32 (vdpbf16ps) steps, N off the 4/8/16 column tiles.
KNS = [(1, 1), (31, 5), (33, 19), (100, 37), (576, 24)]
# Every row tile (4, 2, 1 rows left) and, with K = 576, more than one row chunk at 130.
MS = [1, 2, 3, 5, 6, 7, 9, 17, 130]


@pytest.mark.parametrize("dtype, out_dtype", [(torch.bfloat16, None), (torch.bfloat16, torch.float32),
                                              (torch.float32, None)], ids=["bf16", "bf16-f32out", "f32"])
def test_avx512_linear_gives_the_portable_bits(emulated, dtype, out_dtype):
    lib, ref = build(emulated, "batch_invariant", "avx512"), portable(bi._load)
    for k, n in KNS:
        for with_bias in (False, True):
            x, w, b = random_linear(max(MS), k, n, dtype, with_bias, seed=k + n)
            for m in MS:
                got = bi._linear(lib, x[:m], w, b, out_dtype)
                want = bi._linear(ref, x[:m], w, b, out_dtype)
                diff = (bits(got) != bits(want)).nonzero().tolist()
                first = tuple(diff[0]) if diff else ()
                assert not diff, (f"M={m} K={k} N={n} bias={with_bias}: {len(diff)} outputs differ, first at "
                                  f"{first}: {got[first].item()!r}, portable {want[first].item()!r}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_avx512_rms_norm_gives_the_portable_bits(emulated, dtype):
    lib, ref = build(emulated, "batch_invariant", "avx512"), portable(bi._load)
    g = torch.Generator().manual_seed(0)
    for h in (1, 15, 16, 17, 100, 576):
        x = (torch.randn(9, h, generator=g) * torch.logspace(-3, 3, 9).unsqueeze(1)).to(dtype)
        w = (1 + 0.5 * torch.randn(h, generator=g)).to(dtype)
        assert_same_bits(bi._rms_norm(lib, x, w, 1e-6), bi._rms_norm(ref, x, w, 1e-6))


@pytest.mark.parametrize("isa", ["avx512", "avx512_bf16"])
def test_emulated_linear_and_rms_norm_propagate_nan_and_inf(emulated, isa):
    check_batch_invariant(build(emulated, "batch_invariant", isa))


@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["bf16", "f32out"])
def test_avx512_bf16_linear_is_accurate_and_row_invariant(emulated, out_dtype):
    """vdpbf16ps as SIMDe computes it (products in float32, added one at a time): accurate and invariant,
    not bit-equal to anything."""
    lib = build(emulated, "batch_invariant", "avx512_bf16")
    for k, n in KNS:
        for with_bias in (False, True):
            x, w, b = random_linear(max(MS), k, n, torch.bfloat16, with_bias, seed=k * n)
            full = bi._linear(lib, x, w, b, out_dtype)
            check_linear_accuracy(full, x, w, b)
            for m in MS:  # the first m rows alone: the same bits
                assert_same_bits(bi._linear(lib, x[:m], w, b, out_dtype), full[:m])
    x, w, b = random_linear(17, 100, 37, torch.bfloat16, bias=True, seed=5)
    check_row_invariance(lambda t: bi._linear(lib, t, w, b, out_dtype), x)


# ---------------------------------------------------------------- SiLU and multiply


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_avx512_silu_gives_the_portable_bits(emulated, dtype):
    """Random rows down to subnormal results, every (gate, up) pair of tests/test_cpu_isa_paths.py's special
    values (NaN, inf, gates past exp's overflow), and rows that end in a masked tail."""
    lib, ref = build(emulated, "silu_and_mul", "avx512"), portable(sk._load)
    for x in silu_random_inputs(dtype):
        got, want = sk._silu_and_mul(lib, x), sk._silu_and_mul(ref, x)
        differ = bits(got) != bits(want)
        if dtype == torch.float32:
            # silu(gate) * up with both operands NaN: x86 returns the first operand's NaN, and the compiler
            # may swap a multiply's operands (it does in this build's upper 256-bit half): the sign may differ.
            both_nan = got.isnan() & want.isnan() & x[:, x.shape[1] // 2 :].isnan()
            differ &= ~both_nan
        diff = differ.nonzero().tolist()
        row, col = diff[0] if diff else (0, 0)
        assert not diff, (f"{len(diff)} elements differ from portable, first at {(row, col)}: gate "
                          f"{x[row, col].item()!r} up {x[row, x.shape[1] // 2 + col].item()!r} gives "
                          f"{got[row, col].item()!r}, portable {want[row, col].item()!r}")


def test_avx512_silu_nan_and_very_negative_gates(emulated):
    lib, ref = build(emulated, "silu_and_mul", "avx512"), portable(sk._load)
    gate, up = silu_nan_inputs()
    x = torch.stack([torch.cat([gate, up]), torch.cat([gate.flip(0), up.flip(0)])])
    out = sk._silu_and_mul(lib, x)
    assert_nan_like(out, torch.stack([F.silu(gate) * up, F.silu(gate.flip(0)) * up.flip(0)]))
    assert torch.equal(out.view(torch.int16), sk._silu_and_mul(ref, x).view(torch.int16))
    for dtype in (torch.bfloat16, torch.float32):
        gate = torch.tensor([-3e38, -1e33, -1e10, -100.0, -88.5, -87.5, -50.0, -10.0] * 2, dtype=dtype)
        out = sk._silu_and_mul(lib, torch.cat([gate, torch.ones_like(gate)]).unsqueeze(0))[0]
        torch.testing.assert_close(out, F.silu(gate), rtol=2e-2, atol=1e-38)
        assert bool((out[:4] == 0).all())


# ---------------------------------------------------------------- paged decode attention

# (heads, kv heads, head_dim): 64 and 128 specialised, 32 and 48 the general 16-lane loop, 24 and 8 the
# plain C loops of the same build; GQA and not.
HEADS = [(4, 4, 64), (9, 3, 64), (8, 2, 128), (6, 1, 32), (4, 2, 48), (4, 2, 24), (2, 2, 8), (6, 3, 8)]


def reference(q, k_cache, v_cache, block_table, seq_lens, scale) -> torch.Tensor:
    block_size = k_cache.shape[1]
    meta, _ = build_attention_metadata(np.ones(len(seq_lens)), seq_lens.numpy() - 1, block_table.numpy(), block_size)
    return reference_decode_attention(q, k_cache, v_cache, meta, scale)


@pytest.mark.parametrize("heads", HEADS, ids=[f"h{h}-kv{k}-d{d}" for h, k, d in HEADS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("isa", ["avx512", "avx512_bf16"])
def test_avx512_paged_decode_matches_reference_and_is_batch_invariant(emulated, isa, dtype, heads):
    """avx512_bf16 takes the VDPBF16PS path for bf16 caches (head_dim a multiple of 32)."""
    lib = build(emulated, "paged_decode", isa)
    assert lib.paged_decode_set_dp(1) == (isa == "avx512_bf16")  # the VDPBF16PS path whatever the CPU's vendor
    h, kvh, d = heads
    q, k_cache, v_cache, block_table, seq_lens = decode_inputs(h, kvh, d, dtype)  # lengths 1 .. 130
    out = cpu_decode._paged_decode(lib, q, k_cache, v_cache, block_table, seq_lens, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref = reference(q, k_cache, v_cache, block_table, seq_lens, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    for s in (0, 2, 4):
        alone = cpu_decode._paged_decode(lib, q[s : s + 1], k_cache, v_cache, block_table[s : s + 1],
                                         seq_lens[s : s + 1], d**-0.5)
        assert torch.equal(alone, out[s : s + 1]), f"sequence {s} differs when run alone"


@pytest.mark.parametrize("isa", ["avx512", "avx512_bf16"])
def test_avx512_paged_decode_propagates_nan(emulated, isa):
    lib = build(emulated, "paged_decode", isa)
    lib.paged_decode_set_dp(1)  # the VDPBF16PS path whatever the CPU's vendor
    q, k_cache, v_cache, block_table, seq_lens = decode_inputs(4, 2, 64, torch.bfloat16)  # lengths 1, 7, 16, 45, 130
    bs = k_cache.shape[1]
    q[0, 1, 3] = float("nan")  # sequence 0, query head 1
    k_cache[block_table[1, 3 // bs], 3 % bs, 0, 7] = -float("nan")  # sequence 1, a key of kv head 0
    # sequence 3, a value of kv head 1, in a block no table pads with: torch's reference multiplies the
    # padding's values by 0, which a NaN there would poison
    assert block_table[3, 40 // bs] != 0
    v_cache[block_table[3, 40 // bs], 40 % bs, 1, 5] = float("nan")
    out = cpu_decode._paged_decode(lib, q, k_cache, v_cache, block_table, seq_lens, 0.125)
    assert_nan_like(out, reference(q, k_cache, v_cache, block_table, seq_lens, 0.125))


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 2, 128)], ids=["h9-kv3-d64", "h4-kv4-d32", "h8-kv2-d128"])
def test_avx512_bf16_paged_prefill_matches_the_dense_reference(emulated, heads):
    """The prefill kernel's VDPBF16PS path (bf16, head_dim a multiple of 32) on a CPU without AVX-512:
    fresh prompts, a chunk after a cached prefix and decode rows in one batch, within the bf16 tolerance of
    the dense float64 reference."""
    from tests.test_attention import dense_reference
    from tests.test_prefill_attention import spans_batch

    lib = build(emulated, "paged_prefill", "avx512_bf16")
    assert lib.paged_prefill_set_dp(1) == 1  # the VDPBF16PS path whatever the CPU's vendor
    h, kvh, d = heads
    q, k_cache, v_cache, meta, keys, values, query_lens = spans_batch(torch.bfloat16, h, kvh, d, 16, seed=d + h)
    out = torch.zeros_like(q)
    cpu_prefill._paged_prefill(lib, q, k_cache, v_cache, meta, d**-0.5, out)
    start = 0
    for i, n in enumerate(query_lens):
        if n > 1:
            ref = dense_reference(q[start:start + n], keys[i], values[i], d**-0.5)
            torch.testing.assert_close(out[start:start + n].double(), ref, atol=2e-2, rtol=2e-2)
        start += n


# ---------------------------------------------------------------- greedy argmax


def test_avx512_argmax_gives_torch_argmax(emulated):
    from tests.test_argmax_kernel import argmax_cases

    lib = build(emulated, "argmax", "avx512")
    for name, logits in argmax_cases():
        assert torch.equal(argmax_kernel._argmax_rows(lib, logits), logits.argmax(dim=-1)), name
