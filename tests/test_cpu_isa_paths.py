"""Every instruction-set path of the compiled kernels (csrc_build.ISAS) checked against the others.

A path this CPU cannot run is skipped with the CPU flags it lacks; "portable" (plain C, forced with
-DTM_PORTABLE) runs on every machine. SiLU-and-multiply must give the portable build's bits on every
path; paged decode may differ between paths in the last bits (it is built to allow reassociation) but
each path must be batch-invariant and close to the others. tests/test_attention.py and
tests/test_bf16_nan.py check each path against the torch reference; tests/test_aarch64_kernels.py
runs the NEON path under QEMU.
"""
from __future__ import annotations

import contextlib
import ctypes
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from tokenmill import csrc_build
from tokenmill.attention import cpu_decode
from tokenmill.layers import silu_and_mul_kernel as sk

NAN, INF = float("nan"), float("inf")
# The path a build reports: SiLU has no AVX512-BF16 code, so that build compiles its AVX-512 code.
COMPILED_PATH = {"avx512_bf16": "avx512"}  # kernels without an AVX512_BF16 branch of their own


@contextlib.contextmanager
def bf16_dot_path(lib: ctypes.CDLL, setter: str, on: bool) -> Iterator[bool]:
    """The attention kernels' AVX512_BF16 (VDPBF16PS) path forced on or off in ``lib`` (``setter``:
    paged_decode_set_dp / paged_prefill_set_dp; by default it runs on AMD CPUs only); yields whether bf16
    now takes it (False where the build has none). Back to the automatic choice after."""
    try:
        yield bool(getattr(lib, setter)(int(on)))
    finally:
        getattr(lib, setter)(-1)


def bf16_dot_modes(lib: ctypes.CDLL, setter: str) -> list[bool]:
    """[False, True] where ``lib`` has the AVX512_BF16 attention path, else [False]: the modes to test."""
    with bf16_dot_path(lib, setter, True) as has:
        return [False, True] if has else [False]


def build_for_isa(load: Callable[[str], ctypes.CDLL | None], isa: str) -> ctypes.CDLL:
    """``load(isa)``, skipping the test when this CPU cannot run ``isa`` (naming the missing flags) or
    when no kernel can be built here at all; a failed build of a runnable path fails the test."""
    if not csrc_build.isa_supported(isa):
        pytest.skip(f"the {isa} path cannot run here: needs {', '.join(csrc_build.missing_cpu_flags(isa))}")
    lib = load(isa)
    if lib is None:
        if csrc_build.kernels_disabled() or not csrc_build.c_compiler():
            pytest.skip("no C compiler, or TOKENMILL_DISABLE_CPU_KERNELS=1")
        pytest.fail(f"the {isa} build failed (see the logged compiler output)")
    return lib


@pytest.mark.parametrize("isa", csrc_build.ISAS)
@pytest.mark.parametrize("load, isa_fn", [(sk._load, "silu_and_mul_isa"), (cpu_decode._load, "paged_decode_isa")],
                         ids=["silu_and_mul", "paged_decode"])
def test_build_reports_the_requested_path(load, isa_fn, isa):
    lib = build_for_isa(load, isa)
    own_bf16_branch = isa_fn == "paged_decode_isa"
    assert getattr(lib, isa_fn)().decode() == (isa if own_bf16_branch else COMPILED_PATH.get(isa, isa))


# ---------------------------------------------------------------- SiLU and multiply: bits of the portable path

SILU_SPECIAL = [NAN, -NAN, INF, -INF, 0.0, -0.0, 1.0, -1.5, 2.0, -87.0, -88.7, -88.8, -89.5, -100.0, -3e38, 3e38,
                88.7, 89.5, 86.9, -86.99, -87.01, 1e-45, -1e-45, 1.2e-38, -1.2e-38, 5e-39]


