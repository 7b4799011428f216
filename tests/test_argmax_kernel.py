"""Greedy sampling's C argmax (tokenmill/sampling/csrc/argmax.c) gives torch.argmax's answer on every
ISA path this CPU runs: first index on ties (inside a vector, across lanes, in the tail), first NaN,
+-inf, all -inf rows, strided rows, any thread count; and the sampler's greedy tokens come from it."""
from __future__ import annotations

import pytest
import torch

from tests.test_cpu_isa_paths import build_for_isa
from tokenmill import csrc_build
from tokenmill.sampling import argmax_kernel
from tokenmill.sampling.argmax_kernel import argmax_rows

pytestmark = pytest.mark.skipif(csrc_build.kernels_disabled() or csrc_build.c_compiler() is None,
                                reason="no C compiler, or TOKENMILL_DISABLE_CPU_KERNELS=1")

NAN, INF = float("nan"), float("inf")


def argmax_cases() -> list[tuple[str, torch.Tensor]]:
    """(name, [B, V] float32 logits) covering the kernel's branches."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for batch, vocab in [(1, 1), (1, 5), (3, 8), (2, 15), (2, 16), (3, 17), (5, 31), (4, 33), (7, 1000),
                         (64, 49152), (1, 49152)]:
        cases.append((f"random {batch}x{vocab}", torch.randn(batch, vocab, generator=g)))
    # ties: the same maximum in several lanes, in the same lane of later vectors, and in the tail
    x = torch.zeros(6, 53)
    x[0, [3, 20, 40]] = 5.0     # different lanes, later vectors
    x[1, [19, 3]] = 5.0         # the later vector's lane is lower than the first one's
    x[2, [16, 32, 48]] = 5.0    # the same lane in every vector
    x[3, [50, 52]] = 5.0        # both in the tail
    x[4, [7, 51]] = 5.0         # a vector's maximum tied by the tail
    x[5] = 1.0                  # the whole row ties
    cases.append(("ties", x))
    # NaN first / in the middle / in the tail / several; inf; all -inf; -0.0 vs 0.0
    y = torch.randn(8, 45, generator=g)
    y[0, 0] = NAN
    y[1, 20] = NAN
    y[1, 30] = NAN
    y[2, 44] = NAN
    y[3, 5] = INF
    y[3, 40] = INF
    y[4] = -INF
    y[5, 10] = INF
    y[5, 12] = NAN
    y[6] = 0.0
    y[6, 0] = -0.0
    y[7, :] = -INF
    y[7, 43] = -1e30
    cases.append(("nan inf", y))
    wide = torch.randn(9, 700, generator=g)
    cases.append(("strided rows", wide[:, 50:650]))  # row stride 700, 600 columns
    return cases


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_rows_is_torch_argmax_on_every_path(isa, threads):
    lib = build_for_isa(argmax_kernel.library.load, isa)
    assert lib.argmax_isa().decode() == isa
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, logits in argmax_cases():
            got = argmax_kernel._argmax_rows(lib, logits)
            assert got.dtype == torch.int64
            assert torch.equal(got, logits.argmax(dim=-1)), name
    finally:
        torch.set_num_threads(previous)


def test_argmax_rows_falls_back_to_torch_for_other_inputs():
    x = torch.randn(4, 100)
    for other in (x.bfloat16(), x.t(), torch.randn(100)):
        assert torch.equal(argmax_rows(other), other.argmax(dim=-1))
    with pytest.raises(IndexError):  # torch's error for an empty vocabulary
        argmax_rows(x[:, :0])


def test_greedy_sampler_tokens_are_torch_argmax():
    from tokenmill.sampling.metadata import SamplingMetadata, SamplingRow
    from tokenmill.sampling.sampler import Sampler
    from tokenmill.sampling_params import SamplingParams

    vocab = 1000
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1))
    logits[2, [10, 900]] = 50.0  # a tie: the first wins
    rows = [SamplingRow(params=SamplingParams(temperature=0.0).with_defaults({}), prompt_token_ids=[1], output_token_ids=[],
                        seed=None, stop_token_ids=set(), min_tokens_exempt=False)
            for _ in range(5)]
    expected = logits.argmax(dim=-1)
    out = Sampler(vocab)(logits.clone(), SamplingMetadata.build(rows, vocab, device=torch.device("cpu")))
    assert torch.equal(out.sampled_token_ids, expected)
    assert out.sampled_token_ids[2].item() == 10
