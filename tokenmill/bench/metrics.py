"""Benchmark metric arithmetic: per-request results in, TTFT/TPOT/ITL/E2EL statistics and throughput out.

Pure Python (no torch, no numpy, no I/O besides formatting strings). Definitions, all per successful
request: TTFT = first content token - request sent; E2EL = last byte - request sent; ITL = the gaps
between consecutive content chunks; TPOT = (E2EL - TTFT) / (output_len - 1), for output_len > 1.
Percentiles interpolate linearly between order statistics (numpy's default "linear" method).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# Percentiles reported for every latency metric (besides the mean).
PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestResult:
    """What one benchmark request measured. Times are seconds (``start_time`` is relative to the run start).

    ``output_len``/``prompt_len`` come from the server's ``usage`` when it sent one, else from the
    client tokenizer. ``error`` is empty for a successful request.
    """

    success: bool
    prompt_len: int = 0
    output_len: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2el: float | None = None
    start_time: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median, p90 and p99 of one latency metric, in milliseconds (None when there are no samples)."""

    mean_ms: float | None
    median_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    count: int

    @classmethod
    def of_seconds(cls, values: list[float]) -> LatencyStats:
        """Statistics of ``values`` (seconds) converted to milliseconds."""
        if not values:
            return cls(None, None, None, None, 0)
        ms = sorted(v * 1000.0 for v in values)
        return cls(math.fsum(ms) / len(ms), percentile(ms, 50.0), percentile(ms, 90.0), percentile(ms, 99.0), len(ms))


@dataclass(frozen=True)
class BenchmarkMetrics:
    """Aggregate result of one benchmark run (the numbers of the printed result block)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats

    def summary(self) -> dict[str, float | int | None]:
        """Flat JSON-ready dict: counts, throughputs and ``{mean,median,p90,p99}_{ttft,tpot,itl,e2el}_ms``."""
        out: dict[str, float | int | None] = {
            "completed": self.completed,
            "failed": self.failed,
            "duration": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            stats: LatencyStats = getattr(self, name)
            for stat in ("mean", "median", "p90", "p99"):
                out[f"{stat}_{name}_ms"] = getattr(stats, f"{stat}_ms")
        return out


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of an ascending, non-empty list, interpolating linearly.

    Position ``(n - 1) * q / 100`` between order statistics, as ``numpy.percentile`` does by default.
    """
    assert sorted_values, "percentile of no values"
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def tpot_of(result: RequestResult) -> float | None:
    """(E2EL - TTFT) / (output_len - 1): mean time per output token after the first; None below 2 tokens."""
    if not result.success or result.output_len < 2 or result.ttft is None or result.e2el is None:
        return None
    return (result.e2el - result.ttft) / (result.output_len - 1)


def calculate_metrics(results: list[RequestResult], duration_s: float) -> BenchmarkMetrics:
    """Aggregate per-request results over a run of ``duration_s`` seconds.

    Token totals and latencies count successful requests only; ITL pools every gap of every
    successful request.

    Raises:
        ValueError: duration_s is not positive.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [t for r in ok if (t := tpot_of(r)) is not None]
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft=LatencyStats.of_seconds([r.ttft for r in ok if r.ttft is not None]),
        tpot=LatencyStats.of_seconds(tpots),
        itl=LatencyStats.of_seconds([gap for r in ok for gap in r.itls]),
        e2el=LatencyStats.of_seconds([r.e2el for r in ok if r.e2el is not None]),
    )


def per_request_arrays(results: list[RequestResult]) -> dict[str, list]:
    """The per-request arrays saved in result JSON (seconds; one entry per request, failed ones too)."""
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "tpots": [tpot_of(r) for r in results],
        "itls": [r.itls for r in results],
        "e2els": [r.e2el for r in results],
        "start_times": [r.start_time for r in results],
        "errors": [r.error for r in results],
    }


_LATENCY_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def format_result_block(
    metrics: BenchmarkMetrics,
    title: str = "Serving Benchmark Result",
    extra: dict[str, str] | None = None,
    latencies: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el"),
) -> str:
    """The familiar ``bench serve`` result block: counts, throughputs, then mean/median/p90/p99 per latency.

    ``extra`` rows (label -> text) go after the counts; ``latencies`` picks which sections to show.
    """
    width = 50
    lines = [f"{{:=^{width}}}".format(f" {title} ")]

    def row(label: str, value: str) -> None:
        lines.append(f"{label + ':':<40}{value:>10}")

    row("Successful requests", str(metrics.completed))
    row("Failed requests", str(metrics.failed))
    for label, text in (extra or {}).items():
        row(label, text)
    row("Benchmark duration (s)", f"{metrics.duration_s:.2f}")
    row("Total input tokens", str(metrics.total_input_tokens))
    row("Total generated tokens", str(metrics.total_output_tokens))
    row("Request throughput (req/s)", f"{metrics.request_throughput:.2f}")
    row("Output token throughput (tok/s)", f"{metrics.output_throughput:.2f}")
    row("Total token throughput (tok/s)", f"{metrics.total_token_throughput:.2f}")
    for name in latencies:
        stats: LatencyStats = getattr(metrics, name)
        lines.append(f"{{:-^{width}}}".format(_LATENCY_TITLES[name]))
        short = name.upper()
        row(f"Mean {short} (ms)", _fmt(stats.mean_ms))
        row(f"Median {short} (ms)", _fmt(stats.median_ms))
        row(f"P90 {short} (ms)", _fmt(stats.p90_ms))
        row(f"P99 {short} (ms)", _fmt(stats.p99_ms))
    lines.append("=" * width)
    return "\n".join(lines)