def silu_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """Random rows at several scales (the small ones give subnormal results; 1003 columns leave a tail
    on every vector width), and one row holding every (gate, up) pair of special values."""
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1.0, 10.0, 40.0, 200.0, 1e-19, 1e-38, 1e-42]).unsqueeze(1)
    rand = torch.randn(len(scales), 2 * 1003, generator=g) * scales
    special = torch.tensor(SILU_SPECIAL)
    n = len(special)
    pairs = torch.cat([special.repeat_interleave(n), special.repeat(n)]).unsqueeze(0)
    return [rand.to(dtype), pairs.to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", csrc_build.ISAS)
def test_silu_every_path_gives_the_portable_bits(isa, dtype):
    lib = build_for_isa(sk._load, isa)
    portable = build_for_isa(sk._load, "portable")
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    num_subnormal = 0
    for x in silu_inputs(dtype):
        out = sk._silu_and_mul(lib, x)
        ref = sk._silu_and_mul(portable, x)
        # Bits equal, except that a float32 NaN's sign is not compared: where silu(gate) and up are both
        # NaN, x86 returns one operand's NaN and the compiler may order a commutative multiply either
        # way (bf16 NaN is always the canonical 0x7fc0, so bf16 is compared in full).
        both_nan = out.isnan() & ref.isnan() if dtype == torch.float32 else torch.zeros_like(out, dtype=torch.bool)
        diff = ((out.view(bits) != ref.view(bits)) & ~both_nan).nonzero().tolist()
        assert not diff, f"{len(diff)} elements differ from portable, first at {diff[0]}"
        # and the portable path is torch's SiLU (bf16: silu rounded before the multiply)
        half = x.shape[1] // 2
        silu = F.silu(x[:, :half].float()).to(dtype)
        torch.testing.assert_close(out, silu * x[:, half:], rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-38, equal_nan=True)
        num_subnormal += int(((ref != 0) & (ref.abs() < torch.finfo(dtype).tiny)).sum())
    assert num_subnormal > 0, "the inputs should reach subnormal results"


@pytest.mark.parametrize("isa", csrc_build.ISAS)
def test_silu_row_does_not_depend_on_the_batch(isa):
    lib = build_for_isa(sk._load, isa)
    x = torch.randn(37, 2 * 200, generator=torch.Generator().manual_seed(3)).bfloat16()
    batch = sk._silu_and_mul(lib, x)
    for m in (0, 17, 36):
        assert torch.equal(sk._silu_and_mul(lib, x[m : m + 1]).view(torch.int16), batch[m : m + 1].view(torch.int16))


# ---------------------------------------------------------------- paged decode: invariant per path, paths agree


def decode_inputs(h: int, kvh: int, d: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(h * 100 + d)
    seqs, bs = [1, 7, 16, 45, 130], 16
    nblocks = [-(-n // bs) for n in seqs]
    perm = torch.randperm(sum(nblocks) + 3, generator=g)
    tables, start = [], 0
    for nb in nblocks:
        tables.append(perm[start : start + nb].tolist())
        start += nb
    max_blocks = max(nblocks)
    block_table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    k_cache = torch.randn(len(perm), bs, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(len(perm), bs, kvh, d, generator=g).to(dtype)
    q = torch.randn(len(seqs), h, d, generator=g).to(dtype)
    return q, k_cache, v_cache, block_table, torch.tensor(seqs)


HEADS = [(4, 4, 64), (9, 3, 64), (8, 2, 128), (4, 2, 24), (2, 2, 8), (6, 3, 8), (3, 1, 6)]


@pytest.mark.parametrize("heads", HEADS, ids=[f"h{h}-kv{k}-d{d}" for h, k, d in HEADS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", csrc_build.ISAS)
def test_paged_decode_path_is_batch_invariant_and_agrees_with_portable(isa, dtype, heads):
    lib = build_for_isa(cpu_decode._load, isa)
    portable = build_for_isa(cpu_decode._load, "portable")
    h, kvh, d = heads
    q, k_cache, v_cache, block_table, seq_lens = decode_inputs(h, kvh, d, dtype)
    scale = d**-0.5
    out = cpu_decode._paged_decode(lib, q, k_cache, v_cache, block_table, seq_lens, scale)
    for s in range(len(seq_lens)):  # alone, a sequence gives the bits it had in the batch
        alone = cpu_decode._paged_decode(lib, q[s : s + 1], k_cache, v_cache, block_table[s : s + 1],
                                         seq_lens[s : s + 1], scale)
        assert torch.equal(alone, out[s : s + 1]), f"sequence {s} differs when run alone"
    ref = cpu_decode._paged_decode(portable, q, k_cache, v_cache, block_table, seq_lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_loading_the_decode_kernel_keeps_subnormals():
    """No build may switch on flush-to-zero for the process (as gcc's crtfastmath.o does for
    -ffast-math libraries): torch's own arithmetic would change once the kernel is loaded."""
    code = (
        "import torch\n"
        "from tokenmill import csrc_build\n"
        "from tokenmill.attention import cpu_decode\n"
        "from tokenmill.layers import silu_and_mul_kernel as sk\n"
        "built = [f(isa) is not None for isa in csrc_build.supported_isas() for f in (cpu_decode._load, sk._load)]\n"
        "print(all(built), (torch.tensor([1e-39]) * 0.5).item())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    built, value = result.stdout.split()
    if built != "True":
        pytest.skip("the kernels could not be built here")
    assert float(value) == pytest.approx(5e-40, rel=1e-3)
