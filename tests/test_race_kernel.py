"""Random sampling's C race (tokenmill/sampling/csrc/race.c): on every ISA path and thread count its token is
``argmax(probs / noise)`` of its own noise (so skipping the tokens that cannot win changes nothing), the
noise is Exp(1) and independent across seeds, draws follow the probabilities, and the sampler uses it."""
from __future__ import annotations

import math

import pytest
import torch

from tests.test_cpu_isa_paths import build_for_isa
from tokenmill import csrc_build
from tokenmill.sampling import race_kernel
from tokenmill.sampling.metadata import position_seed
from tokenmill.sampling.sampler import exponential_race, race_noise_torch

pytestmark = pytest.mark.skipif(csrc_build.kernels_disabled() or csrc_build.c_compiler() is None,
                                reason="no C compiler, or TOKENMILL_DISABLE_CPU_KERNELS=1")

NAN = float("nan")


def signed(seed: int) -> int:
    return seed - 2**64 if seed >= 2**63 else seed


def race_cases() -> list[tuple[str, torch.Tensor]]:
    """(name, [B, V] float32 probabilities) covering the kernel's branches."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for batch, vocab, temperature in [(1, 1, 1.0), (3, 5, 1.0), (4, 255, 0.5), (4, 256, 2.0), (4, 257, 1.0),
                                      (7, 1000, 0.3), (64, 49152, 0.7), (2, 49152, 5.0)]:
        cases.append((f"{batch}x{vocab} t={temperature}",
                      (torch.randn(batch, vocab, generator=g) * 3 / temperature).softmax(-1)))
    p = torch.rand(6, 600, generator=g)
    p[0, :300] = 0.0            # the first blocks all zero
    p[1, 1:] = 0.0              # one token holds all the mass
    p[2, :599] = 0.0            # ... the last one
    p[3, ::7] = 0.0             # filtered tokens scattered
    p[4, 100] = 1e6             # peaked
    p[5] = 1.0                  # uniform: every token ties in probability
    cases.append(("zeros and peaks", p / p.sum(-1, keepdim=True)))
    q = torch.rand(4, 300, generator=g)
    q[0, 0] = NAN               # NaN first, in a later block, several
    q[1, 280] = NAN
    q[2, 3] = NAN
    q[2, 200] = NAN
    cases.append(("nan", q))
    wide = torch.rand(5, 900, generator=g)
    cases.append(("strided rows", wide[:, 100:800] / wide[:, 100:800].sum(-1, keepdim=True)))
    return cases


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_race_is_argmax_of_probs_over_its_noise_on_every_path(isa, threads):
    lib = build_for_isa(race_kernel.library.load, isa)
    assert lib.race_isa().decode() == isa
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, probs in race_cases():
            seeds = [position_seed(11, 7 * row + len(name)) for row in range(probs.shape[0])]
            got = race_kernel._race_rows(lib, probs, torch.tensor([signed(s) for s in seeds]))
            noise = torch.stack([race_kernel.race_noise(s, probs.shape[1], lib) for s in seeds])
            assert torch.equal(got, (probs / noise).argmax(dim=-1)), name
            reference = build_for_isa(race_kernel.library.load, "portable")
            assert torch.equal(got, race_kernel._race_rows(reference, probs, torch.tensor([signed(s) for s in seeds])))
    finally:
        torch.set_num_threads(previous)


def test_the_noise_is_exp1_positive_finite_and_independent_across_seeds():
    n = 200_000
    noise = race_kernel.race_noise(position_seed(3, 0), n).double()
    assert bool((noise > 0).all()) and bool(noise.isfinite().all())
    assert abs(noise.mean().item() - 1.0) < 0.01 and abs(noise.var().item() - 1.0) < 0.02
    # Kolmogorov-Smirnov distance to Exp(1): below 1.95 / sqrt(n) (p > 0.001)
    x = noise.sort().values
    cdf = 1.0 - torch.exp(-x)
    ranks = torch.arange(1, n + 1, dtype=torch.float64) / n
    distance = torch.maximum(ranks - cdf, cdf - (ranks - 1.0 / n)).max().item()
    assert distance < 1.95 / math.sqrt(n), distance
    # neighbouring seeds (consecutive unseeded rows, consecutive positions) give uncorrelated noise
    for a, b in ((position_seed(3, 0), position_seed(3, 1)), (position_seed(5, 9), position_seed(6, 9)), (0, 1)):
        u, v = race_kernel.race_noise(a, n).double(), race_kernel.race_noise(b, n).double()
        assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1].item()) < 0.01


def test_draws_follow_the_probabilities():
    """200k rows, each its own seed (consecutive positions of one request): counts fit the probabilities
    (chi-square below its 0.9999 quantile), and a token of probability 1e-6 comes up about as often as
    it should."""
    g = torch.Generator().manual_seed(1)
    vocab, n = 12, 200_000
    p = torch.rand(vocab, generator=g) ** 2
    p /= p.sum()
    seeds = torch.tensor([signed(position_seed(42, k)) for k in range(n)])
    counts = torch.bincount(race_kernel.race_rows(p.repeat(n, 1), seeds), minlength=vocab).double()
    expected = p.double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 35.6, (chi2, counts.tolist())  # chi-square, 11 degrees of freedom, 0.9999 quantile
    rare = torch.full((300,), 1e-6)
    rare[7] = 1.0 - 1e-6 * 299
    drawn = race_kernel.race_rows(rare.repeat(n, 1), seeds)
    others = int((drawn != 7).sum())  # expected 59.8, Poisson
    assert 30 <= others <= 95, others


def test_the_sampler_races_in_c_with_the_rows_seeds_and_torch_draws_the_same_noise():
    """exponential_race on a CPU takes the kernel: a seeded row draws race_rows under its position seed, an
    unseeded batch under seeds from the global RNG (torch.manual_seed repeats it). Without the kernel (CUDA,
    no compiler) race_noise_torch computes the same noise, so a seeded request draws the same tokens on
    workers of either kind (the router resumes streams across workers)."""
    g = torch.Generator().manual_seed(2)
    probs = (torch.randn(3, 5000, generator=g) * 4).softmax(-1)
    seeds = {1: position_seed(99, 17)}
    got = exponential_race(probs.clone(), seeds)
    noise = race_kernel.race_noise(seeds[1], 5000)
    assert int(got[1]) == int((probs[1] / noise).argmax())
    torch.manual_seed(5)
    first = exponential_race(probs.clone(), {})
    torch.manual_seed(5)
    assert torch.equal(exponential_race(probs.clone(), {}), first)

    row_seeds = [position_seed(7, k) for k in range(40)] + [0, 2**32, 2**64 - 1]
    signed_seeds = torch.tensor([signed(s) for s in row_seeds])
    by_torch = race_noise_torch(signed_seeds, 3000, torch.device("cpu"))
    by_c = torch.stack([race_kernel.race_noise(s, 3000) for s in row_seeds])
    assert torch.equal(by_torch, by_c)
    rows = (torch.randn(len(row_seeds), 3000, generator=g) * 3).softmax(-1)
    assert torch.equal(race_kernel.race_rows(rows, signed_seeds), (rows / by_torch).argmax(dim=-1))
