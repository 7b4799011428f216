"""NaN and infinity through the compiled bf16 kernels (tokenmill/csrc/bf16.h).

Each kernel must give NaN exactly where the torch reference does, and every NaN it writes must be
the canonical quiet NaN 0x7fc0, as c10's round_to_nearest_even writes it. torch's own bf16 NaN bits
are not checked: its vectorised float -> bf16 conversion writes 0xffff.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_cpu_isa_paths import bf16_dot_modes, bf16_dot_path, build_for_isa
from tokenmill.attention import cpu_decode
from tokenmill.csrc_build import ISAS
from tokenmill.layers import batch_invariant as bi
from tokenmill.layers import silu_and_mul_kernel as sk
from tokenmill.layers.layernorm import RMSNorm

NAN, INF = float("nan"), float("inf")
CANONICAL_NAN = 0x7FC0


def assert_nan_like(out: torch.Tensor, ref: torch.Tensor) -> None:
    """NaN exactly where ref has NaN (and the same infinities), every NaN written as 0x7fc0."""
    assert out.shape == ref.shape and out.dtype == ref.dtype == torch.bfloat16
    assert bool(ref.isnan().any()), "the inputs should produce at least one NaN"
    assert torch.equal(out.isnan(), ref.isnan()), f"NaN at {out.isnan().nonzero().tolist()}, want {ref.isnan().nonzero().tolist()}"
    assert torch.equal(out.isposinf(), ref.isposinf()) and torch.equal(out.isneginf(), ref.isneginf())
    nan_bits = set(out[out.isnan()].view(torch.int16).tolist())
    assert nan_bits == {CANONICAL_NAN}, f"NaN bits {[hex(b & 0xFFFF) for b in nan_bits]}"


# ---------------------------------------------------------------- SiLU and multiply


def silu_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    # silu(-inf) is NaN in torch (-inf / inf); the kernel gives the same below its exp clamp.
    gate = torch.tensor([NAN, -NAN, INF, 1.0, 0.0, 2.0, NAN, 3.0, -1.5, -INF] * 2, dtype=torch.bfloat16)
    up = torch.tensor([1.0, 1.0, 0.0, INF, INF, -INF, -NAN, NAN, 2.0, 1.0] * 2, dtype=torch.bfloat16)
    return gate, up


@pytest.mark.parametrize("isa", ISAS)
def test_silu_and_mul_nan(isa):
    lib = build_for_isa(sk._load, isa)
    gate, up = silu_inputs()  # 20 columns: a full vector step and a tail on every vector width
    x = torch.stack([torch.cat([gate, up]), torch.cat([gate.flip(0), up.flip(0)])])
    ref = torch.stack([F.silu(gate) * up, F.silu(gate.flip(0)) * up.flip(0)])
    assert_nan_like(sk._silu_and_mul(lib, x), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("isa", ISAS)
def test_silu_and_mul_matches_torch_for_very_negative_gates(isa, dtype):
    """Where torch's exp(-g) overflows (g < -88.7) silu is -0; the kernel's clamped exp must not leave
    g / 1.6e38 there (which for g = -3e38 would be -2)."""
    lib = build_for_isa(sk._load, isa)
    gate = torch.tensor([-3e38, -1e33, -1e10, -100.0, -88.5, -87.5, -50.0, -10.0] * 2, dtype=dtype)
    up = torch.ones_like(gate)
    out = sk._silu_and_mul(lib, torch.cat([gate, up]).unsqueeze(0))[0]
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=2e-2, atol=1e-38)
    assert bool((out[:4] == 0).all())


# ---------------------------------------------------------------- batch-invariant linear and RMSNorm


def linear_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g).bfloat16()
    w = (torch.randn(20, 64, generator=g) / 8).bfloat16()  # N = 20: a full and a partial column tile
    b = torch.randn(20, generator=g).bfloat16()
    x[0, 3], x[1, 5], x[2, 7], x[3, 1] = NAN, -NAN, INF, -INF
    w[4, 3], w[5, 9] = INF, NAN
    b[7], b[8], b[9] = NAN, INF, -INF
    return x, w, b


def rms_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 48, generator=g).bfloat16()
    w = (1 + 0.5 * torch.randn(48, generator=g)).bfloat16()
    x[0, 2], x[1, 3], x[2, 4], x[3, 5] = NAN, INF, -INF, -NAN
    w[10], w[11] = NAN, INF
    return x, w


def check_batch_invariant(lib) -> None:
    x, w, b = linear_inputs()
    for bias in (None, b):
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float()).bfloat16()
        assert_nan_like(bi._linear(lib, x, w, bias), ref)
    x, w = rms_inputs()
    norm = RMSNorm(48, eps=1e-6).to(torch.bfloat16)
    norm.weight.data = w.clone()
    assert_nan_like(bi._rms_norm(lib, x, w, 1e-6), norm(x))


@pytest.mark.skipif(not bi.available(), reason="batch-invariant CPU kernels unavailable (no C compiler?)")
def test_batch_invariant_nan():
    check_batch_invariant(bi._built())


@pytest.mark.skipif(not bi.available(), reason="batch-invariant CPU kernels unavailable (no C compiler?)")
def test_batch_invariant_portable_build_nan():
    """The plain-C build (TM_PORTABLE), which every machine can run."""
    lib = bi._load("portable")
    assert lib is not None and lib.bi_isa().decode() == "portable"
    check_batch_invariant(lib)


# ---------------------------------------------------------------- paged decode attention


@pytest.mark.parametrize("d", [64, 24, 8])  # SIMD on every path / on AVX2 and NEON / on NEON: else plain C
@pytest.mark.parametrize("isa", ISAS)
def test_paged_decode_nan(isa, d):
    lib = build_for_isa(cpu_decode._load, isa)
    h, kvh, bs, seqs = 4, 2, 4, [5, 8, 3]
    g = torch.Generator().manual_seed(0)
    nblocks = [-(-n // bs) for n in seqs]
    tables = [list(range(sum(nblocks[:i]), sum(nblocks[: i + 1]))) for i in range(len(seqs))]
    # Every cache slot belongs to a sequence: a NaN left in padding would poison torch's reference.
    k_cache = torch.randn(sum(nblocks), bs, kvh, d, generator=g).bfloat16()
    v_cache = torch.randn(sum(nblocks), bs, kvh, d, generator=g).bfloat16()
    q = torch.randn(len(seqs), h, d, generator=g).bfloat16()

    def at(s: int, t: int) -> tuple[int, int]:
        return tables[s][t // bs], t % bs

    q[0, 0, 1] = NAN  # sequence 0: NaN query, head 0
    k_cache[at(1, 2)][0, 7] = -NAN  # sequence 1: NaN key, kv head 0
    v_cache[at(2, 1)][1, 3] = NAN  # sequence 2: NaN value, kv head 1
    v_cache[at(2, 0)][0, 5] = INF  # +inf value
    v_cache[at(2, 2)][0, 6], v_cache[at(2, 1)][0, 6] = INF, -INF  # inf - inf: NaN

    max_blocks = max(nblocks)
    block_table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    outs = []
    for dot in bf16_dot_modes(lib, "paged_decode_set_dp"):  # the AVX512_BF16 build: float FMAs and VDPBF16PS
        with bf16_dot_path(lib, "paged_decode_set_dp", dot):
            outs.append(cpu_decode._paged_decode(lib, q, k_cache, v_cache, block_table, torch.tensor(seqs), d**-0.5))

    refs = []
    for s, n in enumerate(seqs):
        k = torch.cat([k_cache[b] for b in tables[s]])[:n].float().repeat_interleave(h // kvh, dim=1)
        v = torch.cat([v_cache[b] for b in tables[s]])[:n].float().repeat_interleave(h // kvh, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[s].float(), k) * d**-0.5
        refs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v).bfloat16())
    for out in outs:
        assert_nan_like(out, torch.stack(refs))
