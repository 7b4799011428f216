"""PNG plots of benchmark results with matplotlib's Agg renderer (no display, no pyplot global state).

``plot_latency_distributions`` draws one run's TTFT/TPOT/ITL/E2EL histograms from its saved
record; ``plot_sweep`` draws throughput against latency across concurrency levels.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenmill.bench.metrics import percentile

_PANELS = (("ttfts", "TTFT"), ("tpots", "TPOT"), ("itls", "ITL"), ("e2els", "E2EL"))


def _figure(width: float, height: float):
    from matplotlib.figure import Figure  # Figure.savefig renders with Agg for .png; pyplot is never touched

    return Figure(figsize=(width, height), layout="constrained")


def _samples_ms(record: dict[str, Any], key: str) -> list[float]:
    """A per-request array of the record in ms (ITL lists flattened; failed requests' None dropped)."""
    values = record.get(key) or []
    flat = [v for item in values for v in item] if key == "itls" else values
    return [v * 1000.0 for v in flat if v is not None]


def plot_latency_distributions(record: dict[str, Any], path: Path, title: str | None = None) -> Path:
    """Histograms of TTFT, TPOT, ITL and E2EL (ms) with median and p99 marked; returns ``path``."""
    fig = _figure(11, 7)
    axes = fig.subplots(2, 2).ravel()
    for ax, (key, name) in zip(axes, _PANELS):
        ms = sorted(_samples_ms(record, key))
        ax.set_title(f"{name} ({len(ms)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
        if not ms:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.hist(ms, bins=min(50, max(5, len(ms) // 2)), color="tab:blue", alpha=0.8)
        for q, style in ((50.0, "--"), (99.0, ":")):
            value = percentile(ms, q)
            ax.axvline(value, color="tab:red", linestyle=style, label=f"p{q:g} {value:.1f} ms")
        ax.legend(fontsize=8)
    fig.suptitle(title or f"{record.get('backend', '')} {record.get('model_id', '')}: "
                 f"{record.get('completed', 0)} requests, concurrency {record.get('max_concurrency')}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def plot_sweep(rows: list[dict[str, Any]], path: Path, title: str = "throughput vs latency") -> Path:
    """Output tok/s against median/p99 TPOT and TTFT, one point per concurrency level; returns ``path``."""
    fig = _figure(11, 4.5)
    axes = fig.subplots(1, 2)
    xs = [r["output_throughput"] for r in rows]
    for ax, metric in zip(axes, ("tpot", "ttft")):
        for stat, marker in (("median", "o-"), ("p99", "s--")):
            ys = [r.get(f"{stat}_{metric}_ms") for r in rows]
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, label=f"{stat} {metric.upper()}")
        for r, x in zip(rows, xs):
            y = r.get(f"median_{metric}_ms")
            if y is not None:
                ax.annotate(f"c={r['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
