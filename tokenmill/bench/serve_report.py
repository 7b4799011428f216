"""``bench serve`` driver: resolve the model, run once or sweep concurrency levels, print, save JSON, plot.

Kept apart from the load generator so ``serve_bench`` stays free of printing and files.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenmill.bench.metrics import format_result_block
from tokenmill.bench.results import default_result_path, format_sweep_table, run_record, sweep_row, write_json
from tokenmill.bench.serve_bench import LoadConfig, run_serve_benchmark
from tokenmill.bench.serve_client import ClientConfig, discover_model, make_client
from tokenmill.bench.workload import Conversation, DatasetConfig

logger = logging.getLogger(__name__)


async def resolve_model(client: Any, config: ClientConfig) -> ClientConfig:
    """``config`` with ``model`` from /v1/models when unset; left None (with a warning) if the server cannot say."""
    if config.model is not None:
        return config
    try:
        return replace(config, model=await discover_model(client))
    except Exception as exc:  # an unreachable server still gets benchmarked: every request fails and is counted
        logger.warning("could not list models at %s (%s: %s); sending model=None", config.api_base,
                       type(exc).__name__, exc)
        return config


def _plot_path(plot: str | None, json_path: Path) -> Path | None:
    """Where to write the PNG: ``plot`` itself, next to the JSON when ``plot`` is "", nowhere when None."""
    if plot is None:
        return None
    if importlib.util.find_spec("matplotlib") is None:
        print("note: plotting needs matplotlib (pip install matplotlib); no plot written")
        return None
    return Path(plot) if plot else json_path.with_suffix(".png")


def error_summary(errors: list[str], limit: int = 3) -> str:
    """The most common failure messages, ``N x message`` per line (empty when nothing failed)."""
    counts = Counter(e[:200] for e in errors if e)
    return "\n".join(f"  {n} x {message}" for message, n in counts.most_common(limit))


def _print_run(block: str, errors: list[str]) -> None:
    print(block)
    summary = error_summary(errors)
    if summary:
        print(f"failures:\n{summary}")


def _header(config: ClientConfig, load: LoadConfig, dataset: DatasetConfig, workload: list[Conversation]) -> str:
    turns = sum(len(c.turns) for c in workload)
    rate = "inf" if math.isinf(load.request_rate) else f"{load.request_rate:g}/s"
    return (f"model {config.model} at {config.api_base} ({config.endpoint}); dataset {dataset.name}: "
            f"{len(workload)} conversations, {turns} requests; request rate {rate}; "
            f"max concurrency {load.max_concurrency or 'unlimited'}")


async def run_and_report(config: ClientConfig, load: LoadConfig, dataset: DatasetConfig, workload: list[Conversation],
                         tokenizer: Any, args: argparse.Namespace, levels: list[int] | None) -> int:
    """Run the benchmark (each of ``levels`` when sweeping), print the blocks, write JSON and plots; exit code 0."""
    client = make_client(config)
    try:
        config = await resolve_model(client, config)
        tokenizer_id = args.tokenizer or "embedded SmolLM2-135M-Instruct"
        if levels is None:
            print(_header(config, load, dataset, workload))
            run = await run_serve_benchmark(client, config, load, workload, tokenizer)
            _print_run(format_result_block(run.metrics, extra={"Token counts from": run.usage_source}),
                       [r.error for r in run.results])
            record = run_record(run, config, load, dataset, tokenizer_id)
            path = args.result_file or default_result_path(dataset.name, config.endpoint, load.max_concurrency)
            if args.save_result or args.result_file is not None:
                print(f"wrote {write_json(path, record)}")
            plot = _plot_path(args.plot, path)
            if plot is not None:
                from tokenmill.bench.plot import plot_latency_distributions

                print(f"wrote {plot_latency_distributions(record, plot)}")
            return 0
        rows, records = [], []
        for i, level in enumerate(levels):
            level_load = replace(load, max_concurrency=level, num_warmups=load.num_warmups if i == 0 else 0)
            print(_header(config, level_load, dataset, workload))
            run = await run_serve_benchmark(client, config, level_load, workload, tokenizer)
            _print_run(format_result_block(run.metrics, f"Concurrency {level}",
                                           extra={"Token counts from": run.usage_source}),
                       [r.error for r in run.results])
            rows.append(sweep_row(level, run.metrics))
            records.append(run_record(run, config, level_load, dataset, tokenizer_id))
        print("\nThroughput vs latency (ms)")
        print(format_sweep_table(rows))
        path = args.result_file or default_result_path(dataset.name, config.endpoint, None, suffix="-sweep")
        print(f"wrote {write_json(path, {'sweep': rows, 'runs': records})}")
        plot = _plot_path(args.plot or "", path)  # sweeps always plot (next to the JSON unless --plot PNG)
        if plot is not None:
            from tokenmill.bench.plot import plot_sweep

            print(f"wrote {plot_sweep(rows, plot, f'{config.model}: {dataset.name}, {config.endpoint}')}")
        return 0
    finally:
        await client.close()
