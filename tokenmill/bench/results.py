"""Benchmark result records: the saved JSON of a run, the sweep table (throughput vs latency) and file names.

JSON holds no infinities (``request_rate`` inf is written as the string "inf"); per-request arrays
are in seconds, summary latencies in milliseconds.
"""
from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenmill.bench.metrics import BenchmarkMetrics, per_request_arrays
from tokenmill.bench.serve_bench import LoadConfig, ServeRun
from tokenmill.bench.serve_client import ClientConfig
from tokenmill.bench.workload import DatasetConfig


def _rate(value: float) -> float | str:
    return "inf" if math.isinf(value) else value


def run_record(run: ServeRun, client: ClientConfig, load: LoadConfig, dataset: DatasetConfig,
               tokenizer_id: str) -> dict[str, Any]:
    """Everything about one run as a JSON-ready dict: settings, the summary metrics, per-request arrays."""
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": f"openai-{client.endpoint}",
        "base_url": client.api_base,
        "endpoint": client.endpoint,
        "model_id": client.model,
        "tokenizer_id": tokenizer_id,
        "dataset_name": dataset.name,
        "num_prompts": dataset.num_prompts,
        "num_requests": len(run.results),
        "request_rate": _rate(load.request_rate),
        "max_concurrency": run.max_concurrency,
        "num_warmups": load.num_warmups,
        "seed": dataset.seed,
        "temperature": client.temperature,
        "top_p": client.top_p,
        "top_k": client.top_k,
        "min_p": client.min_p,
        "ignore_eos": client.ignore_eos,
        "token_counts_from": run.usage_source,
        **run.metrics.summary(),
        **per_request_arrays(run.results),
    }


# (summary key, column title, width, decimals; None for integers)
SWEEP_COLUMNS: tuple[tuple[str, str, int, int | None], ...] = (
    ("concurrency", "conc", 6, None),
    ("completed", "ok", 5, None),
    ("failed", "fail", 5, None),
    ("request_throughput", "req/s", 8, 2),
    ("output_throughput", "out tok/s", 11, 1),
    ("total_token_throughput", "tot tok/s", 11, 1),
    ("median_ttft_ms", "med TTFT", 10, 1),
    ("p99_ttft_ms", "p99 TTFT", 10, 1),
    ("median_tpot_ms", "med TPOT", 10, 1),
    ("p99_tpot_ms", "p99 TPOT", 10, 1),
    ("median_itl_ms", "med ITL", 9, 1),
    ("median_e2el_ms", "med E2EL", 10, 1),
)


def sweep_row(concurrency: int, metrics: BenchmarkMetrics) -> dict[str, Any]:
    """One sweep level: its concurrency and the run's summary metrics."""
    return {"concurrency": concurrency, **metrics.summary()}


def format_sweep_table(rows: list[dict[str, Any]]) -> str:
    """Throughput-vs-latency table, one line per concurrency level (latencies in ms)."""
    lines = ["".join(f"{title:>{width}}" for _, title, width, _ in SWEEP_COLUMNS)]
    for row in rows:
        cells = []
        for key, _, width, decimals in SWEEP_COLUMNS:
            value = row.get(key)
            if value is None:
                cells.append(f"{'n/a':>{width}}")
            elif decimals is None:
                cells.append(f"{value:>{width}}")
            else:
                cells.append(f"{value:>{width}.{decimals}f}")
        lines.append("".join(cells))
    return "\n".join(lines)


def default_result_path(dataset: str, endpoint: str, concurrency: int | None, suffix: str = "") -> Path:
    """``tokenmill-bench-{dataset}-{endpoint}-c{N|inf}{suffix}-{date}.json`` in the working directory."""
    conc = "inf" if concurrency is None else str(concurrency)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(f"tokenmill-bench-{dataset}-{endpoint}-c{conc}{suffix}-{stamp}.json")


def write_json(path: Path, record: dict[str, Any]) -> Path:
    """Write ``record`` as indented JSON (parent directories created); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
