"""Benchmark metric arithmetic: percentiles, TTFT/TPOT/ITL/E2EL statistics and throughput equal hand-computed values.

Pure Python, no server: per-request results are written out by hand (the timestamps a client
would have measured), aggregated, and compared with numbers worked out on paper.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tokenmill.bench.metrics import (
    RequestResult,
    calculate_metrics,
    format_result_block,
    per_request_arrays,
    percentile,
    tpot_of,
)
from tokenmill.bench.results import format_sweep_table, sweep_row
from tokenmill.bench.serve_bench import arrival_gaps


def block_values(block: str) -> dict[str, str]:
    """``label -> value`` of a printed result block."""
    return dict(line.rsplit(":", 1) for line in block.splitlines() if ":" in line and not line.startswith("="))


def hand_results() -> list[RequestResult]:
    """Four requests sent at t=0 (seconds):

    A: chunks at 0.10, 0.15, 0.25, 0.30, 4 tokens -> TTFT 0.10, ITL [0.05, 0.10, 0.05], E2EL 0.30, TPOT 0.2/3
    B: chunks at 0.20, 0.30, stream closes 0.35, 2 tokens -> TTFT 0.20, ITL [0.10], E2EL 0.35, TPOT 0.15
    C: one chunk at 0.05, 1 token -> TTFT 0.05, no ITL, E2EL 0.05, no TPOT
    D: failed (its prompt must not count)
    """
    return [
        RequestResult(True, prompt_len=10, output_len=4, ttft=0.10, itls=[0.05, 0.10, 0.05], e2el=0.30),
        RequestResult(True, prompt_len=20, output_len=2, ttft=0.20, itls=[0.10], e2el=0.35),
        RequestResult(True, prompt_len=30, output_len=1, ttft=0.05, itls=[], e2el=0.05),
        RequestResult(False, prompt_len=40, error="APIConnectionError: Connection error."),
    ]


def test_percentile_interpolates_linearly_like_numpy():
    values = [50.0, 100.0, 200.0]
    assert percentile(values, 50) == 100.0
    assert percentile(values, 90) == pytest.approx(180.0)  # position 1.8: 100 + 0.8 * 100
    assert percentile(values, 99) == pytest.approx(198.0)
    assert percentile(values, 0) == 50.0 and percentile(values, 100) == 200.0
    assert percentile([7.0], 99) == 7.0
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 17, 100):
        sample = sorted(rng.exponential(size=n).tolist())
        for q in (0, 25, 50, 90, 99, 100):
            assert percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)), rel=1e-12)
    with pytest.raises(ValueError, match="q must be"):
        percentile(values, 101)


def test_tpot_is_decode_time_over_output_minus_one():
    a, b, c, d = hand_results()
    assert tpot_of(a) == pytest.approx((0.30 - 0.10) / 3)
    assert tpot_of(b) == pytest.approx(0.15)
    assert tpot_of(c) is None  # one token: no decode phase
    assert tpot_of(d) is None  # failed


def test_metrics_equal_hand_computed_values():
    m = calculate_metrics(hand_results(), duration_s=1.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 7)
    assert m.request_throughput == pytest.approx(3.0)
    assert m.output_throughput == pytest.approx(7.0)
    assert m.total_token_throughput == pytest.approx(67.0)
    # TTFT ms [50, 100, 200]
    assert (m.ttft.mean_ms, m.ttft.median_ms, m.ttft.p90_ms, m.ttft.p99_ms) == pytest.approx((350 / 3, 100, 180, 198))
    # TPOT ms [66.667, 150]
    tpot = 200 / 3
    assert m.tpot.count == 2
    assert (m.tpot.mean_ms, m.tpot.median_ms) == pytest.approx(((tpot + 150) / 2, (tpot + 150) / 2))
    assert m.tpot.p90_ms == pytest.approx(tpot + 0.9 * (150 - tpot))
    assert m.tpot.p99_ms == pytest.approx(tpot + 0.99 * (150 - tpot))
    # ITL ms pooled over requests: [50, 50, 100, 100]
    assert (m.itl.mean_ms, m.itl.median_ms, m.itl.p90_ms, m.itl.p99_ms, m.itl.count) == pytest.approx((75, 75, 100, 100, 4))
    # E2EL ms [50, 300, 350]
    assert (m.e2el.mean_ms, m.e2el.median_ms, m.e2el.p90_ms, m.e2el.p99_ms) == pytest.approx((700 / 3, 300, 340, 349))


def test_no_successes_gives_none_latencies_not_zeros():
    m = calculate_metrics([RequestResult(False, error="x")] * 3, duration_s=0.5)
    assert (m.completed, m.failed, m.total_output_tokens) == (0, 3, 0)
    assert m.ttft.mean_ms is None and m.e2el.p99_ms is None
    values = {k: v.strip() for k, v in block_values(format_result_block(m)).items()}
    assert values["Failed requests"] == "3" and values["Mean TTFT (ms)"] == "n/a"
    with pytest.raises(ValueError, match="duration_s"):
        calculate_metrics([], duration_s=0.0)


def test_result_block_and_json_arrays_carry_the_numbers():
    results = hand_results()
    m = calculate_metrics(results, duration_s=2.0)
    values = {k: v.strip() for k, v in block_values(format_result_block(m)).items()}
    assert values["Successful requests"] == "3" and values["Total generated tokens"] == "7"
    assert values["Total input tokens"] == "60" and values["Benchmark duration (s)"] == "2.00"
    assert values["Request throughput (req/s)"] == "1.50" and values["Output token throughput (tok/s)"] == "3.50"
    assert values["Median TTFT (ms)"] == "100.00" and values["P99 E2EL (ms)"] == "349.00"
    assert values["Mean ITL (ms)"] == "75.00" and values["Median TPOT (ms)"] == "108.33"
    arrays = per_request_arrays(results)
    assert arrays["output_lens"] == [4, 2, 1, 0]
    assert arrays["ttfts"] == [0.10, 0.20, 0.05, None]
    assert arrays["tpots"][2:] == [None, None]
    assert arrays["errors"][:3] == ["", "", ""] and arrays["errors"][3].startswith("APIConnectionError")
    json.dumps({**m.summary(), **arrays})  # JSON-ready: no infinities, no objects
    assert m.summary()["median_ttft_ms"] == pytest.approx(100.0)


def test_sweep_table_has_one_row_per_level():
    rows = [sweep_row(c, calculate_metrics(hand_results(), duration_s=float(c))) for c in (1, 4)]
    table = format_sweep_table(rows).splitlines()
    assert len(table) == 3 and "conc" in table[0] and "med TTFT" in table[0]
    assert table[1].split()[:5] == ["1", "3", "1", "3.00", "7.0"]
    assert table[2].split()[:5] == ["4", "3", "1", "0.75", "1.8"]


def test_poisson_arrival_gaps_are_seeded_with_the_requested_mean():
    assert arrival_gaps(4, math.inf, 0) == [0.0] * 4
    gaps = arrival_gaps(4001, 20.0, seed=3)
    assert gaps[0] == 0.0 and gaps == arrival_gaps(4001, 20.0, seed=3) and gaps != arrival_gaps(4001, 20.0, seed=4)
    assert sum(gaps[1:]) / 4000 == pytest.approx(1 / 20.0, rel=0.05)
